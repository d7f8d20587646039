"""Lazy attributes for a package (PEP 562): submodules and re-exported names load on first use.

``import jaxcomp`` must stay cheap (no JAX, no native module) so that the command line's
``--help`` and ``import jaxcomp.costmodel.cost`` are fast; every package of jaxcomp declares what
it offers through :func:`attach` instead of importing it.
"""

from __future__ import annotations

import importlib
import sys


def attach(package: str, submodules=(), exports=None):
    """``(__getattr__, __dir__, __all__)`` for ``package``.

    Args:
      package: the package's ``__name__``.
      submodules: names of its submodules, imported when first touched.
      exports: public name -> the module (absolute dotted path) that defines it.

    Returns:
      the three module attributes to assign in the package's ``__init__``.

    Example:
      >>> from jaxcomp._lazy import attach
      >>> getattr_, dir_, all_ = attach("jaxcomp", submodules=("methods",))
      >>> all_
      ['methods']
    """
    submodules = tuple(submodules)
    exports = dict(exports or {})

    def __getattr__(name):
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
        elif name in submodules:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)  # later lookups skip __getattr__
        return value

    names = sorted(exports) + list(submodules)

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__, names
