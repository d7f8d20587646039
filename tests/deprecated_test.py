"""The module paths of the flat package (jaxcomp 0.1) keep working for one release, with a warning.

Each old path is the new module itself (not a copy): monkeypatching either patches both, and
``isinstance`` checks agree.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest
from helpers import subprocess_env

import jaxcomp
from jaxcomp import _deprecated


def _forget(old):
    """Drops an old path from the import system and the parent's attributes, so it imports anew."""
    for name in [n for n in sys.modules if n == old or n.startswith(old + ".")]:
        del sys.modules[name]
    parent, _, child = old.rpartition(".")
    module = sys.modules.get(parent)
    if module is not None and child in vars(module):
        delattr(module, child)


@pytest.mark.parametrize("old", sorted(_deprecated.MOVED))
def test_every_old_path_imports_the_new_module_with_a_warning(old):
    new = _deprecated.MOVED[old]
    _forget(old)
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated.*import {new} instead"):
        module = importlib.import_module(old)
    real = importlib.import_module(new)
    if hasattr(real, "__path__"):  # a package: a view of it (see _deprecated._PackageAlias)
        public = [name for name in vars(real) if not name.startswith("_")]
        assert public and all(getattr(module, name) is getattr(real, name) for name in public)
    else:
        assert module is real
        assert module.__name__ == new and module.__spec__.name == new  # the real module, untouched


def test_an_old_submodule_path_leaves_the_new_package_alone():
    """Importing ``jaxcomp.reference.topk`` once made ``jaxcomp.ops.reference.topk`` (the function)
    the submodule: the import system sets a package's attribute to each submodule it imports."""
    _forget("jaxcomp.reference")
    with pytest.warns(DeprecationWarning):
        import jaxcomp.reference.topk  # noqa: F401
    from jaxcomp.ops import reference

    assert callable(reference.topk) and reference.topk.__name__ == "topk"
    assert reference.topk(jnp.array([1.0, -2.0, 2.0, 0.5]), 2)[1].tolist() == [1, 2]


def test_from_import_and_attribute_access_of_an_old_path():
    _forget("jaxcomp.cost")
    with pytest.warns(DeprecationWarning, match="jaxcomp.cost is deprecated") as caught:
        from jaxcomp.cost import Network  # noqa: F401
    assert caught[0].filename == __file__  # the warning points at the importing line
    from jaxcomp.costmodel.cost import Network as new

    assert Network is new
    _forget("jaxcomp.probe")
    with pytest.warns(DeprecationWarning, match="jaxcomp.probe is deprecated"):
        probe = jaxcomp.probe
    assert probe is importlib.import_module("jaxcomp.costmodel.probe")


def test_a_module_below_an_old_package_path():
    _forget("jaxcomp.reference")
    with pytest.warns(DeprecationWarning, match="jaxcomp.reference"):
        import jaxcomp.reference.topk  # noqa: F401
    assert sys.modules["jaxcomp.reference.topk"] is importlib.import_module(
        "jaxcomp.ops.reference.topk"
    )
    from jaxcomp.reference import topk  # the function, as before

    assert topk is importlib.import_module("jaxcomp.ops.reference").topk


def test_new_paths_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for new in _deprecated.MOVED.values():
            importlib.import_module(new)
        assert jaxcomp.compress is importlib.import_module("jaxcomp.optim").compress


def test_new_name_maps_only_moved_paths():
    assert _deprecated.new_name("jaxcomp.xla.zfp") == "jaxcomp.ops.xla.zfp"
    assert _deprecated.new_name("jaxcomp.methods") is None
    assert _deprecated.new_name("jaxcomp.costs") is None  # a prefix of a name is not a path


def test_unknown_attribute_still_raises():
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        _ = jaxcomp.nope


@pytest.mark.parametrize(
    "old, usage",
    [
        ("jaxcomp.launch", "usage: python -m jaxcomp.distributed.launch"),
        ("jaxcomp.netbench", "usage: jaxcomp netbench"),  # its command line: jaxcomp.cli.netbench
        ("jaxcomp.cluster", "usage: jaxcomp cluster"),
    ],
)
def test_python_dash_m_with_an_old_path_runs_the_new_module(old, usage):
    result = subprocess.run(
        [sys.executable, "-W", "always", "-m", old, "--help"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert usage in result.stdout
    assert f"{old} is deprecated" in result.stderr


def test_importing_jaxcomp_loads_no_jax():
    code = "import sys, jaxcomp; print('jax' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env()
    )
    assert result.stdout.strip() == "False", result.stderr


def test_the_version_is_the_changelogs_latest_release_and_removal_is_the_next_minor():
    """The package's version, pyproject's and CHANGELOG.md's latest release agree; the old paths
    are removed in the next minor release, as their warning says."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml")) as f:
        declared = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)
    with open(os.path.join(root, "CHANGELOG.md")) as f:
        released = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", f.read(), re.M)
    assert jaxcomp.__version__ == declared == released[0], (jaxcomp.__version__, declared, released)
    major, minor, _ = map(int, declared.split("."))
    with pytest.warns(DeprecationWarning, match=rf"removed in jaxcomp {major}\.{minor + 1}\b"):
        _forget("jaxcomp.cost")
        importlib.import_module("jaxcomp.cost")


@pytest.mark.parametrize("entry", ["compress", "compress_auto"])
def test_deprecated_keywords_warn_and_keep_working(entry):
    """compress(mean=, seed=) and compress_auto's: a DeprecationWarning naming what to do
    instead, where the caller passed it, and the value still takes effect until 0.3."""
    make = jaxcomp.compress if entry == "compress" else jaxcomp.compress_auto
    method = jaxcomp.Dense() if entry == "compress" else [jaxcomp.Dense()]
    with pytest.warns(DeprecationWarning, match=rf"{entry}\(seed=\) is deprecated") as caught:
        state = make(method, seed=7).init(jnp.zeros(3))
    assert caught[0].filename == __file__
    assert state.key.tolist() == jax.random.PRNGKey(7).tolist()
    with pytest.warns(DeprecationWarning, match=r"\(mean=\) is deprecated.*optax.scale"):
        state = make(method, mean=False).init(jnp.zeros(3))
    assert state.branches.mean is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # left out: no warning, the defaults
        state = make(method).init(jnp.zeros(3))
    assert state.branches.mean is True and state.key.tolist() == [0, 0]
