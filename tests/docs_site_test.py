"""The documentation site documents the public API: every name of ``jaxcomp.__all__`` (and of the
sub-packages with pages of their own) has an entry in docs/api/, and docs/conf.py runs autodoc and
napoleon. Reads the sources only; `make docs` builds the site."""

import ast
import pathlib
import re

import pytest

import jaxcomp
import jaxcomp.collectives
import jaxcomp.methods

ROOT = pathlib.Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api"

# Sub-packages whose public names the guides use, each with its page in docs/api/.
SUBPACKAGES = {"jaxcomp.methods": jaxcomp.methods, "jaxcomp.collectives": jaxcomp.collectives}

_DIRECTIVE = re.compile(r"^(\s*)\.\. ([\w:-]+)::\s*(\S*)")


def api_entries(text: str) -> tuple[set[str], set[str]]:
    """``(documented, linked)``: the full names that ``text`` (reStructuredText) gives a page or a
    description (an autosummary entry under ``:toctree:``, an ``auto*`` directive), and those an
    autosummary table without ``:toctree:`` only links to."""
    documented, linked = set(), set()
    module, block, indent, toctree = "", None, 0, False
    for line in text.splitlines():
        directive = _DIRECTIVE.match(line)
        if directive:
            _, name, argument = directive.groups()
            block = "autosummary" if name == "autosummary" else None
            indent, toctree = len(directive.group(1)), False
            if name in ("currentmodule", "module", "py:currentmodule"):
                module = argument
            elif name.startswith("auto") and name != "autosummary":
                documented.add(argument)
            continue
        if block is None or not line.strip():
            continue
        if len(line) - len(line.lstrip()) <= indent:  # the block ended
            block = None
        elif line.strip().startswith(":"):
            toctree = toctree or line.strip().startswith(":toctree:")
        else:
            entry = line.strip().lstrip("~")
            full = entry if entry.startswith("jaxcomp.") or not module else f"{module}.{entry}"
            (documented if toctree else linked).add(full)
    return documented, linked


def _sources() -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(API.glob("*.rst"))}


def _documented() -> set[str]:
    return set().union(*(api_entries(text)[0] for text in _sources().values()))


def test_the_parser_reads_autosummary_blocks():
    documented, linked = api_entries(
        ".. currentmodule:: jaxcomp\n\n"
        ".. autosummary::\n   :toctree: _autosummary\n\n   topk\n   zfp_encode\n\nText.\n\n"
        ".. autosummary::\n\n   ~jaxcomp.Dense\n\n"
        ".. automodule:: jaxcomp.methods\n"
    )
    assert documented == {"jaxcomp.topk", "jaxcomp.zfp_encode", "jaxcomp.methods"}
    assert linked == {"jaxcomp.Dense"}


def test_every_public_name_of_jaxcomp_has_a_page():
    documented = _documented()
    missing = sorted(name for name in jaxcomp.__all__ if f"jaxcomp.{name}" not in documented)
    assert not missing, f"public names of jaxcomp with no entry in docs/api/*.rst: {missing}"


def test_no_page_for_a_name_jaxcomp_does_not_have():
    top_level = {name for name in _documented() if name.count(".") == 1}
    stale = sorted(top_level - {f"jaxcomp.{name}" for name in jaxcomp.__all__})
    assert not stale, f"docs/api/*.rst documents names jaxcomp does not export: {stale}"


@pytest.mark.parametrize("package", sorted(SUBPACKAGES))
def test_every_public_name_of_a_documented_subpackage_has_a_page(package):
    """Each name has its own page, or is the same object as a top-level name with a page and is
    linked from the sub-package's page."""
    module = SUBPACKAGES[package]
    page = API / f"{package.rpartition('.')[2]}.rst"
    assert page.exists(), f"{package} has no page {page.relative_to(ROOT)}"
    own, linked = api_entries(page.read_text())
    assert package in own, f"{page.relative_to(ROOT)} has no `.. automodule:: {package}`"
    documented = _documented()
    missing = []
    for name in module.__all__:
        if f"{package}.{name}" in documented:
            continue
        alias = f"jaxcomp.{name}"
        same = name in jaxcomp.__all__ and getattr(jaxcomp, name) is getattr(module, name)
        if not (same and alias in documented and alias in linked):
            missing.append(name)
    assert not missing, f"public names of {package} with no entry in docs/api/: {missing}"


def test_conf_enables_autodoc_and_napoleon():
    conf = ROOT / "docs" / "conf.py"
    assert conf.exists()
    extensions = None
    for node in ast.parse(conf.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "extensions" for target in node.targets
        ):
            extensions = ast.literal_eval(node.value)
    assert extensions is not None, "docs/conf.py sets no `extensions`"
    for extension in ("sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.autosummary"):
        assert extension in extensions, f"docs/conf.py does not enable {extension}"
