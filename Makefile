# Development shortcuts. The README's two commands need none of this.
#   make dev   - build _jaxcomp_cpu in place (src/jaxcomp/_jaxcomp_cpu*.so) with the Python in $(PY)
#   make check - dev build, then the test suite against the in-place module
PY ?= python3
BUILD ?= build/dev

dev:
	cmake -S . -B $(BUILD) -G Ninja -DPython_EXECUTABLE=$$($(PY) -c 'import sys; print(sys.executable)') >/dev/null
	cmake --build $(BUILD)

check: dev
	PYTHONPATH=$(CURDIR)/src $(PY) -m pytest -q tests

.PHONY: dev check
