"""Length prediction from the served model's own hidden states (predict/self_head.py,
self_refine.py, online.py): capture leaves outputs unchanged and returns the states a one-pass
forward computes, the head learns online, refinement keeps to its budget, srpt-predicted re-ranks."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from tokenslice.llm import LLM
from tokenslice.plan import SeqSlice, StepPlan
from tokenslice.predict.online import UNTIL_PREFILL, OnlineLengthPredictor, predictor_kind
from tokenslice.predict.self_head import SELF_HEAD_FILE, SelfHeadConfig, SelfLengthHead
from tokenslice.predict.self_refine import SelfRefiner
from tokenslice.request import Request, SamplingParams
from tokenslice.sched.policy import PolicyContext
from tokenslice.sched.registry import make_policy

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260k"
PROMPTS = [[1, 403, 407, 261, 1000 % 512, 266], [1, 77, 88, 99], [1, 300, 301, 302, 303, 304, 305, 306, 307]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def fitted_head(layer: int, hidden: int, refine_every: int = 4, budget_s: float = 1.0, seed: int = 0) -> SelfLengthHead:
    """A head fitted on random rows (its predictions are arbitrary; what it is asked for is not)."""
    rng = np.random.default_rng(seed)
    head = SelfLengthHead(SelfHeadConfig(layer=layer, hidden_size=hidden, refine_every=refine_every,
                                         budget_s=budget_s, refit_every=2))
    n = 64
    head.add(rng.normal(size=(n, hidden)), rng.integers(1, 50, n), rng.integers(0, 30, n), rng.integers(1, 200, n),
             rng.normal(size=(n, hidden)))
    assert head.fit()
    head.answers = head.config.min_answers  # as if fitted on enough answers: it predicts
    return head


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_capture_leaves_greedy_tokens_unchanged_and_returns_the_one_pass_states(compiled: bool) -> None:
    """Compiled: the CPU layer graphs capture between layers, so capturing steps stay compiled
    (a tiny model built before serving gets whole-model graphs only: layer graphs are built here)."""
    llm = LLM(str(STORIES), dtype="float32", compile=compiled, device="cpu")
    inductor = None
    if compiled:
        from tokenslice.model.inductor_decode import InductorDecode, decoder_parts

        graphs = llm.engine.runner.compiled
        parts = decoder_parts(graphs.model)
        inductor = InductorDecode(graphs.model, parts, graphs.kv, graphs.block_size, graphs.multi_row,
                                  layer_graphs=True, whole_graphs=False)
        inductor.build()
        graphs.inductor = inductor
    plain = greedy_tokens(llm)
    compiled_steps = inductor.steps if inductor is not None else 0
    arch = llm.engine.runner.model.arch
    head = fitted_head(layer=2, hidden=arch.hidden_size)
    refiner = SelfRefiner(head)
    llm.engine.lengths = OnlineLengthPredictor(None, llm.tokenizer, refiner)
    seen: dict[tuple[str, int], list[float]] = {}
    apply = refiner.apply

    def recording_apply(hidden, output_tokens):  # noqa: ANN001, ANN202
        for rid, h in hidden.items():
            seen[(rid, output_tokens[rid])] = h
        return apply(hidden, output_tokens)

    refiner.apply = recording_apply  # type: ignore[method-assign]
    captured = greedy_tokens(llm)
    assert captured == plain
    if inductor is not None:  # as many compiled steps with capture as without
        assert compiled_steps > 0 and inductor.steps == 2 * compiled_steps
    # At prefill (t = 0) and every refine_every = 4 tokens after it, for each request.
    assert sorted({t for _, t in seen}) == list(range(0, GREEDY.max_tokens, 4))
    assert refiner.num_predictions == len(seen) == len(PROMPTS) * GREEDY.max_tokens // 4
    # Each captured state is what one forward pass over prompt + answer computes at its row.
    runner = llm.engine.runner
    for i, (prompt, answer) in enumerate(zip(PROMPTS, plain, strict=True)):
        rid = f"req-{len(PROMPTS) + i}"  # the second generate's ids follow the first's
        seq = prompt + answer
        plan = StepPlan(prefill=[SeqSlice("x", seq, 0, list(range(8)), False, SamplingParams(), 0)])
        ts = [t for r, t in seen if r == rid]
        ref = runner.prompt_hidden(plan, 2, [len(prompt) - 1 + t for t in ts]).numpy()
        got = np.array([seen[(rid, t)] for t in ts])
        np.testing.assert_allclose(got, ref, atol=1e-4)
    llm.close()


def test_head_learns_online_and_reloads(tmp_path: Path) -> None:
    """Ridge from running sums: rows whose remaining length is a linear function of the state
    are learned, refits happen every refit_every finished requests, and save/load round-trips."""
    rng = np.random.default_rng(1)
    dim = 16
    w = rng.normal(size=dim)
    head = SelfLengthHead(SelfHeadConfig(layer=0, hidden_size=dim, ridge=1e-3, refit_every=3))
    path = tmp_path / SELF_HEAD_FILE
    refiner = SelfRefiner(head, path)
    for r in range(40):  # bootstrap the first fit by hand, then learn from finished requests
        h = rng.normal(size=(1, dim))
        head.add(h, [10], [0], [np.expm1(3 + 0.3 * h[0] @ w)])
    head.fit()
    for r in range(9):
        rid = f"r{r}"
        refiner.add(rid, 10)
        h = rng.normal(size=dim)
        total = int(np.expm1(3 + 0.3 * h @ w))
        refiner.apply({rid: h.tolist()}, {rid: 0})
        refiner.finish(rid, total, learn=True)
    assert path.is_file() and head.rows_since_fit == 0  # the 9th finish refitted and saved
    test = rng.normal(size=(200, dim))
    pred = head.predict_log(test, np.full(200, 10), np.zeros(200))
    assert np.corrcoef(pred, test @ w)[0, 1] > 0.95
    again = SelfLengthHead.load(path)
    np.testing.assert_allclose(again.predict_log(test, np.full(200, 10), np.zeros(200)), pred)
    assert predictor_kind(tmp_path) == "self"


def test_refinements_read_the_prompt_state_captured_at_prefill(tmp_path: Path) -> None:
    """Rows past the prompt carry the prompt's state beside the latest one: a head whose lengths
    depend on the prompt alone ranks running requests by it, from the states the refiner kept at
    prefill, and learns from finished requests' rows with it; heads saved before prompt states
    load as they were fitted."""
    rng = np.random.default_rng(2)
    dim = 8
    w = rng.normal(size=dim)
    head = SelfLengthHead(SelfHeadConfig(layer=0, hidden_size=dim, ridge=1e-3, refine_every=4, refit_every=4))
    prompts = rng.normal(size=(400, dim))
    gen = rng.integers(0, 64, 400)
    head.add(rng.normal(size=(400, dim)), np.full(400, 10), gen, np.expm1(5 + prompts @ w) - gen, prompts)
    head.fit()
    head.answers = head.config.min_answers
    with pytest.raises(ValueError, match="prompt_hidden"):
        head.predict_log(prompts[:2], [10, 10], [0, 8])
    refiner = SelfRefiner(head)
    h0 = rng.normal(size=(6, dim))
    for r in range(6):
        refiner.add(f"r{r}", 10)
    refiner.apply({f"r{r}": h0[r].tolist() for r in range(6)}, {f"r{r}": 0 for r in range(6)})
    later = refiner.apply({f"r{r}": rng.normal(size=dim).tolist() for r in range(6)}, {f"r{r}": 8 for r in range(6)})
    order = sorted(range(6), key=lambda r: later[f"r{r}"])
    assert order == sorted(range(6), key=lambda r: h0[r] @ w)
    rows_before = head.n
    for r in range(6):
        refiner.finish(f"r{r}", 100, learn=True)
    assert head.n == rows_before + 12  # two rows each (t = 0 and 8), with their prompt states
    old = SelfLengthHead(SelfHeadConfig(layer=0, hidden_size=dim, prompt_state=False))
    old.add(prompts, np.full(400, 10), gen, np.full(400, 50.0))
    old.fit()
    old.save(tmp_path / SELF_HEAD_FILE)
    data = dict(np.load(tmp_path / SELF_HEAD_FILE))
    config = json.loads(str(data["config"]))
    del config["prompt_state"]  # as written before the field existed
    data["config"] = np.array(json.dumps(config))
    np.savez(tmp_path / SELF_HEAD_FILE, **data)
    loaded = SelfLengthHead.load(tmp_path / SELF_HEAD_FILE)
    assert not loaded.config.prompt_state
    np.testing.assert_allclose(loaded.predict_log(prompts, np.full(400, 10), gen), old.predict_log(prompts, np.full(400, 10), gen))


class StepTimer:
    """A clock that moves only when told: the next timed span (a pair of readings) lasts `pending`."""

    def __init__(self) -> None:
        self.now = 0.0
        self.pending = 0.0
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 2 == 0:  # the span's end
            self.now += self.pending
            self.pending = 0.0
        return self.now


def decode_slice(rid: str, done: int) -> SeqSlice:
    return SeqSlice(rid, [5], 10 + done, [0], True, SamplingParams(), done)


def test_refinement_over_budget_is_deferred_most_overdue_first() -> None:
    timer = StepTimer()
    head = fitted_head(layer=0, hidden=8, refine_every=4, budget_s=0.0025)
    refiner = SelfRefiner(head, timer=timer)
    ids = [f"r{i}" for i in range(5)]
    for rid in ids:
        refiner.add(rid, 10)
    # Prefill predictions: always made, whatever the budget. Each row 'costs' 1 ms.
    prefill = StepPlan(prefill=[SeqSlice(rid, list(range(10)), 0, [0], True, SamplingParams(), 0) for rid in ids])
    assert refiner.mark(prefill) == 5 and prefill.hidden_layer == 0
    timer.pending = 0.005
    refiner.apply({rid: [0.0] * 8 for rid in ids}, {rid: 0 for rid in ids})
    assert refiner.cost_s == pytest.approx(0.001)
    # Not yet due (3 < 4 tokens since the last prediction): nothing asked.
    early = StepPlan(decode=[decode_slice(rid, 3) for rid in ids])
    assert refiner.mark(early) == 0 and early.hidden_layer is None
    # All due, but 2.5 ms of budget at 1 ms each: two now, the other three wait.
    plan = StepPlan(decode=[decode_slice(rid, 4 + (rid == "r4")) for rid in ids])
    assert refiner.mark(plan) == 2 and refiner.num_deferred == 3
    first = [s.request_id for s in plan.decode if s.capture_hidden]
    assert "r4" in first  # the most overdue (5 tokens since its prediction) goes first
    timer.pending = 0.002
    refiner.apply({rid: [0.0] * 8 for rid in first}, {rid: 4 for rid in first})
    # The next step: the deferred ones are now the most overdue.
    nxt = StepPlan(decode=[decode_slice(rid, 5) for rid in ids])
    assert refiner.mark(nxt) == 2
    assert not {s.request_id for s in nxt.decode if s.capture_hidden} & set(first)
    # A zero budget refines nothing, but prefill predictions still happen.
    head.config.budget_s = 0.0
    zero = StepPlan(decode=[decode_slice(rid, 12) for rid in ids])
    assert refiner.mark(zero) == 0
    refiner.add("new", 10)
    assert refiner.mark(StepPlan(prefill=[SeqSlice("new", list(range(10)), 0, [0], True, SamplingParams(), 0)])) == 1


def test_srpt_predicted_reranks_by_the_refined_prediction() -> None:
    from test_scheduler import COST

    from tokenslice.config import SchedulerConfig

    pol = make_policy("srpt-predicted", PolicyContext(SchedulerConfig(max_batch_size=2), COST))
    a = Request("a", [1] * 8, SamplingParams(max_tokens=500), 0.0, predicted_output_tokens=20)
    b = Request("b", [1] * 8, SamplingParams(max_tokens=500), 0.0, predicted_output_tokens=200)
    for r in (a, b):
        pol.on_arrival(r, 0.0)
    assert [r.request_id for r in pol.ranked(0.0)] == ["a", "b"]
    a.output_token_ids.extend([3] * 16)
    a.predicted_output_tokens = 400  # refined: a turns out long
    pol.on_prediction(a, 1.0)
    assert [r.request_id for r in pol.ranked(1.0)] == ["b", "a"]
    row = pol.describe_queues()["order"][1]
    assert row["id"] == "a" and row["predicted_remaining_tokens"] == 400 - 16
    a.predicted_output_tokens = 3  # behind what it generated: at least one more token
    pol.on_prediction(a, 2.0)
    assert pol.predicted["a"] == 17


def test_engine_loads_a_self_head_and_refines_live_predictions(tmp_path: Path) -> None:
    probe = LLM(str(STORIES), dtype="float32")
    hidden = probe.engine.runner.model.arch.hidden_size
    probe.close()
    fitted_head(layer=1, hidden=hidden, refine_every=8).save(tmp_path / SELF_HEAD_FILE)
    llm = LLM(str(STORIES), dtype="float32", policy="srpt-predicted", length_predictor=str(tmp_path))
    eng = llm.engine
    assert eng.lengths is not None and eng.lengths.kind == "self"
    req = eng.add_request(PROMPTS[0], GREEDY)
    assert req.predicted_output_tokens == UNTIL_PREFILL  # "self" knows nothing before the prefill
    eng.step()
    first = req.predicted_output_tokens
    assert first is not None and eng.lengths.predicted_at(req.request_id) == 0
    for _ in range(8):
        eng.step()
    assert eng.lengths.predicted_at(req.request_id) == 8
    state = eng.state()
    assert state["requests"][0]["predicted_output_tokens"] == req.predicted_output_tokens
    while eng.has_unfinished():
        eng.step()
    llm.close()
    # Too few layers for the head: refused at load.
    fitted_head(layer=50, hidden=hidden).save(tmp_path / SELF_HEAD_FILE)
    with pytest.raises(ValueError, match="layer 50"):
        LLM(str(STORIES), dtype="float32", length_predictor=str(tmp_path))


def test_refinements_are_recorded_and_the_simulator_replays_them(tmp_path: Path) -> None:
    from test_scheduler import COST, Item

    from tokenslice.config import SchedulerConfig
    from tokenslice.predict.recorded import RecordedRefinements
    from tokenslice.sim.engine import simulated_engine
    from tokenslice.sim.replay import replay

    probe = LLM(str(STORIES), dtype="float32")
    hidden = probe.engine.runner.model.arch.hidden_size
    probe.close()
    fitted_head(layer=1, hidden=hidden, refine_every=8).save(tmp_path / SELF_HEAD_FILE)
    record = tmp_path / "refinements.jsonl"
    with LLM(str(STORIES), dtype="float32", policy="srpt-predicted", length_predictor=str(tmp_path),
             length_predictor_record=str(record)) as llm:
        llm.generate(PROMPTS[:1], GREEDY)
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    assert [x["output_tokens"] for x in lines] == [0, 8, 16] and {x["id"] for x in lines} == {"req-0"}
    # The simulator has no hidden states: it replays the recording, each point once the request passed it.
    record.write_text("".join(json.dumps({"id": "a", "output_tokens": t, "predicted_output_tokens": p}) + "\n"
                              for t, p in ((0, 30), (8, 50), (16, 20))))
    eng = simulated_engine(SchedulerConfig(policy="srpt-predicted", max_batch_size=4), COST, kv_cache_blocks=1000)
    eng.fast_forward = False  # one step at a time: each point lands on the step after its capture
    eng.lengths = RecordedRefinements.load(record)
    seen: dict[int, int] = {}

    def watch(_now: float) -> None:
        req = eng.scheduler.requests.get("a")
        if req is not None:
            seen[req.num_output_tokens] = eng.scheduler.policy.predicted["a"]

    replay(eng, [Item("a", 0.0, 10, 40)], on_advance=watch)
    assert seen[1] == 30 and seen[8] == 30 and seen[9] == 50 and seen[17] == 20 and seen[39] == 40
    assert eng.lengths.num_applied == 3


def test_build_self_fits_a_head_on_recorded_states_and_the_engine_reads_it(tmp_path: Path) -> None:
    """`tokenslice predictor build-self` on a states file (self_features.py's layout): the head
    learns the train rows' remaining lengths, refuses to overwrite, and its directory is a "self"
    predictor."""
    from tokenslice.bench.length_self import load_rows, spearman_at
    from tokenslice.cli import main

    rng = np.random.default_rng(3)
    dim, n = 12, 60
    w = rng.normal(size=dim)
    hid, ids, ts, outs = [], [], [], []
    for a in range(n):
        total = int(np.expm1(4 + 0.4 * rng.normal()))
        for t in range(0, total, 8):
            h = rng.normal(size=dim)
            h[0] = np.log1p(total - t) - 0.4 * h[1:] @ w[1:]  # remaining length is linear in the state
            hid.append(h), ids.append(f"q{a}"), ts.append(t), outs.append(total)
    m = len(ts)
    split = np.where(np.array([int(i[1:]) for i in ids]) < 45, "train", "test")
    np.savez(tmp_path / "states.npz", layer3=np.array(hid, dtype=np.float16), id=np.array(ids), t=np.array(ts),
             output_tokens=np.array(outs), prompt_tokens=np.full(m, 20), split=split, source=np.full(m, "alpaca"),
             finish_reason=np.full(m, "stop"))
    out = tmp_path / "pred"
    args = ["predictor", "build-self", "--features", str(tmp_path / "states.npz"), "--layer", "3", "--out", str(out),
            "--ridge", "0.01"]
    assert main(args) == 0
    assert predictor_kind(out) == "self"
    head = SelfLengthHead.load(out / SELF_HEAD_FILE)
    assert (head.config.layer, head.config.hidden_size, head.config.max_t) == (3, dim, 128)
    rows = load_rows(tmp_path / "states.npz", 3)
    assert spearman_at(head, rows.where(rows.split == "test"), 0)["all"]["spearman"] > 0.9
    assert main(args) == 2  # a head is there already
    assert main(args[:5] + ["7"] + args[6:]) == 2  # no states of that layer


def test_srpt_predicted_learns_a_head_from_empty_and_ranks_like_skip_join_until_then(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No --length-predictor: srpt-predicted gets the model's own head in the state directory,
    empty for a model the package has no head for. It ranks like skip-join-mlfq while the head
    learns from finished answers, predicts once it has seen min_answers, and the next start finds
    what it learned (owner-only files)."""
    import functools

    import tokenslice.predict.online as online

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    # A fresh head that predicts after 4 answers (the default waits for 64).
    monkeypatch.setattr(online, "SelfHeadConfig", functools.partial(SelfHeadConfig, min_answers=4, refit_every=2))
    prompts = [[1] + [random.Random(i).randrange(3, 500) for _ in range(6)] for i in range(6)]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(6)]
    with LLM(str(STORIES), dtype="float32", policy="srpt-predicted") as llm:
        eng = llm.engine
        assert eng.lengths is not None and eng.lengths.kind == "self" and not eng.lengths.ready
        policy = eng.scheduler.policy
        assert policy.warmup is not None and eng.state()["queues"]["warmup_for"] == "srpt-predicted"
        req = eng.add_request(prompts[0], params[0])
        assert req.predicted_output_tokens is None  # nothing predicted while the head learns
        while eng.has_unfinished():
            eng.step()
        for p, sp in zip(prompts[1:4], params[1:4]):
            llm.generate([p], sp)
        head = eng.lengths.refiner.head
        assert head.answers == 4 and head.trained and eng.lengths.ready
        assert policy.warmup is None  # srpt-predicted ranks by the head's predictions from now on
        out = eng.add_request(prompts[4], params[4])
        eng.step()
        assert out.predicted_output_tokens is not None
        while eng.has_unfinished():
            eng.step()
    saved = list((tmp_path / "tokenslice" / "length").glob("*/self_head.npz"))
    assert len(saved) == 1 and saved[0].stat().st_mode & 0o077 == 0
    assert saved[0].parent.stat().st_mode & 0o077 == 0
    with LLM(str(STORIES), dtype="float32", policy="srpt-predicted") as again:
        assert again.engine.lengths.ready and again.engine.scheduler.policy.warmup is None
        assert again.engine.lengths.refiner.head.answers == 5
    with LLM(str(STORIES), dtype="float32", policy="srpt-predicted", length_predictor="none") as none:
        assert none.engine.lengths is None


def test_a_shipped_head_is_a_prior_that_refits_pull_towards(tmp_path: Path) -> None:
    """A head saved without its sums (what the package ships) predicts as fitted; refits on a few
    new answers adjust its weights rather than replace them with a fit of those answers alone."""
    rng = np.random.default_rng(3)
    dim = 8
    head = fitted_head(layer=0, hidden=dim)
    head.save(tmp_path / "prior.npz", sums=False)
    assert (tmp_path / "prior.npz").stat().st_size < 8192
    shipped = SelfLengthHead.load(tmp_path / "prior.npz")
    assert shipped.ready and shipped.n == 0 and np.array_equal(shipped.weights, head.weights)
    x = rng.normal(size=(3, dim))
    assert np.allclose(shipped.predict_log(x, [5] * 3, [0] * 3), head.predict_log(x, [5] * 3, [0] * 3))
    shipped.add(rng.normal(size=(6, dim)), rng.integers(1, 50, 6), np.zeros(6), rng.integers(1, 200, 6))
    shipped.fit()
    alone = SelfLengthHead(shipped.config)
    alone.n, alone.sx, alone.sxx, alone.sy, alone.sxy = shipped.n, shipped.sx, shipped.sxx, shipped.sy, shipped.sxy
    alone.fit()
    assert np.linalg.norm(shipped.weights - head.weights) < np.linalg.norm(alone.weights - head.weights)


def test_the_default_chat_model_starts_from_the_shipped_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """smollm2-135m-instruct's auto head is the package's (fitted on its own answers): ready at
    once, a prior for what the deployment learns; another model's starts empty."""
    from tokenslice.predict.online import SHIPPED_HEADS, auto_predictor_dir

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    shipped = SelfLengthHead.load(SHIPPED_HEADS / "smollm2-135m-instruct.npz")
    head = SelfLengthHead.load(auto_predictor_dir("smollm2-135m-instruct", 576, 30) / SELF_HEAD_FILE)
    assert head.ready and head.answers == shipped.answers >= head.config.min_answers
    assert head.config.hidden_size == 576 and np.array_equal(head.prior, shipped.weights)
    other = SelfLengthHead.load(auto_predictor_dir(str(STORIES), 64, 5) / SELF_HEAD_FILE)
    assert not other.ready and other.answers == 0 and other.config.layer == 2
