# Development shortcuts. The README's two commands need none of this.
#   make dev   - build _jaxcomp_cpu in place (src/jaxcomp/_jaxcomp_cpu*.so) with the Python in $(PY)
#   make check - dev build, then the test suite against the in-place module
#   make docs  - the documentation site (docs/conf.py) into build/docs/, any warning an error;
#                with the docs extra: pip install -e ".[docs]" (ci/docs.sh does it in CI)
PY ?= python3
BUILD ?= build/dev
# The docs' Python: the checkout's .venv when there is one.
DOCS_PY ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,$(PY))
DOCS_OUT ?= build/docs

dev:
	cmake -S . -B $(BUILD) -G Ninja -DPython_EXECUTABLE=$$($(PY) -c 'import sys; print(sys.executable)') >/dev/null
	cmake --build $(BUILD)

check: dev
	PYTHONPATH=$(CURDIR)/src $(PY) -m pytest -q tests

# -E reads every page again: a warning is reported only when its page is read. The stubs of
# autosummary are made anew, so that a name removed from the API leaves no page behind.
docs:
	rm -rf docs/api/_autosummary
	$(DOCS_PY) -m sphinx -E -W --keep-going -b html docs $(DOCS_OUT)

.PHONY: dev check docs
