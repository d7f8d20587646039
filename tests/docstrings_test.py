"""Every public function documents itself with an example and a paper, and the examples run."""

import doctest
import importlib
import inspect
import pkgutil

import pytest

import jaxcomp

# Modules users call; command-line front ends document themselves through --help.
PUBLIC_MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(jaxcomp.__path__, "jaxcomp.")
    if not any(part.startswith("_") for part in name.split("."))
    and not name.startswith("jaxcomp.cli")
    and not name.endswith("launch")
)


def public_functions(module):
    for name, obj in vars(module).items():
        if name.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != module.__name__:
            continue
        if name == "main":  # CLI entry points: their documentation is --help
            continue
        yield name, obj


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_functions_have_example_and_reference(module_name):
    module = importlib.import_module(module_name)
    missing = []
    for name, fn in public_functions(module):
        doc = inspect.getdoc(fn) or ""
        for section in ("Args:", "Returns:", "Example", "References:"):
            if section not in doc and not (
                section == "Args:" and not inspect.signature(fn).parameters
            ):
                missing.append(f"{name}: {section}")
    assert not missing, f"{module_name} docstrings lack sections: {missing}"


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_docstring_examples_run(module_name):
    module = importlib.import_module(module_name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False
    )
    assert result.failed == 0, f"{result.failed} doctest example(s) failed in {module_name}"
