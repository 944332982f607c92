"""Structured outputs and tool calls on the default chat model (SmolLM2-135M-Instruct), as a client
sends them: the official `openai` SDK against `tokenslice serve`.

1. `client.chat.completions.parse(response_format=Character)` (a pydantic model) for 20 prompts:
   how many return a parsed object.
2. `tools` + `tool_choice="required"` for 20 prompts: how many answers carry calls whose arguments
   validate against the called tool's JSON schema.
3. Both again on a server under memory pressure that preempts and swaps (skip-join-mlfq,
   reactive-swap, a 48-block KV pool for 20 concurrent requests, batch 8), against the same server
   with room for all (batch 8, the default pool): how many outputs are identical, and the
   preemptions and swap bytes the pressured server reports (/metrics). Once with the file's
   int4/int8 weights (`--quantization auto`, the default), once dequantized (`none`): the
   quantized linears switch kernels with a step's row count (model/quant.py, DENSE_MIN_ROWS), so
   a step shaped differently by preemption may round differently; float32 steps do not.
4. Grammar cost: the engine in-process, 16 requests decoding together (greedy), each step timed;
   once free, once every request with a JSON schema: the mean decode step time of 16-row steps,
   and the time inside the grammar work (mask fill + apply + accept) per step.

All greedy (temperature 0). Prints a table; writes benchmarks/serving/results/structured_outputs.json.

    .venv/bin/python benchmarks/serving/structured_outputs.py
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic

from tokenslice.bench.servers import ServerSpec, running_server

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "results" / "structured_outputs.json"
MODEL = "smollm2-135m-instruct"
TOPICS = ["a lighthouse keeper", "a baker in Paris", "a retired pilot", "a young chess player", "a beekeeper",
          "a ship's cook", "a mountain guide", "a jazz pianist", "a forest ranger", "a train conductor",
          "a street musician", "a marine biologist", "a librarian", "a firefighter", "a potter",
          "a taxi driver in Tokyo", "a farmer", "a detective", "an astronaut", "a painter"]
CITIES = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Sydney", "Toronto", "Mumbai", "Berlin", "Nairobi",
          "Madrid", "Seoul", "Dublin", "Quito", "Hanoi", "Rome", "Denver", "Lagos", "Vienna", "Santiago"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "the city's name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}}},
]
PRESSURE = ["--policy", "skip-join-mlfq", "--preemption", "reactive-swap", "--kv-cache-blocks", "48",
            "--max-batch-size", "8", "--stall-guard", "off"]
ROOMY = ["--max-batch-size", "8"]
EXACT = ["--quantization", "none"]


class Character(pydantic.BaseModel):
    name: str
    age: int
    city: str


def parse_runs(client: openai.OpenAI) -> list[dict[str, Any]]:
    def one(topic: str) -> dict[str, Any]:
        out = client.chat.completions.parse(
            model=MODEL, response_format=Character, temperature=0, max_tokens=120,
            messages=[{"role": "user", "content": f"Invent a character: {topic}. Give a name, an age and a city."}])
        msg = out.choices[0].message
        return {"topic": topic, "text": msg.content, "parsed": msg.parsed is not None,
                "finish": out.choices[0].finish_reason}
    with ThreadPoolExecutor(20) as pool:
        return list(pool.map(one, TOPICS))


def tool_runs(client: openai.OpenAI) -> list[dict[str, Any]]:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

    def one(city: str) -> dict[str, Any]:
        out = client.chat.completions.create(
            model=MODEL, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120,
            messages=[{"role": "user", "content": f"What is the weather like in {city} right now?"}])
        choice = out.choices[0]
        calls = choice.message.tool_calls or []
        valid = bool(calls)
        for c in calls:
            try:
                jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
            except (KeyError, json.JSONDecodeError, jsonschema.ValidationError):
                valid = False
        return {"city": city, "calls": [[c.function.name, c.function.arguments] for c in calls], "valid": valid,
                "finish": choice.finish_reason}
    with ThreadPoolExecutor(20) as pool:
        return list(pool.map(one, CITIES))


def counters(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for name in ("tokenslice:num_preemptions_total", "tokenslice:kv_swap_out_bytes_total"):
            if line.startswith(name + " ") or line.startswith(name + "{"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def http_part(flags: list[str]) -> dict[str, Any]:
    with running_server(ServerSpec(MODEL, args=flags), flags[flags.index("--policy") + 1]
                        if "--policy" in flags else "fcfs") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        parsed, tools = parse_runs(client), tool_runs(client)
        return {"flags": flags, "parse": parsed, "tools": tools, "counters": counters(url)}


def grammar_cost(rows: int = 16, steps: int = 48) -> dict[str, Any]:
    """Mean decode step time with `rows` requests decoding, free and constrained, and the grammar
    work inside the constrained steps."""
    from tokenslice import LLM, SamplingParams
    from tokenslice.model import grammar
    from tokenslice.request import StructuredOutput

    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    spent = [0.0]
    apply, accept = grammar.GrammarMasks.apply, grammar.GrammarMasks.accept

    def timed(fn):
        def run(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[0] += time.perf_counter() - t0
        return run
    grammar.GrammarMasks.apply = timed(apply)
    grammar.GrammarMasks.accept = staticmethod(timed(accept))
    out: dict[str, Any] = {"rows": rows}
    with LLM(MODEL, max_batch_size=rows, compile=True) as llm:
        llm.engine.runner.compiled.wait(600)
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a long story."}],
                                                   tokenize=False, add_generation_prompt=True)
        for name, structured in (("free", None), ("json_schema", StructuredOutput("json_schema", json.dumps(schema)))):
            params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=structured is None,
                                    structured=structured)
            llm.generate([prompt], params)  # warm: grammar compiled, shapes seen
            reqs = [llm.engine.add_request(prompt, params) for _ in range(rows)]
            times: list[float] = []
            spent[0] = 0.0
            grammar_s: list[float] = []
            while llm.engine.has_unfinished():
                live = sum(1 for r in reqs if not r.is_finished)
                before = spent[0]
                t0 = time.perf_counter()
                llm.engine.step()
                if live == rows and all(r.num_output_tokens > 0 for r in reqs):
                    times.append(time.perf_counter() - t0)
                    grammar_s.append(spent[0] - before)
            out[name] = {"decode_steps": len(times), "mean_step_ms": 1e3 * statistics.fmean(times),
                         "grammar_ms_per_step": 1e3 * statistics.fmean(grammar_s) if grammar_s else 0.0}
    grammar.GrammarMasks.apply, grammar.GrammarMasks.accept = apply, accept
    free, json_ = out["free"]["mean_step_ms"], out["json_schema"]["mean_step_ms"]
    out["step_overhead"] = json_ / free - 1
    out["grammar_share"] = out["json_schema"]["grammar_ms_per_step"] / json_
    return out


def report(res: dict[str, Any]) -> None:
    print(f"## Structured outputs and tool calls, {MODEL} ({res['machine']}, {res['date']})\n")
    print("| server | parse() parsed | required tool calls valid | preemptions | swap-out MiB |")
    print("|---|---|---|---|---|")
    for name in ("roomy", "pressure", "roomy_exact", "pressure_exact"):
        r = res[name]
        c = r["counters"]
        print(f"| {name} ({' '.join(r['flags'])}) | {sum(x['parsed'] for x in r['parse'])}/20 | "
              f"{sum(x['valid'] for x in r['tools'])}/20 | {c.get('tokenslice:num_preemptions_total', 0):.0f} | "
              f"{c.get('tokenslice:kv_swap_out_bytes_total', 0) / 2**20:.1f} |")
    for key, label in (("identical", "quantization auto"), ("identical_exact", "quantization none")):
        same = res[key]
        print(f"\noutputs identical under pressure ({label}): parse {same['parse']}/20, tools {same['tools']}/20")
    g = res["grammar"]
    print(f"\ngrammar cost, {g['rows']} rows decoding: free step {g['free']['mean_step_ms']:.2f} ms, "
          f"JSON-schema step {g['json_schema']['mean_step_ms']:.2f} ms ({100 * g['step_overhead']:+.1f}%); "
          f"grammar work {g['json_schema']['grammar_ms_per_step']:.2f} ms per step "
          f"({100 * g['grammar_share']:.1f}% of the step)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    if a.report_only:
        report(json.loads(OUT.read_text()))
        return
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"),
                           "machine": f"{os.cpu_count()}-CPU box, load average {os.getloadavg()[0]:.1f} at start"}
    for suffix, extra in (("", []), ("_exact", EXACT)):
        roomy, pressure = http_part(ROOMY + extra), http_part(PRESSURE + extra)
        res["roomy" + suffix], res["pressure" + suffix] = roomy, pressure
        res["identical" + suffix] = {
            "parse": sum(x["text"] == y["text"] for x, y in zip(roomy["parse"], pressure["parse"])),
            "tools": sum(x["calls"] == y["calls"] for x, y in zip(roomy["tools"], pressure["tools"]))}
    res["grammar"] = grammar_cost()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1))
    report(res)


if __name__ == "__main__":
    sys.exit(main())
