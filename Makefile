PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test demo bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

# torch first, pinned: an unpinned torch would pull CUDA wheels we do not want.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/tokenslice serve --model builtin:tiny --host 127.0.0.1 --port 8000

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV)
