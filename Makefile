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

# The summary and the chunk program on the screen; the kernels and the TileLang module (hundreds
# of lines) into $(OUT), with the commands that print them.
OUT ?= qla-out
demo: setup
	@$(BIN)/qla-compile specs/gdn.py --target sm90
	@echo
	@$(BIN)/qla-compile specs/gdn.py --target sm90 --emit chunk
	@echo
	@echo "The kernels and the generated TileLang module:"
	@$(BIN)/qla-compile specs/gdn.py --target sm90 --emit kernel -o $(OUT) >/dev/null
	@$(BIN)/qla-compile specs/gdn.py --target sm90 --emit tilelang -o $(OUT) >/dev/null
	@echo "Print them with  cat $(OUT)/gdn.kernel.txt  and  cat $(OUT)/gdn.tilelang.py,"
	@echo "or  $(BIN)/qla-compile specs/gdn.py --emit kernel   (or --emit tilelang, --emit cuda)."
	@echo "Every pass's changes:  $(BIN)/qla-compile specs/gdn.py --print-after-all"

# one thread per process: on CI's two cores torch's default threads thrash
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q
