# Set-up and the two jobs of the README. Everything lands in .venv (ignored by git).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test
setup: $(VENV)/.installed

# torch==2.13.0 first: on a machine without a GPU it is the small CPU build; the package itself
# only asks for torch>=2.4, so a GPU machine keeps its own.
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

demo: setup
	$(BIN)/qla-compile specs/gdn.py --target sm90
	$(BIN)/qla-compile specs/gdn.py --target sm90 --emit chunk
	$(BIN)/qla-compile specs/gdn.py --target sm90 --emit kernel
	$(BIN)/qla-compile specs/gdn.py --target sm90 --emit tilelang -o qla-out

test: setup
	$(BIN)/python -m pytest -q
