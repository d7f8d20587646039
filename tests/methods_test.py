"""jaxcomp.methods: one object per method, the string shorthand, and a method defined here, outside
jaxcomp."""

import ast
import dataclasses
import functools
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_equal, need_devices, subprocess_env
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import collectives, methods
from jaxcomp.costmodel import advise, cost
from jaxcomp.methods import Dense, Method, Quantized, Sign, TopK, Zfp

# compress(mean=False) makes these references exact sums, and compress(seed=) sets the key: both
# deprecated until jaxcomp 0.3, so these tests also keep the old keywords working.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:compress(_auto)?\((mean|seed)=\) is deprecated:DeprecationWarning"
)

N_DEVICES = 8
ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = pathlib.Path(jaxcomp.__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Cast16(Method):
    """A method written outside jaxcomp: the gradient crosses the wire in bfloat16 (a dense
    all-reduce of half the bytes); what the cast lost stays in the residual."""

    allreduce: str = "ring"
    name = "cast16"

    def aggregate(self, x, axis_name, *, step, key, sparse=False, state=None):
        total, sent = collectives.psum(x.astype(jnp.bfloat16), axis_name)
        return total.astype(x.dtype), sent.astype(x.dtype), state  # no state: returned as given

    def wire_bytes(self, n, n_devices, *, dtype_bytes=4, inner_size=None):
        return 0.0 if n_devices == 1 else 2.0 * (n_devices - 1) / n_devices * n * 2

    def message_steps(self, n_devices, *, inner_size=None):
        return 2 * (n_devices - 1)

    def local_work(self, n_values, n_devices):
        return lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)


def _mesh(n=N_DEVICES):
    need_devices(n)
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def _aggregate(tx, g, steps=1):
    """Runs ``tx`` for ``steps`` updates inside shard_map on the per-device rows of ``g``."""

    def run(g):
        state = tx.init(g[0])
        for _ in range(steps):
            updates, state = tx.update(g[0], state)
        return updates, state.metrics.bytes_sent, state.metrics.method

    return jax.jit(jax.shard_map(run, mesh=_mesh(), in_specs=P("data"), out_specs=(P(), P(), P())))(
        g
    )


# --- the objects -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: TopK(), "exactly one of ratio"),
        (lambda: TopK(0.1, k=3), "exactly one of ratio"),
        (lambda: TopK(1.5), "ratio must be in"),
        (lambda: TopK(k=0), "k must be"),
        (lambda: TopK(0.1, collective="ring"), "collective must be one of"),
        (lambda: TopK(0.1, selector="fast"), "selector must be one of"),
        (lambda: TopK(0.1, leader="var"), "leader= applies to collective='ar' only"),
        (lambda: TopK(0.1, collective="ar", leader="max"), "leader must be one of"),
        (lambda: TopK(0.1, allreduce="tree"), "allreduce= applies to collective='ar' only"),
        (lambda: Zfp(0), "rate must be"),
        (lambda: Zfp(8, algorithm="tree"), "algorithm must be one of"),
        (lambda: Quantized(17), "bits must be"),
        (lambda: Quantized(4, hadamard="yes"), "hadamard must be True or False"),
        (lambda: Dense(allreduce="star"), "allreduce must be one of"),
        (lambda: Sign(0), "chunk must be"),
        (lambda: Sign(aggregation="tree"), "aggregation must be one of"),
        (lambda: Sign(allreduce="tree"), "costs aggregation='allreduce' only"),
    ],
)
def test_methods_validate_themselves_at_construction(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


def test_split_leader_costs_an_all_gather_of_indices_and_one_all_reduce():
    """AR-Topk's SPLIT: ceil(k/N) int32 indices all-gathered ((N-1) of them a device), N of those
    counts of values all-reduced; log2 N + 2(N-1) messages on a ring, against STAR's 4(N-1)."""
    split, star = TopK(k=37, collective="ar"), TopK(k=37, collective="ar", leader="star")
    assert split.leader == "split"  # the default since 2026-11-29
    each = 5  # ceil(37 / 8)
    assert split.wire_bytes(1000, 8) == 7 * each * 4 + 2 * 7 / 8 * (8 * each * 4)
    assert split.wire_bytes(1000, 8) < star.wire_bytes(1000, 8) and split.wire_bytes(1000, 1) == 0
    assert split.message_steps(8) == 3 + 14 and star.message_steps(8) == 28
    assert split.with_ratio(0.1) == TopK(0.1, collective="ar", leader="split")
    # The density metric counts the N ceil(k/N) slots each device's values fill, STAR's k.
    assert (split.kept_on(1000, 8), star.kept_on(1000, 8), split.kept_on(1000, 1)) == (40, 37, 37)
    assert TopK(k=37).kept_on(1000, 8) == 37 and TopK(k=3, collective="ar").kept_on(4, 8) == 4
    # Its local work, for the cost model's timing: this device's top ceil(k/N) taken off.
    x = np.arange(1000, dtype=np.float32)
    left = np.asarray(split.local_work(1000, 8)(jnp.asarray(x)))
    np.testing.assert_array_equal(left, np.where(x >= 1000 - each, 0, x))
    # The all-gather's (whose leader field keeps its default) takes its whole top k off.
    left = np.asarray(TopK(k=37).local_work(1000, 8)(jnp.asarray(x)))
    np.testing.assert_array_equal(left, np.where(x >= 1000 - 37, 0, x))


def test_methods_are_frozen_hashable_values():
    assert TopK(0.01, collective="ar") == TopK(ratio=0.01, collective="ar")
    assert len({Dense(), Dense(), TopK(0.01), TopK(0.01, collective="ar")}) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        TopK(0.01).ratio = 0.1
    assert TopK(0.01, collective="ar").with_ratio(0.1) == TopK(0.1, collective="ar")
    assert Zfp(8).with_ratio(0.1) is None and Dense().with_ratio(0.1) is None


@pytest.mark.parametrize("name", sorted(methods.SHORTHAND))
def test_every_shorthand_name_builds_the_method_of_that_label(name):
    method = methods.parse(name, strict=False, ratio=0.01, rate=8, bits=4)
    assert isinstance(method, Method)
    # A label names its method again (the *_ring names are the cost model's former aliases, the
    # ar_topk_split names SPLIT's from before it was AR-Topk's default leader).
    assert methods.parse(method.label, strict=False, ratio=0.01, rate=8, bits=4) == method
    former = {"ar_topk_split": "ar_topk", "ar_topk_split_tree": "ar_topk_tree"}
    assert method.label == former.get(name, name.removesuffix("_ring")) or name.endswith("_ring")


def test_parse_refuses_options_on_objects_and_unknown_names():
    with pytest.raises(ValueError, match="carries its own settings"):
        methods.parse(TopK(0.01), ratio=0.1)
    with pytest.raises(ValueError, match="one of"):
        methods.parse("topk", ratio=0.1)
    with pytest.raises(TypeError, match="Method"):
        methods.parse(3)


@pytest.mark.parametrize(
    "name, options, method",
    [
        ("ar_topk", dict(ratio=0.25, leader="var"), TopK(0.25, collective="ar", leader="var")),
        ("allgather_topk", dict(k=3, selector="threshold"), TopK(k=3, selector="threshold")),
        ("quantized", dict(bits=8, hadamard=False), Quantized(8, hadamard=False)),
        ("zfp", dict(rate=12), Zfp(12)),
        ("dense", {}, Dense()),
        ("sign_majority", dict(chunk=16), Sign(16, aggregation="majority")),
    ],
)
def test_the_string_shorthand_is_the_object_bit_for_bit(name, options, method):
    g = jax.random.normal(jax.random.key(0), (N_DEVICES, 64))
    by_name = _aggregate(jaxcomp.compress(name, **options), g, steps=2)
    by_object = _aggregate(jaxcomp.compress(method), g, steps=2)
    assert_trees_equal(by_name, by_object)


# --- a method defined outside jaxcomp ------------------------------------------------------------


def test_an_outside_method_aggregates_with_error_feedback_in_compress():
    g = jax.random.normal(jax.random.key(1), (N_DEVICES, 1000))
    updates, bytes_sent, method = _aggregate(jaxcomp.compress(Cast16(), mean=False), g)
    expected = np.asarray(g.astype(jnp.bfloat16).astype(jnp.float32)).sum(axis=0)
    np.testing.assert_allclose(np.asarray(updates), expected, rtol=1e-2, atol=1e-2)
    assert float(bytes_sent) == Cast16().wire_bytes(1000, N_DEVICES) == 2 * 7 / 8 * 2000
    assert int(method) == 0
    # The residual holds exactly what the cast lost.
    tx = jaxcomp.compress(Cast16())

    def residual(g):
        state = tx.update(g[0], tx.init(g[0]))[1]
        return state.residual[None]

    kept = jax.jit(jax.shard_map(residual, mesh=_mesh(), in_specs=P("data"), out_specs=P("data")))(
        g
    )
    np.testing.assert_array_equal(
        np.asarray(kept), np.asarray(g - g.astype(jnp.bfloat16).astype(jnp.float32))
    )


def test_a_method_written_for_the_old_protocol_still_works_and_is_told_how_to_update():
    """jaxcomp 0.1's protocol (aggregate without state=, returning (total, sent); stateful methods'
    aggregate_stateful) keeps working until 0.3, with a warning naming the new signature."""
    with pytest.warns(DeprecationWarning, match=r"state=None\) returning \(total, sent, state\)"):

        @dataclasses.dataclass(frozen=True)
        class OldCast16(Cast16):
            def aggregate(self, x, axis_name, *, step, key, sparse=False):
                sent = x.astype(jnp.bfloat16)
                return jax.lax.psum(sent, axis_name).astype(x.dtype), sent.astype(x.dtype)

    g = jax.random.normal(jax.random.key(1), (N_DEVICES, 1000))
    old = _aggregate(jaxcomp.compress(OldCast16(), mean=False), g, steps=3)
    new = _aggregate(jaxcomp.compress(Cast16(), mean=False), g, steps=3)
    np.testing.assert_array_equal(np.asarray(old[0]), np.asarray(new[0]))

    with pytest.warns(DeprecationWarning, match="aggregate_stateful is jaxcomp 0.1's protocol"):

        @dataclasses.dataclass(frozen=True)
        class OldCounted(Cast16):
            """Counts its steps in a state of its own."""

            stateful = True

            def init_state(self, shapes):
                return jnp.zeros((), jnp.int32)

            def kept(self, n, shapes=None):
                return n

            def wire_bytes(self, n, n_devices, *, dtype_bytes=4, inner_size=None, shapes=None):
                return Cast16.wire_bytes(self, n, n_devices)

            def aggregate_stateful(self, x, axis_name, *, step, key, state, shapes):
                total, sent, _ = Cast16.aggregate(self, x, axis_name, step=step, key=key)
                return total, sent, state + 1

    method = OldCounted()
    assert method.stateful
    tx = jaxcomp.compress(method, mean=False)

    def count(g):
        state = tx.init(g[0])
        for _ in range(3):
            updates, state = tx.update(g[0], state)
        return updates[None], jaxcomp.find_compress_state(state).method_state[0][0]

    updates, steps = jax.jit(
        jax.shard_map(count, mesh=_mesh(), in_specs=P("data"), out_specs=(P("data"), P()))
    )(g)
    np.testing.assert_array_equal(np.asarray(updates[0]), np.asarray(new[0]))
    assert int(steps) == 3


def test_an_outside_method_is_costed_chosen_and_advised():
    net_fast, net_slow = cost.Network.parse("1us", "100GB/s"), cost.Network.parse("1ms", "1gbit")
    nbytes = 4e8
    assert cost.predict(Cast16(), nbytes, 8, net_slow) == pytest.approx(
        14e-3 + 2 * 7 / 8 * 2e8 * 8e-9
    )  # half the bytes of dense, the same steps
    assert cost.choose(nbytes, 8, net_slow, candidates=[Dense(), Cast16()]) == Cast16()
    # With 50 ms of local work a fast network keeps dense.
    assert (
        cost.choose(nbytes, 8, net_fast, candidates=[Dense(), Cast16()], overhead={Cast16(): 0.05})
        == Dense()
    )
    step = advise.compressed_time(Cast16(), nbytes, 8, net_slow, 0.1)
    assert step == pytest.approx(0.1 + cost.predict(Cast16(), nbytes, 8, net_slow))
    assert jaxcomp.costmodel.probe.codec_seconds(Cast16(), 4096, repeats=1) > 0


def test_an_outside_method_runs_in_compress_auto_and_is_chosen_on_a_slow_network():
    slow = cost.Network.parse("1ms", "1gbit")
    tx = jaxcomp.compress_auto([Dense(), Cast16()], network=slow)
    g = jax.random.normal(jax.random.key(2), (N_DEVICES, 1000))
    _, bytes_sent, method = _aggregate(tx, g)
    assert int(method) == 1 and float(bytes_sent) == Cast16().wire_bytes(1000, N_DEVICES)
    assert jaxcomp.auto_branches(tx.init({"w": jnp.zeros(3)})) == [[Dense(), Cast16()]]


def test_compress_auto_validates_its_candidates():
    with pytest.raises(TypeError, match="candidates"):
        jaxcomp.compress_auto("dense")
    with pytest.raises(TypeError, match="candidates"):
        jaxcomp.compress_auto([Dense(), "zfp"])
    with pytest.raises(ValueError, match="distinct"):
        jaxcomp.compress_auto([Dense(), Dense()])
    with pytest.raises(ValueError, match="typed varying"):
        jaxcomp.compress_auto([Dense(), Zfp(8, algorithm="recursive_doubling")])
    with pytest.raises(ValueError, match="outer, inner"):
        jaxcomp.compress_auto([Dense(), TopK(0.01, collective="hierarchical")])
    with pytest.raises(ValueError, match="candidate with a ratio"):
        jaxcomp.compress_auto([Dense(), Zfp(8)], ratio_search=jaxcomp.RatioSearch())
    with pytest.raises(TypeError, match="ratio_search"):
        jaxcomp.compress_auto([Dense(), TopK(0.01)], ratio_search=(0.001, 0.1))
    with pytest.raises(ValueError, match="explore_steps"):
        jaxcomp.RatioSearch(explore_steps=0)


def test_compress_auto_with_a_ratio_search_makes_one_branch_per_ratio():
    search = jaxcomp.RatioSearch((0.01, 0.1))
    state = jaxcomp.compress_auto([TopK(0.5, collective="ar"), Dense()], ratio_search=search).init(
        {"w": jnp.zeros(3)}
    )
    assert [m.describe() for m in state.methods] == [
        "ar_topk(0.1)",
        "ar_topk(0.0333)",
        "ar_topk(0.01)",
        "dense",
    ]


# --- the layers
# ------------------------------------------------------------------------------------

# The names of the methods, as string literals: only the methods package (its SHORTHAND table) may
# spell them.
METHOD_NAMES = set(methods.SHORTHAND)
ALLOWED = {
    "methods/__init__.py": "the shorthand table",
    "collectives/__init__.py": "the lazy table of the collectives, some named like their methods",
    "training/to_loss.py": "time to quality's rows, named on its command line after the methods "
    "they run (`--rows dp,ar_topk`); a table, no per-method branch",
}


def _string_literals(path):
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def test_no_module_above_the_methods_names_a_method():
    """Per-method branches live in jaxcomp.methods; the rest iterates method objects."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if (
            relative.startswith("methods/")
            and relative != "methods/__init__.py"
            or relative in ALLOWED
        ):
            continue
        found += [
            f"{relative}:{node.lineno}: {node.value!r}"
            for node in _string_literals(path)
            if node.value in METHOD_NAMES
        ]
    assert not found, "method names spelled outside jaxcomp.methods:\n" + "\n".join(found)


def _is_module(package, name) -> bool:
    """Whether ``package.name`` is a module of jaxcomp (``jaxcomp.ops._checks``,
    ``jaxcomp.cli._report``)."""
    base = PACKAGE.joinpath(*package.split(".")[1:], name)
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def test_no_private_name_is_imported_across_modules():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxcomp"):
                found += [
                    f"{path.relative_to(PACKAGE)}:{node.lineno}: {alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_")
                    and not alias.name.startswith("_jaxcomp_")  # the native modules
                    and not _is_module(node.module, alias.name)  # a package's private module
                ]
    assert not found, "private names imported from another module:\n" + "\n".join(found)


#: jax.lax's cross-device exchanges; axis_index and axis_size only ask about the mesh.
LAX_COLLECTIVES = {
    "all_gather",
    "all_gather_invariant",
    "all_to_all",
    "pbroadcast",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "pshuffle",
    "psum",
    "psum_scatter",
    "pswapaxes",
    "ragged_all_to_all",
}


def _lax_collectives(source: str) -> list[str]:
    """``line: name`` of each jax.lax collective ``source`` names (called or passed on)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "jax.lax":
            found += [f"{node.lineno}: {a.name}" for a in node.names if a.name in LAX_COLLECTIVES]
        elif isinstance(node, ast.Attribute) and node.attr in LAX_COLLECTIVES:
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "lax") or (
                isinstance(base, ast.Attribute) and base.attr == "lax"
            ):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_every_cross_device_byte_goes_through_the_collectives():
    """STYLE.md: the methods, the optimizer's stages, the training step, the probe and the
    benchmarks' baseline call jaxcomp.collectives, never a jax.lax collective themselves, so every
    exchange is in one layer (the plain all-reduce a program without jaxcomp runs is
    jaxcomp.collectives.baseline)."""
    found = [
        f"{path.relative_to(PACKAGE)}:{hit}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "collectives"
        for hit in _lax_collectives(path.read_text())
    ]
    assert not found, "jax.lax collectives called outside jaxcomp.collectives:\n" + "\n".join(found)


def test_the_collective_finder_finds_them():
    source = (
        "import jax\nfrom jax import lax\nfrom jax.lax import ppermute\n"
        "def f(x, a):\n    jax.lax.psum(x, a); lax.all_gather(x, a); g(jax.lax.pmax)\n"
        "    return jax.lax.axis_index(a), jax.lax.axis_size(a)\n"
    )
    assert _lax_collectives(source) == [
        "3: ppermute",
        "5: jax.lax.psum",
        "5: lax.all_gather",
        "5: jax.lax.pmax",
    ]


# --- imports cost nothing until used
# ----------------------------------------------------------------


def _modules_after(code):
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        env=subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "code",
    [
        "import jaxcomp",
        "import jaxcomp.costmodel.cost",
        "import jaxcomp.methods",
        "from jaxcomp.costmodel import cost; cost.predict('ar_topk', 4e8, 8, "
        "cost.Network.parse('1ms', '1gbit'), ratio=0.01)",
    ],
)
def test_importing_the_package_and_the_cost_model_loads_no_jax(code):
    loaded = _modules_after(code)
    assert not {"jax", "optax", "flax", "jaxcomp._jaxcomp_cpu"} & loaded


def test_advise_help_loads_no_jax_and_runs_from_the_checkout_root():
    loaded = _modules_after(
        "import jaxcomp.__main__ as m\ntry:\n    m.main(['advise', '--help'])\nexcept SystemExit:\n"
        "    pass"
    )
    assert "jax" not in loaded
    # From the repository's root (the source tree is src/jaxcomp, so nothing shadows the package).
    out = subprocess.run(
        [sys.executable, "-m", "jaxcomp", "advise", "--help"],
        env=subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "--bandwidth" in out.stdout, out.stderr


def test_names_load_on_first_use():
    assert jaxcomp.compress is jaxcomp.optim.transform.compress
    assert jaxcomp.topk is jaxcomp.ops.topk.topk
    assert (
        callable(jaxcomp.probe_network)
        and jaxcomp.costmodel.probe.__name__ == "jaxcomp.costmodel.probe"
    )
    with pytest.raises(AttributeError, match="no attribute"):
        _ = jaxcomp.nope


def test_every_method_module_is_found_and_its_names_join_the_shorthand():
    """Adding a method is one module (and its test): its class and names are found, not listed."""
    assert set(methods._METHODS) == {
        "Cast",
        "Dense",
        "PowerSGD",
        "Quantized",
        "RandomK",
        "Sign",
        "TopK",
        "Zfp",
    }
    for name, build in methods.SHORTHAND.items():
        cls = build.func if isinstance(build, functools.partial) else build
        assert name in cls.shorthand and methods._METHODS[cls.__name__] is cls
        assert getattr(methods, cls.__name__) is cls


def test_a_method_name_claimed_twice_is_refused():
    @dataclasses.dataclass(frozen=True)
    class One(Method):
        name = "one"
        shorthand = {"same": {}}

    @dataclasses.dataclass(frozen=True)
    class Two(Method):
        name = "two"
        shorthand = {"same": {}}

    with pytest.raises(ImportError, match="method name 'same' is claimed twice"):
        methods._shorthand([One, Two])
