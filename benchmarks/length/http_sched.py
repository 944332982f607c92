"""srpt-predicted with the self length head (refined while decoding) against fcfs, srpt-oracle and
srpt-predicted with the embedding predictor, on the real engine over HTTP with the real chat model
(issue 33, checks 2).

Fixed before running:
  * model smollm2-135m-instruct (quantization auto), `tokenslice serve --no-compile`, max batch 8,
    max model length 2048, one torch thread, fresh server per variant (run one after another);
  * workload: `--num-requests` prompts drawn with `--seed` from the TEST split of
    results/own_answers.jsonl (prompts no predictor was fitted on), sent as one user message to
    /v1/chat/completions, greedy (temperature 0), max_tokens 512, streamed; Gamma arrivals with
    CV 4 (bursty);
  * rate: 0.9 x fcfs's saturation throughput, measured first in the same run with the first 16
    workload prompts sent at t = 0 (16 / makespan);
  * srpt-oracle is told each request's recorded greedy length (tokenslice.expected_output_tokens);
    the predictors are copies of cache/predictor-embed and cache/predictor-self (self_eval.py:
    fitted on the train split only), updated online during the run as serving does.
Metric: mean normalized latency (end-to-end seconds / output tokens); the share of the fcfs ->
srpt-oracle gap a variant closes is (fcfs - variant) / (fcfs - oracle).

    nohup .venv/bin/python benchmarks/length/http_sched.py > /tmp/http_sched.log 2>&1 &

`--update`: rerun only `--variants` on the workload, rate and arrivals already in `--out`
(after a change to one of them), replacing their runs there.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tokenslice.bench.arrivals import arrival_times
from tokenslice.bench.servers import ServerProcess, ServerSpec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # own_answers.py: the sample and its files
from own_answers import MAX_MODEL_LEN, MODEL, RESULTS, prompt_texts  # noqa: E402

CACHE = HERE / "cache"
MAX_TOKENS = 512
PROBE = 16
# label -> (policy, predictor directory or None)
VARIANTS: dict[str, tuple[str, Path | None]] = {
    "fcfs": ("fcfs", None),
    "srpt-oracle": ("srpt-oracle", None),
    "srpt-predicted embed": ("srpt-predicted", CACHE / "predictor-embed"),
    "srpt-predicted self": ("srpt-predicted", CACHE / "predictor-self"),
    "srpt-predicted both": ("srpt-predicted", CACHE / "predictor-both"),
}


async def one(http: httpx.AsyncClient, url: str, text: str, expected: int | None, start: float,
              arrival: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, start + arrival - time.perf_counter()))
    sent = time.perf_counter()
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
                            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if expected is not None:
        body["tokenslice"] = {"expected_output_tokens": expected}
    first, tokens, finish = None, None, None
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices") or []:
                if first is None and (c.get("delta") or {}).get("content"):
                    first = time.perf_counter()
                finish = c.get("finish_reason") or finish
    end = time.perf_counter()
    return {"arrival": arrival, "sent": sent - start, "ttft": (first or end) - sent, "latency": end - sent,
            "tokens": tokens, "finish_reason": finish}


async def run_workload(url: str, reqs: list[dict[str, Any]], arrivals: np.ndarray, oracle: bool
                       ) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as http:
        start = time.perf_counter()
        return await asyncio.gather(*[one(http, url, r["text"], r["output_tokens"] if oracle else None, start, float(t))
                                      for r, t in zip(reqs, arrivals, strict=True)])


def serve(policy: str, predictor: Path | None, work: Path) -> ServerProcess:
    args = ["--no-compile", "--max-batch-size", "8", "--max-model-len", str(MAX_MODEL_LEN), "--engine-threads", "1"]
    if predictor is not None:
        copy = work / predictor.name
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(predictor, copy)
        args += ["--length-predictor", str(copy)]
    server = ServerProcess(ServerSpec(MODEL, args, threads=1), policy)
    server.wait_ready()
    return server


def summary(label: str, res: list[dict[str, Any]], recorded: list[int]) -> dict[str, Any]:
    norm = [r["latency"] / max(1, r["tokens"] or 1) for r in res]
    same = sum(1 for r, n in zip(res, recorded, strict=True) if r["tokens"] == n)
    out = {"variant": label, "mean_normalized_latency": float(np.mean(norm)), "p90_normalized_latency":
           float(np.quantile(norm, 0.9)), "mean_ttft": float(np.mean([r["ttft"] for r in res])),
           "mean_latency": float(np.mean([r["latency"] for r in res])), "length_as_recorded": same, "n": len(res)}
    print(f"{label:<22} mean norm. latency {out['mean_normalized_latency']:.3f} s/token  p90 "
          f"{out['p90_normalized_latency']:.3f}  mean TTFT {out['mean_ttft']:.1f}s  "
          f"lengths as recorded {same}/{len(res)}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", type=Path, default=HERE / "results" / "http_sched.json")
    ap.add_argument("--update", action="store_true", help="rerun --variants on the workload and arrivals in --out")
    a = ap.parse_args()
    texts = prompt_texts()
    recs = [json.loads(line) for line in RESULTS.read_text().splitlines()]
    test = [r | {"text": texts[r["id"]]} for r in recs if r["split"] == "test"]
    rng = np.random.default_rng(a.seed)
    reqs = [test[i] for i in rng.choice(len(test), min(a.num_requests, len(test)), replace=False)]
    recorded = [r["output_tokens"] for r in reqs]
    print(f"{len(reqs)} test prompts: mean recorded length {np.mean(recorded):.0f} tokens, "
          f"{sum(r['finish_reason'] == 'length' for r in reqs)} at the {MAX_TOKENS}-token cap", flush=True)
    result: dict[str, Any] = {"num_requests": len(reqs), "seed": a.seed, "ids": [r["id"] for r in reqs], "runs": []}
    labels = a.variants.split(",")
    with tempfile.TemporaryDirectory(prefix="tokenslice-self-") as tmp:
        if a.update:
            before = json.loads(a.out.read_text())
            if before["ids"] != result["ids"]:
                raise SystemExit(f"{a.out} holds another workload (its prompt sample differs)")
            rate, arrivals = before["rate_rps"], np.array(before["arrivals"])
            result = before | {"runs": [r for r in before["runs"] if r["variant"] not in labels]}
        else:
            server = serve("fcfs", None, Path(tmp))
            try:
                t0 = time.perf_counter()
                asyncio.run(run_workload(server.url, reqs[:PROBE], np.zeros(PROBE), False))
                rate = 0.9 * PROBE / (time.perf_counter() - t0)
            finally:
                server.stop()
            arrivals = arrival_times(len(reqs), rate, 4.0, np.random.default_rng(a.seed + 1))
            result |= {"rate_rps": rate, "arrivals": arrivals.tolist()}
        print(f"rate {rate:.4f} req/s (0.9 x fcfs saturation), CV 4, last arrival {arrivals[-1]:.0f}s", flush=True)
        for label in labels:
            policy, predictor = VARIANTS[label]
            server = serve(policy, predictor, Path(tmp))
            try:
                start = time.perf_counter()
                res = asyncio.run(run_workload(server.url, reqs, arrivals, policy == "srpt-oracle"))
                run = summary(label, res, recorded) | {"wall_s": time.perf_counter() - start, "requests": res}
            finally:
                server.stop()
            result["runs"].append(run)
            a.out.write_text(json.dumps(result, indent=1) + "\n")
    by = {r["variant"]: r["mean_normalized_latency"] for r in result["runs"]}
    if "fcfs" in by and "srpt-oracle" in by:
        gap = by["fcfs"] - by["srpt-oracle"]
        for label, v in by.items():
            share = (by["fcfs"] - v) / gap if gap else float("nan")
            result.setdefault("gap_closed", {})[label] = share
            print(f"{label:<22} closes {share:.0%} of the fcfs -> srpt-oracle gap")
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
