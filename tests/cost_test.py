"""jaxcomp.costmodel.cost: the α-β model against hand-computed costs, choose as the argmin, paper
000 Eqn (5a)-(5c)."""

import itertools
import math

import numpy as np
import pytest

from jaxcomp.costmodel import cost
from jaxcomp.costmodel.cost import Network

# 2**20 float32 values and a density of 2**-7 keep every count exact: k = 8192, M c = 2**15 bytes.
N_VALUES = 2**20
NBYTES = 4 * N_VALUES
RATIO = 2.0**-7
K = 8192
NET = Network(alpha=1e-3, bandwidth=1e9)

# Each row: method, options, N, expected seconds, worked out by hand from paper 000 Table I /
# Eqn (4a)/(4b) with jaxcomp's index all-reduce, and the byte counts of the methods' wire_bytes.
HAND = [
    # 2(N-1) α + 2 (N-1)/N M β = 14 ms + 2 * 7/8 * 4 MiB / 1 GB/s
    ("dense_ring", {}, 8, 14e-3 + 2 * 7 / 8 * NBYTES / 1e9),
    # 2 log N α + 2 log N M β
    ("dense_tree", {}, 8, 6e-3 + 6 * NBYTES / 1e9),
    # log N α + (N-1) k (4 + 4) β
    ("allgather_topk", {"ratio": RATIO}, 8, 3e-3 + 7 * K * 8 / 1e9),
    # two ring all-reduces of k int32 / k float32: 4(N-1) α + 2 * 2 (N-1)/N 4k β
    ("ar_topk_star", {"ratio": RATIO}, 8, 28e-3 + 2 * (2 * 7 / 8 * 4 * K) / 1e9),
    # two tree all-reduces: 4 log N α + 2 * 2 log N 4k β
    ("ar_topk_star_tree", {"ratio": RATIO}, 8, 12e-3 + 2 * (6 * 4 * K) / 1e9),
    # SPLIT (the default leader): an all-gather of k/N int32 indices, log N steps and (N-1) k/N 4
    # bytes, then one all-reduce of N k/N values: 3 + 14 steps on a ring, 3 + 6 as a tree
    ("ar_topk", {"ratio": RATIO}, 8, 17e-3 + (7 * (K // 8) * 4 + 2 * 7 / 8 * 4 * K) / 1e9),
    ("ar_topk_tree", {"ratio": RATIO}, 8, 9e-3 + (7 * (K // 8) * 4 + 6 * 4 * K) / 1e9),
    # G = 4 per node, 2 nodes: steps (G-1) + log 2 + log 4 = 6; bytes (G-1) n/G 4 +
    # (O-1) k/G 8 + (G-1) O k/G 8
    (
        "hierarchical_topk",
        {"ratio": RATIO, "inner_size": 4},
        8,
        6e-3 + (3 * (N_VALUES // 4) * 4 + 1 * (K // 4) * 8 + 3 * 2 * (K // 4) * 8) / 1e9,
    ),
    # rate 8 = one 32-bit word per 4-value block; chunks of n/N values; 2 (N-1) chunks sent
    ("zfp_ring", {"rate": 8}, 8, 14e-3 + 2 * 7 * (N_VALUES // 8) / 1e9),
    # log N rounds, each sends the whole compressed vector (n bytes at rate 8)
    ("zfp_recursive_doubling", {"rate": 8}, 8, 3e-3 + 3 * N_VALUES / 1e9),
    # N = 6: p = 4, 2 rounds + fold-in + fold-out = 4 steps; the busiest device sends 3 vectors
    ("zfp_recursive_doubling", {"rate": 8}, 6, 4e-3 + 3 * N_VALUES / 1e9),
    # 4-bit codes summed over 8 devices fit int8; two ring all-reduces (range, then codes)
    ("quantized", {"bits": 4}, 8, 28e-3 + (2 * 7 / 8 * N_VALUES + 2 * 7 / 8 * 4) / 1e9),
    # non-power-of-two N: the tree pays ceil(log2 6) = 3 rounds
    ("dense_tree", {}, 6, 6e-3 + 6 * NBYTES / 1e9),
    ("dense_ring", {}, 2, 2e-3 + NBYTES / 1e9),
]


@pytest.mark.parametrize(
    "method,options,n_workers,expected", HAND, ids=[f"{r[0]}-N{r[2]}" for r in HAND]
)
def test_predict_matches_hand_computed_cost(method, options, n_workers, expected):
    got = cost.predict(method, NBYTES, n_workers, NET, **options)
    assert got == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "method",
    cost.available_methods(ratio=RATIO, rate=8, bits=4, inner_size=1),
    ids=lambda m: m.label,
)
def test_single_worker_costs_nothing(method):
    assert cost.predict(method, NBYTES, 1, NET, inner_size=1) == 0.0


def test_table_i_dense_costs():
    """Table I of paper 000, written out: 100M parameters, 8 workers, 10 ms and 10 Gbit/s."""
    net = Network.parse("10ms", "10gbit")
    m, n = 4e8, 8
    ring = 2 * (n - 1) * net.alpha + 2 * (n - 1) / n * m * net.beta
    tree = 2 * math.log2(n) * net.alpha + 2 * math.log2(n) * m * net.beta
    assert cost.predict("dense_ring", m, n, net) == pytest.approx(ring, rel=1e-12)
    assert cost.predict("dense_tree", m, n, net) == pytest.approx(tree, rel=1e-12)


@pytest.mark.parametrize(
    "method,options",
    [("dense_ring", {}), ("allgather_topk", {"ratio": 0.01}), ("zfp_ring", {"rate": 8})],
)
def test_gradients_beyond_the_int32_row_limit_are_costed_in_pieces(method, options):
    from jaxcomp import methods

    limit = 2**31 - 1
    n = 2 * limit + 1000  # a 4.3B-parameter model
    m = methods.parse(method, **options)
    expected = 2 * m.wire_bytes(limit, 8) + m.wire_bytes(1000, 8)
    assert cost.volume_bytes(method, 4 * n, 8, **options) == pytest.approx(expected)


def test_overhead_adds_as_is():
    base = cost.predict("allgather_topk", NBYTES, 8, NET, ratio=RATIO)
    assert cost.predict(
        "allgather_topk", NBYTES, 8, NET, ratio=RATIO, overhead=0.25
    ) == pytest.approx(base + 0.25)


def _random_setups(count, seed):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        yield dict(
            nbytes=float(4 * int(10 ** rng.uniform(3, 9))),
            n_workers=int(rng.choice([2, 3, 4, 8, 12, 16, 64])),
            network=Network(
                alpha=float(10 ** rng.uniform(-6, -1)), bandwidth=float(10 ** rng.uniform(7, 11))
            ),
            ratio=float(10 ** rng.uniform(-3, -1)),
        )


def test_choose_is_the_argmin():
    for setup in _random_setups(60, seed=0):
        names = cost.available_methods(ratio=setup["ratio"], rate=8, bits=4)
        times = [
            cost.predict(m, setup["nbytes"], setup["n_workers"], setup["network"]) for m in names
        ]
        chosen = cost.choose(
            setup["nbytes"], setup["n_workers"], setup["network"], setup["ratio"], rate=8, bits=4
        )
        assert chosen == names[int(np.argmin(times))]


def test_choose_adds_overhead_per_method():
    net = Network.parse("10us", "1gbit")
    fast = cost.choose(NBYTES, 8, net, RATIO, candidates=["dense_ring", "allgather_topk"])
    assert fast == "allgather_topk"
    slowed = cost.choose(
        NBYTES,
        8,
        net,
        RATIO,
        candidates=["dense_ring", "allgather_topk"],
        overhead={"allgather_topk": 1.0},
    )
    assert slowed == "dense_ring"


def test_choose_picks_dense_on_a_fast_network_and_compression_on_a_slow_one():
    """Communication alone always favours sending less; what keeps dense ahead on a fast link is
    the encode/decode time (paper 002 §3), here 2 ms for every compressed method."""
    candidates = ["dense_ring", "dense_tree", "allgather_topk", "ar_topk_star", "ar_topk_star_tree"]
    codec = {m: 2e-3 for m in candidates[2:]}
    fast = Network.parse("1us", "900GB/s")
    slow = Network.parse("1ms", "1gbit")
    assert cost.choose(4e6, 8, fast, 0.01, candidates, overhead=codec) == "dense_ring"
    assert cost.choose(4e8, 8, slow, 0.01, candidates, overhead=codec) in candidates[2:]


def _switch_threshold(slow_steps, slow_volume, fast_steps, fast_volume):
    """α/β below which the method with more steps (``slow_steps``) wins: from
    ``a_s α + b_s V β < a_f α + b_f V β``, i.e. ``α/β < (b_f - b_s)/(a_s - a_f) V``."""
    return (fast_volume - slow_volume) / (slow_steps - fast_steps)


@pytest.mark.parametrize("n_workers", [4, 8, 16, 64])
def test_switching_rule_helper_reproduces_eqn_5_of_the_paper(n_workers):
    """The helper, fed paper 000's own coefficients (Eqn 4a/4b and AG, with V = M c), gives the
    printed closed forms of Eqn (5a)-(5c)."""
    n, log_n = n_workers, math.log2(n_workers)
    ring = (2 * (n - 1) + log_n, 2 * (n - 1) / n + log_n)
    tree = (3 * log_n, 3 * log_n)
    allgather = (log_n, 2 * (n - 1))
    eqn_5a = (log_n - (n - 1) / n) / (n - 1 - log_n)
    eqn_5b = 1 - 1 / n - log_n / (2 * (n - 1))
    eqn_5c = (n - 1) / log_n - 3 / 2
    assert _switch_threshold(*ring, *tree) == pytest.approx(eqn_5a)
    assert _switch_threshold(*ring, *allgather) == pytest.approx(eqn_5b)
    assert _switch_threshold(*tree, *allgather) == pytest.approx(eqn_5c)


def _networks_around(threshold_alpha_over_beta):
    """Two networks just on either side of a switching point (never on it, so no ties)."""
    beta = 1e-9
    return (
        Network(alpha=0.8 * threshold_alpha_over_beta * beta, bandwidth=1 / beta),
        Network(alpha=1.25 * threshold_alpha_over_beta * beta, bandwidth=1 / beta),
    )


@pytest.mark.parametrize("n_workers", [4, 8, 16, 64])
def test_choose_agrees_with_eqn_5a(n_workers):
    """Ring vs tree AR-Topk: jaxcomp all-reduces the indices instead of broadcasting them, which
    scales both methods' α and β coefficients alike, so Eqn (5a) holds exactly as printed."""
    n, log_n = n_workers, math.log2(n_workers)
    volume = 4 * K  # M c: bytes of the kept float32 values
    threshold = (log_n - (n - 1) / n) / (n - 1 - log_n) * volume
    below, above = _networks_around(threshold)
    pair = ["ar_topk_star", "ar_topk_star_tree"]
    assert cost.choose(NBYTES, n, below, RATIO, pair) == "ar_topk_star"
    assert cost.choose(NBYTES, n, above, RATIO, pair) == "ar_topk_star_tree"


@pytest.mark.parametrize("n_workers", [16, 32, 64])
@pytest.mark.parametrize("ar_method", ["ar_topk_star", "ar_topk_star_tree"])
def test_choose_agrees_with_eqn_5b_5c(n_workers, ar_method):
    """AR-Topk vs all-gather (Eqn 5b for ring, 5c for tree). The rule has the paper's form,
    α/β < (b_AG - b_AR)/(a_AR - a_AG) M c; the coefficients are jaxcomp's: the indices cost an
    all-reduce, 2(N-1) or 2 log N steps, where the paper's broadcast costs log N."""
    n, log_n = n_workers, math.log2(n_workers)
    volume = 4 * K
    allgather = (log_n, 2 * (n - 1))
    if ar_method == "ar_topk_star":
        ar = (4 * (n - 1), 4 * (n - 1) / n)
        closed_form = 2 * (n - 1) * (1 - 2 / n) / (4 * (n - 1) - log_n)  # 5b for jaxcomp
    else:
        ar = (4 * log_n, 4 * log_n)
        closed_form = (2 * (n - 1) - 4 * log_n) / (3 * log_n)  # 5c for jaxcomp
    assert _switch_threshold(*ar, *allgather) == pytest.approx(closed_form)
    # The coefficients are the model's own: steps from message_steps, volumes from bytes_sent.
    for method, (steps, per_volume) in ((ar_method, ar), ("allgather_topk", allgather)):
        assert cost.message_steps(method, n) == steps
        assert cost.volume_bytes(method, NBYTES, n, ratio=RATIO) == pytest.approx(
            per_volume * volume
        )
    below, above = _networks_around(closed_form * volume)
    pair = [ar_method, "allgather_topk"]
    assert cost.choose(NBYTES, n, below, RATIO, pair) == ar_method
    assert cost.choose(NBYTES, n, above, RATIO, pair) == "allgather_topk"


def test_three_way_choice_follows_the_pairwise_rules():
    """Over a grid of networks, the argmin of the three top-k collectives is the method that wins
    both of its pairwise rules."""
    n = 16
    for alpha, bandwidth in itertools.product(np.logspace(-6, -2, 9), np.logspace(7, 11, 9)):
        net = Network(alpha=float(alpha), bandwidth=float(bandwidth))
        names = ["allgather_topk", "ar_topk_star", "ar_topk_star_tree"]
        chosen = cost.choose(NBYTES, n, net, RATIO, names)
        for other in names:
            if other != chosen:
                assert cost.choose(NBYTES, n, net, RATIO, [chosen, other]) == chosen


def test_available_methods():

    assert [m.label for m in cost.available_methods()] == [
        "dense",
        "dense_tree",
        "bf16",
        "sign",
        "sign_allreduce",
        "sign_ring",
    ]
    labels = [m.label for m in cost.available_methods(ratio=0.1, rate=8, bits=4, inner_size=2)]
    assert labels == [
        "dense",
        "dense_tree",
        "allgather_topk",
        "ar_topk",
        "ar_topk_tree",
        "hierarchical_topk",
        "randomk",
        "zfp",
        "zfp_recursive_doubling",
        "quantized",
        "bf16",
        "sign",
        "sign_allreduce",
        "sign_ring",
    ]


def test_names_and_objects_cost_the_same():
    """The string shorthand is only a shorthand: a name with options costs what its object does."""
    from jaxcomp import methods

    for name, options in [
        ("dense_tree", {}),
        ("ar_topk", {"ratio": RATIO}),
        ("zfp_recursive_doubling", {"rate": 8}),
        ("quantized", {"bits": 4}),
    ]:
        assert cost.predict(name, NBYTES, 8, NET, **options) == cost.predict(
            methods.parse(name, **options), NBYTES, 8, NET
        )


def test_sync_seconds_runs_on_numpy_and_inside_jit():
    """The one formula of the α-β model, shared by the host's choose and compress_auto's in-step
    choice."""
    import jax
    import jax.numpy as jnp

    steps, volume = np.array([14.0, 3.0]), np.array([7000.0, 560.0])
    host = cost.sync_seconds(steps, volume, 1e-3, 1e-9)
    traced = jax.jit(lambda s, v: cost.sync_seconds(s, v, jnp.float32(1e-3), jnp.float32(1e-9)))(
        steps, volume
    )
    np.testing.assert_allclose(np.asarray(traced), host, rtol=1e-6)
    assert cost.cheapest(host) == int(jnp.argmin(traced)) == 1


@pytest.mark.parametrize(
    "text,expected",
    [
        ("10gbit", 1.25e9),
        ("10Gbps", 1.25e9),
        ("25gb/s", 25e9 / 8),
        ("100mbit", 12.5e6),
        ("1GB/s", 1e9),
        ("1GiB/s", 2.0**30),
        ("2.5e9", 2.5e9),
        (1e6, 1e6),
        (" 1.5 Tbit ", 1.5e12 / 8),
    ],
)
def test_parse_bandwidth(text, expected):
    assert cost.parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("0.5ms", 5e-4),
        ("20us", 2e-5),
        ("1s", 1.0),
        ("3e-3", 3e-3),
        (0, 0.0),
        ("100ns", 1e-7),
        ("5µs", 5e-6),
    ],
)
def test_parse_duration(text, expected):
    assert cost.parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["fast", "10gbits", "10", "-1gbit", "0gbit", "10 GB"])
def test_parse_bandwidth_rejects(text):
    if text == "10":
        assert cost.parse_bandwidth(text) == 10.0  # a bare number is bytes per second
        return
    with pytest.raises(ValueError, match="bandwidth"):
        cost.parse_bandwidth(text)


@pytest.mark.parametrize("text", ["soon", "5 min", "-1ms"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="latency"):
        cost.parse_duration(text)


def test_parse_rejects_wrong_types():
    with pytest.raises(TypeError, match="bandwidth"):
        cost.parse_bandwidth([10])
    with pytest.raises(TypeError, match="latency"):
        cost.parse_duration(True)


def test_network_validates():
    with pytest.raises(ValueError, match="alpha"):
        Network(alpha=-1.0, bandwidth=1e9)
    with pytest.raises(ValueError, match="bandwidth"):
        Network(alpha=0.0, bandwidth=0.0)
    with pytest.raises(TypeError, match="alpha"):
        Network(alpha="1ms", bandwidth=1e9)
    assert Network.parse("0.5ms", "10gbit") == Network(alpha=5e-4, bandwidth=1.25e9)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: cost.predict("nope", NBYTES, 8, NET), "method"),
        (lambda: cost.predict("allgather_topk", NBYTES, 8, NET), "ratio"),
        (lambda: cost.predict("zfp_ring", NBYTES, 8, NET), "rate"),
        (lambda: cost.predict("quantized", NBYTES, 8, NET), "bits"),
        (lambda: cost.predict("hierarchical_topk", NBYTES, 8, NET, RATIO), "inner_size"),
        (
            lambda: cost.predict("hierarchical_topk", NBYTES, 8, NET, RATIO, inner_size=3),
            "inner_size",
        ),
        (lambda: cost.predict("dense_ring", 0, 8, NET), "nbytes"),
        (lambda: cost.predict("dense_ring", NBYTES, 0, NET), "n_workers"),
        (lambda: cost.predict("allgather_topk", NBYTES, 8, NET, ratio=2.0), "ratio"),
        (lambda: cost.predict("dense_ring", NBYTES, 8, NET, overhead=-1.0), "overhead"),
        (lambda: cost.choose(NBYTES, 8, NET, RATIO, candidates=[]), "candidates"),
        (lambda: cost.choose(NBYTES, 8, NET, RATIO, candidates="dense_ring"), "candidates"),
        (
            lambda: cost.choose(NBYTES, 8, NET, RATIO, ["dense_ring"], overhead={"zfp_ring": 1.0}),
            "overhead",
        ),
    ],
)
def test_bad_input_names_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_predict_rejects_a_non_network():
    with pytest.raises(TypeError, match="network"):
        cost.predict("dense_ring", NBYTES, 8, (1e-3, 1e9))
