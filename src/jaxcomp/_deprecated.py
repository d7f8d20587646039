"""The module paths of jaxcomp 0.1 (a flat package), kept working for one release.

``import jaxcomp.transform`` or ``from jaxcomp.cost import Network`` imports the module at its new
home (``jaxcomp.optim.transform``, ``jaxcomp.costmodel.cost``) under the old name too, with a
``DeprecationWarning`` naming the new path; ``python -m jaxcomp.launch`` keeps working the same way.
The table below is the whole mapping; remove it (and this file) in jaxcomp 0.3.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
import warnings

#: Old module path -> new module path (the package's layers: docs/architecture.md).
MOVED = {
    "jaxcomp._ffi": "jaxcomp.ops._ffi",
    "jaxcomp._checks": "jaxcomp.ops._checks",
    "jaxcomp.selection": "jaxcomp.ops.topk",
    "jaxcomp.zfp": "jaxcomp.ops.zfp",
    "jaxcomp.hadamard": "jaxcomp.ops.hadamard",
    "jaxcomp.sign": "jaxcomp.ops.sign",
    "jaxcomp.flat": "jaxcomp.ops.flat",
    "jaxcomp.reference": "jaxcomp.ops.reference",
    "jaxcomp.xla": "jaxcomp.ops.xla",
    "jaxcomp.layout": "jaxcomp.collectives.sizes",
    "jaxcomp.thc": "jaxcomp.collectives.quantized",
    "jaxcomp.cost": "jaxcomp.costmodel.cost",
    "jaxcomp.probe": "jaxcomp.costmodel.probe",
    "jaxcomp.adaptive": "jaxcomp.costmodel.ratio_choice",
    "jaxcomp.advise": "jaxcomp.cli.advise",
    "jaxcomp.transform": "jaxcomp.optim.transform",
    "jaxcomp.auto": "jaxcomp.optim.auto",
    "jaxcomp.nonfinite": "jaxcomp.optim.nonfinite",
    "jaxcomp.accumulation": "jaxcomp.optim.accumulation",
    "jaxcomp.sharding": "jaxcomp.optim.sharding",
    "jaxcomp.train": "jaxcomp.training.trainer",
    "jaxcomp.zoo": "jaxcomp.training.zoo",
    "jaxcomp.launch": "jaxcomp.distributed.launch",
    "jaxcomp.rendezvous": "jaxcomp.distributed.rendezvous",
    "jaxcomp.cluster": "jaxcomp.distributed.cluster",
    "jaxcomp.netbench": "jaxcomp.distributed.netbench",
    "jaxcomp.demo": "jaxcomp.cli.demo",
    "jaxcomp.kernel_demo": "jaxcomp.cli.kernels",
}

#: Old paths whose ``python -m`` ran a command line that now lives apart from the library module.
RUN_AS_MAIN = {
    "jaxcomp.netbench": "jaxcomp.cli.netbench",
    "jaxcomp.cluster": "jaxcomp.cli.cluster",
}


def new_name(old: str) -> str | None:
    """The new path of an old module path (or of a module below one), else None.

    Args:
      old: a dotted module path.

    Returns:
      the path it moved to, or None when it did not move.

    Example:
      >>> new_name("jaxcomp.reference.topk")
      'jaxcomp.ops.reference.topk'
      >>> new_name("jaxcomp.methods") is None
      True
    """
    for before, after in MOVED.items():
        if old == before or old.startswith(before + "."):
            return after + old[len(before) :]
    return None


_OWN_FILES = (__file__, __file__.replace("_deprecated.py", "__init__.py"))


def _importer_stacklevel() -> int:
    """The stack level of the first frame outside the import machinery and this file.

    :func:`warnings.warn` does not count the import system's frames (``importlib._bootstrap``),
    so neither does this.
    """
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back
            continue
        if name not in _OWN_FILES and "importlib" not in name:
            return level
        frame, level = frame.f_back, level + 1
    return 1


def warn(old: str, new: str, stacklevel: int | None = None) -> None:
    """Warns that ``old`` is deprecated in favour of ``new``.

    Args:
      old: the old module path.
      new: the new one.
      stacklevel: passed to :func:`warnings.warn`; by default the code that imported ``old``.

    Returns:
      None.

    Example:
      >>> import warnings
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     warn("jaxcomp.cost", "jaxcomp.costmodel.cost")
      >>> str(caught[0].message).split(";")[0]
      'jaxcomp.cost is deprecated and will be removed in jaxcomp 0.3'
    """
    warnings.warn(
        f"{old} is deprecated and will be removed in jaxcomp 0.3; import {new} instead",
        DeprecationWarning,
        stacklevel=_importer_stacklevel() if stacklevel is None else stacklevel,
    )


class _Alias:  # a loader (duck-typed: importlib.abc would import importlib.resources, slowly)
    """Loads an old path as the module at its new path (the same object, not a copy)."""

    def __init__(self, new: str):
        self.new = new
        self._spec = None

    def create_module(self, spec):
        warn(spec.name, self.new)
        module = importlib.import_module(self.new)
        if hasattr(module, "__path__"):  # a package: see _PackageAlias
            return _PackageAlias(spec.name, module)
        self._spec = module.__spec__
        return module

    def exec_module(self, module):
        if not isinstance(module, _PackageAlias):
            module.__spec__ = self._spec  # the import system set the alias's; restore the real one

    def get_code(self, fullname):  # `python -m jaxcomp.launch` runs the new module's code
        new = RUN_AS_MAIN.get(fullname, self.new)
        warn(fullname, new)
        import importlib.util

        return importlib.util.find_spec(new).loader.get_code(new)

    def is_package(self, fullname):
        return False


class _PackageAlias(types.ModuleType):
    """An old package path (``jaxcomp.reference``): its names are the new package's.

    Not the package itself: importing ``jaxcomp.reference.topk`` sets the attribute ``topk`` of its
    parent to the submodule, which on the real package would hide the function ``topk`` that it
    re-exports. Here that attribute is dropped, so both paths keep the function.
    """

    def __init__(self, name: str, package):
        super().__init__(name, package.__doc__)
        object.__setattr__(self, "_package", package)
        object.__setattr__(self, "__path__", [])  # submodules come from the finder, by name

    def __getattr__(self, name):
        return getattr(self._package, name)

    def __setattr__(self, name, value):
        if not hasattr(self._package, name):
            object.__setattr__(self, name, value)


class _Finder:  # a meta path finder
    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname) if fullname.startswith("jaxcomp.") else None
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Puts the old paths' finder first on ``sys.meta_path`` (once).

    Returns:
      None.

    Example:
      >>> install()
      >>> sum(isinstance(f, _Finder) for f in sys.meta_path)
      1
    """
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
