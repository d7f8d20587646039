#!/usr/bin/env bash
# CI build of the documentation site: `make docs` (Sphinx with autodoc, napoleon and autosummary;
# the guides through myst-parser, the quickstart notebook through myst-nb without running it)
# into build/docs/. Any warning fails it: a broken cross-reference or link, a docstring that
# napoleon or docutils cannot parse, an object described twice.
#
#   ci/docs.sh [VENV]      # VENV: a virtual environment (default .venv); one that does not
#                          # exist yet is made
#
# Installs the docs extra into VENV, and jaxcomp itself (building its CPU module: autodoc imports
# the package) where VENV has none; an editable install of the checkout is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
# CI gives it a venv of its own, so that it runs beside the tests rather than after them.
if [ ! -d "${1:-.venv}" ]; then
  python3 -m venv "${1:-.venv}"
fi
VENV="$(cd "${1:-.venv}" && pwd)"
PY="$VENV/bin/python"

if ! "$PY" -c 'import jaxcomp' 2>/dev/null; then
  "$PY" -m pip install --quiet ".[docs]"
else
  # The docs extra alone: its requirements, read from pyproject.toml's `docs = [...]`.
  mapfile -t DOCS_REQUIREMENTS < <(sed -n '/^docs = \[/,/^\]/p' pyproject.toml | grep -o '"[^"]*"' | tr -d '"')
  "$PY" -m pip install --quiet "${DOCS_REQUIREMENTS[@]}"
fi
"$PY" -c 'import jaxcomp; print("documenting jaxcomp", jaxcomp.__version__, "from", jaxcomp.__path__[0])'

make docs DOCS_PY="$PY"
echo "docs built: build/docs/index.html"
