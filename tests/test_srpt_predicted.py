"""srpt-predicted (ALISE §3.1-3.2): order by predicted remaining time, misprediction doubling,
virtual aging against starvation, EWT, and exact event skipping on the simulator."""
from __future__ import annotations

import dataclasses
import random

import pytest

from test_scheduler import COST, Item, fingerprint, trace
from tokenslice.config import SchedulerConfig
from tokenslice.engine.engine import Engine
from tokenslice.sim.engine import simulated_engine
from tokenslice.sim.replay import replay
from tokenslice.request import Request, RequestState, SamplingParams
from tokenslice.sched.policy import PolicyContext
from tokenslice.sched.registry import make_policy
from tokenslice.sched.speculative import DEFAULT_OUTPUT_TOKENS, SpeculativeSRPTPolicy


@dataclasses.dataclass
class PredictedItem(Item):
    predicted_output_tokens: int | None = None


def with_predictions(items: list[Item], predict) -> list[PredictedItem]:
    return [PredictedItem(**dataclasses.asdict(it), predicted_output_tokens=predict(it)) for it in items]


def simulate(items: list[Item], blocks: int = 100_000, preemption: str = "recompute", fast_forward: bool = True,
             batch: int = 8, **cfg) -> tuple[Engine, list[Request]]:
    eng = simulated_engine(SchedulerConfig(policy="srpt-predicted", preemption=preemption, max_batch_size=batch,
                                           **cfg), COST, kv_cache_blocks=blocks)
    eng.fast_forward = fast_forward
    return eng, replay(eng, items)


def policy(**cfg) -> SpeculativeSRPTPolicy:
    pol = make_policy("srpt-predicted", PolicyContext(SchedulerConfig(max_batch_size=2, **cfg), COST))
    assert isinstance(pol, SpeculativeSRPTPolicy)
    return pol


def req(rid: str, prompt: int = 16, t: float = 0.0, predicted: int | None = None, max_tokens: int = 1000) -> Request:
    return Request(rid, [0] * prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), t,
                   predicted_output_tokens=predicted)


def decode(pol: SpeculativeSRPTPolicy, r: Request, tokens: int, now: float = 0.0) -> None:
    """`tokens` iterations of `r` (the first one its prefill), as the scheduler reports them."""
    for _ in range(tokens):
        r.num_computed_tokens = r.num_tokens
        r.output_token_ids.append(0)
        r.state = RequestState.RUNNING
        pol.on_step([r], 0.02, now)


def ids(pol: SpeculativeSRPTPolicy) -> list[str]:
    return [r.request_id for r in pol.ranked(0.0)]


def test_orders_by_predicted_remaining_time():
    pol = policy(srpt_aging=0.0)
    for r in (req("long", predicted=300), req("short", predicted=10), req("mid", predicted=100),
              req("mid-long-prompt", prompt=1500, predicted=100)):
        pol.on_arrival(r, 0.0)
    assert ids(pol) == ["short", "mid", "mid-long-prompt", "long"]
    # Remaining time falls as a job runs: 250 tokens into its 300, "long" passes "mid".
    long_ = next(r for r in pol.ranked(0.0) if r.request_id == "long")
    decode(pol, long_, 250)
    assert ids(pol) == ["short", "long", "mid", "mid-long-prompt"]
    assert pol.remaining_s(long_) == pytest.approx(50 * COST.decode_seconds(1, 16 + 275), rel=1e-3)
    # T(I, O) = prefill + decode over the growing context (ALISE Eqs. 3-5), summed exactly.
    exact = COST.first_iteration_seconds(16) + sum(COST.decode_seconds(1, 16 + i) for i in range(1, 300))
    assert pol.execution_s(16, 300) == pytest.approx(exact, rel=1e-6)


def test_misprediction_doubles_the_prediction_and_demotes_the_job():
    pol = policy(srpt_aging=0.0)
    a, b = req("a", predicted=4), req("b", predicted=6)
    pol.on_arrival(a, 0.0)
    pol.on_arrival(b, 0.0)
    assert ids(pol) == ["a", "b"]
    decode(pol, a, 4)  # reached its prediction without finishing: 4 -> 8
    assert pol.predicted["a"] == 8 and pol.num_demotions == 1 and ids(pol) == ["a", "b"]
    decode(pol, a, 4)  # 8 -> 16: now more left than b has
    assert pol.predicted["a"] == 16 and ids(pol) == ["b", "a"]
    # Never past what the job can produce (max_tokens).
    c = req("c", predicted=3, max_tokens=5)
    pol.on_arrival(c, 0.0)
    decode(pol, c, 3)
    assert pol.predicted["c"] == 5


def test_requests_without_prediction_use_the_mean_finished_output():
    pol = policy()
    first = req("first")
    pol.on_arrival(first, 0.0)
    assert pol.predicted["first"] == DEFAULT_OUTPUT_TOKENS
    for rid, n in (("x", 10), ("y", 30)):
        r = req(rid, predicted=n)
        pol.on_arrival(r, 0.0)
        decode(pol, r, n)
        r.state = RequestState.FINISHED
        pol.on_finish(r)
    pol.on_arrival(later := req("later"), 1.0)
    assert pol.predicted[later.request_id] == 20


def test_aging_ranks_an_old_long_job_ahead_of_new_short_ones():
    pol = policy(srpt_aging=0.5)
    long_ = req("long", predicted=400)
    pol.on_arrival(long_, 0.0)
    rem = pol.remaining_s(long_)
    soon, late = req("soon", t=0.5 * rem, predicted=5), req("late", t=2.5 * rem, predicted=5)
    pol.on_arrival(soon, soon.arrival_time)
    pol.on_arrival(late, late.arrival_time)
    # Waited 2.5 x its remaining time at aging 0.5: it has cancelled more than all its own work.
    assert ids(pol) == ["soon", "long", "late"]


def test_ewt_is_the_work_ahead_shared_by_the_batch():
    pol = policy(srpt_aging=0.0)
    reqs = [req(f"r{i}", predicted=10 * (i + 1)) for i in range(5)]
    for r in reqs:
        pol.on_arrival(r, 0.0)
    est = pol.next_run_estimates(0.0)
    rem = [pol.remaining_s(r) for r in reqs]
    assert [est[r.request_id] for r in reqs] == pytest.approx(
        [0.0, 0.0, sum(rem[:2]) / 2, sum(rem[:3]) / 2, sum(rem[:4]) / 2])
    assert pol.next_run_estimate(reqs[4], 0.0) == est["r4"]
    # The device keeps the top jobs whose predicted peak KV fits (ALISE Alg. 2 hint).
    assert pol.device_job_limit(16 * 3 + 10 + 20 + 30, 0.0) == 3
    assert pol.device_job_limit(1, 0.0) == 1


def test_aging_lets_a_long_job_finish_under_a_stream_of_short_ones():
    # One batch slot; short jobs arrive a little faster than they can be served, so without
    # aging the long job (which arrived first) waits for the whole stream to drain.
    short_s = COST.first_iteration_seconds(16) + 4 * COST.decode_seconds(1, 20)
    stream_end = 60.0
    items = [PredictedItem("long", 0.0, 16, 400, predicted_output_tokens=400)]
    t, i = 0.01, 0
    while t < stream_end:
        items.append(PredictedItem(f"s{i}", t, 16, 5, predicted_output_tokens=5))
        t, i = t + 0.95 * short_s, i + 1
    finish = {}
    for aging in (0.0, 0.5):
        _, reqs = simulate(items, batch=1, srpt_aging=aging)
        assert all(r.num_output_tokens == it.output_len for r, it in zip(reqs, items))
        finish[aging] = reqs[0].metrics.finish_time
    assert finish[0.0] > stream_end  # starved while the stream lasted
    long_s = COST.first_iteration_seconds(16) + 399 * COST.decode_seconds(1, 216)
    # Aged past new arrivals after ~long_s / aging; then the backlog before it, then its own run.
    assert finish[0.5] < long_s / 0.5 + 0.1 * stream_end + long_s < stream_end


def p99(values: list[float]) -> float:
    return sorted(values)[-(-99 * len(values) // 100) - 1]


def test_ten_times_too_short_predictions_still_finish_everything_without_starvation():
    items = trace(300, seed=5, rate=1.0, max_out=400)
    runs = {}
    default = SchedulerConfig().srpt_aging
    for name, predict, aging in (("right", lambda it: it.output_len, default),
                                 ("10x short", lambda it: max(1, it.output_len // 10), default),
                                 ("10x short, no aging", lambda it: max(1, it.output_len // 10), 0.0)):
        # The policy's own order (the stall guard would reorder started streams by their readers).
        eng, reqs = simulate(with_predictions(items, predict), srpt_aging=aging, stall_guard="off")
        assert all(r.finish_reason == "stop" and r.num_output_tokens == it.output_len
                   for r, it in zip(reqs, items))
        assert not eng.scheduler.requests
        runs[name] = (eng.scheduler.policy.num_demotions, p99([r.metrics.e2e for r in reqs]))
    assert runs["right"][0] == 0 and runs["10x short"][0] > len(items)
    # Demotion recovers most of the order, and aging bounds the tail.
    assert runs["10x short"][1] <= 1.5 * runs["right"][1]
    assert runs["10x short"][1] <= runs["10x short, no aging"][1]


@pytest.mark.parametrize("blocks,preemption", [(100_000, "recompute"), (160, "recompute"), (160, "defer")])
@pytest.mark.parametrize("noise", ["exact", "10x short", "lognormal"])
def test_event_skipping_is_exact(blocks, preemption, noise):
    rng = random.Random(7)
    predict = {"exact": lambda it: it.output_len, "10x short": lambda it: max(1, it.output_len // 10),
               "lognormal": lambda it: max(1, round(it.output_len * rng.lognormvariate(0.0, 1.0)))}[noise]
    items = with_predictions(trace(60, seed=2), predict)
    _, stepwise = simulate(items, blocks, preemption, fast_forward=False)
    eng, skipped = simulate(items, blocks, preemption, fast_forward=True)
    assert fingerprint(skipped) == fingerprint(stepwise)


def test_a_replay_does_not_hand_the_policy_the_true_length():
    # The trace ends each answer like an EOS; max_tokens is the context left, so a prediction 10x
    # too long is not silently cut to the truth (it would be if max_tokens were the trace length).
    items = [PredictedItem("long-guess", 0.0, 30, 20, predicted_output_tokens=200),
             PredictedItem("other", 0.0, 30, 40, predicted_output_tokens=40)]
    eng = simulated_engine(SchedulerConfig(policy="srpt-predicted", max_batch_size=1, srpt_aging=0.0), COST,
                           kv_cache_blocks=1000)
    seen = {}
    step = eng.scheduler.policy.on_step

    def spy(ran, secs, now):
        for r in ran:
            seen.setdefault(r.request_id, eng.scheduler.policy.predicted.get(r.request_id))
        step(ran, secs, now)

    eng.scheduler.policy.on_step = spy
    reqs = replay(eng, items)
    assert [r.finish_reason for r in reqs] == ["stop", "stop"]
    assert [r.num_output_tokens for r in reqs] == [20, 40]
    assert reqs[0].params.max_tokens == eng.max_model_len - 30
    assert seen["long-guess"] == 200  # ranked by its own (wrong) prediction ...
    assert reqs[1].metrics.finish_time < reqs[0].metrics.finish_time  # ... so the 40-token job ran first
