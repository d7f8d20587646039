"""Sphinx configuration of jaxcomp's documentation site (`make docs`, ci/docs.sh).

The guides (docs/*.md, docs/notes/*.md) go through myst-parser, the quickstart notebook through
myst-nb without being executed, and the API reference (docs/api/) through autodoc, napoleon
(Google-style docstrings) and autosummary, which writes one page per public name into
docs/api/_autosummary/ (not in git).
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import sys
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.errors import PycodeError
from sphinx.pycode import ModuleAnalyzer

# autodoc imports the installed jaxcomp (`pip install -e ".[docs]"`: the checkout itself), native
# module included: the ops' modules load it.
import jaxcomp

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
# The notebook lives in notebooks/, outside the source directory: the build reads a copy (not in
# git), so that notebooks/ stays the one place it is edited.
NOTEBOOKS = {ROOT / "notebooks" / "quickstart.ipynb": DOCS / "_generated" / "quickstart.ipynb"}

project = "jaxcomp"
author = "the jaxcomp authors"
copyright = "the jaxcomp authors"
release = version = jaxcomp.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_nb",  # registers myst-parser for the .md guides, and reads .ipynb
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]
templates_path = ["_templates"]

# -- the guides (myst-parser)
# The guides link to each other's sections by GitHub's slugs (training.md#5-multi-host).
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]  # ::: fences, for directives that hold ```
# A heading may skip a level (## then ####), as GitHub renders it; the page is no less readable.
suppress_warnings = ["myst.header"]

# -- the notebook (myst-nb): rendered with the outputs it was saved with, never run
nb_execution_mode = "off"

# -- the API reference (autodoc, napoleon, autosummary)
autosummary_generate = True
autosummary_imported_members = False
# Constants whose value is too long to print in the page's heading (docs/_templates/autosummary/).
autosummary_context = {"long_values": ["jaxcomp.methods.SHORTHAND"]}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# References to names outside the documented API (jax, optax, private helpers) stay plain text.
nitpicky = False

# -- output
html_theme = "sphinx_book_theme"
html_title = f"jaxcomp {release}"
html_theme_options = {"show_toc_level": 2}


def _copy_notebooks() -> None:
    for source, copy in NOTEBOOKS.items():
        copy.parent.mkdir(exist_ok=True)
        if not copy.exists() or copy.read_bytes() != source.read_bytes():
            shutil.copyfile(source, copy)


def _site_docname(path: Path) -> str | None:
    """The docname of a file outside docs/ that the site holds a copy of (the notebook)."""
    for source, copy in NOTEBOOKS.items():
        if path in (source, source.with_suffix("")):
            return copy.relative_to(DOCS).with_suffix("").as_posix()
    return None


def _on_disk(docdir: Path, target: str) -> Path:
    """Where a guide's relative path points: from the guide's folder, or, where nothing is
    there, from the repository's root (a note moved into docs/notes/ from the root, as
    BENCHMARKS.md's older tables were, keeps root-relative paths)."""
    path = (docdir / target).resolve()
    if not path.exists() and (ROOT / target).exists():
        return (ROOT / target).resolve()
    return path


def _repo_links(app, doctree) -> None:
    """Links from a guide to files outside docs/ (``../tests/fault_test.py``, ``../BENCHMARKS.md``,
    ``../src/jaxcomp/methods/``): the notebook's goes to its page; myst-parser already turns a link
    to a file into a download; the rest (a directory, a Markdown file that is not a page of the
    site) keep their text without a link, as they would have no target on a hosted site. Links
    and images written relative to the repository's root find their files from there."""
    srcdir = Path(app.srcdir).resolve()
    docdir = (srcdir / app.env.docname).parent
    for image in doctree.findall(nodes.image):
        if "://" not in image["uri"] and not image["uri"].startswith(("/", "data:")):
            image["uri"] = os.path.relpath(_on_disk(docdir, image["uri"]), docdir)
    for node in list(doctree.findall(addnodes.pending_xref)):
        if node.get("reftype") != "myst":
            continue
        target, _, anchor = node["reftarget"].partition("#")
        if node.get("refdomain") == "doc":
            # A page of the site, or the absolute path of a Markdown file outside docs/.
            path = Path(target)
            if not path.is_absolute():
                continue
        elif "://" in target or not target or target.startswith("mailto:"):
            continue
        else:
            path = _on_disk(docdir, target)
        if path.is_relative_to(srcdir) and path.suffix in (".md", ".rst", ".ipynb"):
            docname = path.relative_to(srcdir).with_suffix("").as_posix()
        elif path.is_relative_to(srcdir):
            continue  # left to myst-parser, which warns if it is missing
        else:
            docname = _site_docname(path)
        if docname is None:
            node.replace_self(nodes.inline("", "", *node.children))
        else:
            node["refdomain"], node["reftarget"] = "doc", docname
            node["reftargetid"] = anchor or node.get("reftargetid")


_FIELD_ALIAS = re.compile(r"Alias for field number \d+")


def _attribute_comment(name: str, value) -> list[str]:
    """The ``#:`` comment above ``name``'s assignment in the jaxcomp module that defines it."""
    home, _, attr = name.rpartition(".")
    # The module the name is documented in first, then the others that hold the same value.
    holders = sorted(
        (
            module_name
            for module_name, module in list(sys.modules.items())
            if module_name.split(".")[0] == "jaxcomp" and vars(module).get(attr) is value
        ),
        key=lambda module_name: (module_name != home, module_name),
    )
    for module_name in holders:
        try:
            comments = ModuleAnalyzer.for_module(module_name).find_attr_docs()
        except PycodeError:
            continue
        if ("", attr) in comments:
            return list(comments["", attr])
    return []


def _docstrings(app, what, name, obj, options, lines) -> None:
    """A constant's page shows its ``#:`` comment, as written, from the module that defines it:
    autodoc looks for the comment in the module it documents the name in (``jaxcomp`` for
    ``jaxcomp.DEFAULT_ROUNDS``) and, finding none, shows the docstring of the value's type
    (``int``'s); and napoleon reads a comment's first colon as "type: description". NamedTuple
    fields have no docstring of their own: drop "Alias for field number N"."""
    if what == "data":
        lines[:] = _attribute_comment(name, obj)
    if len(lines) == 1 and _FIELD_ALIAS.fullmatch(lines[0].strip()):
        lines.clear()


def _lookup(dotted: str):
    """The object at ``dotted`` (``jaxcomp.methods.base.Method``), or None."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except (ImportError, ValueError):
            continue
        for part in parts[cut:]:
            value = getattr(value, part, None)
        return value
    return None


def _public_reference(app, env, node, contnode):
    """A reference to a public object by another of its paths (``:class:`Dense``` inside
    ``jaxcomp.methods``, ``jaxcomp.methods.base.Method``) links to its page, ``jaxcomp.Dense``:
    each object is documented once, under the name users write."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip(".")  # `.auto` inside jaxcomp.optim's docstring
    name = target.rpartition(".")[2]
    if name not in jaxcomp.__all__ or target == f"jaxcomp.{name}":
        return None
    module = node.get("py:module")
    # Only jaxcomp's own paths are imported to compare.
    candidates = [path for path in (target, f"{module}.{target}") if path.startswith("jaxcomp.")]
    if all(_lookup(path) is not getattr(jaxcomp, name) for path in candidates):
        return None
    python = env.get_domain("py")
    return python.resolve_xref(
        env, node["refdoc"], app.builder, node["reftype"], f"jaxcomp.{name}", node, contnode
    )


def setup(app):
    _copy_notebooks()
    # Before Sphinx's image collector (priority 500), which reads the images' paths.
    app.connect("doctree-read", _repo_links, priority=400)
    app.connect("missing-reference", _public_reference)
    # After napoleon's listener (priority 500), to undo what it did to a constant's comment.
    app.connect("autodoc-process-docstring", _docstrings, priority=600)
