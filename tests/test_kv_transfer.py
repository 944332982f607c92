"""KV swapping data plane: the transfer engine (model/transfer.py) and the runner's host tier
(model/runner.py) on a real tiny model (stories260k), sync and async, full precision and int8."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from conftest import STORIES
from tokenslice.config import CacheConfig, ModelConfig
from tokenslice.exec.local import LocalExecutor
from tokenslice.model.kv_quant import quantized_block_bytes
from tokenslice.model.loader import LoadedModel, load_model
from tokenslice.model.runner import ModelRunner, host_block_bytes, num_host_kv_blocks
from tokenslice.model.transfer import TransferEngine, TransferError
from tokenslice.plan import BlockTransfer, SeqSlice, StepPlan, copy_runs
from tokenslice.request import SamplingParams

GREEDY = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
BS = 4
PROMPT = [1, 403, 261, 380, 280, 301, 425, 273, 338]  # 9 tokens: 3 blocks, the last partial
STEPS = 14  # decode steps; the request ends with 9 + 14 tokens: 6 blocks


# ---- transfer engine ------------------------------------------------------------------------
def test_transfer_module_is_torch_free() -> None:
    code = "import sys, tokenslice.model.transfer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    assert out == "False"


def test_engine_reports_each_completion_once() -> None:
    with TransferEngine(num_threads=2) as eng:
        assert eng.wait_any(timeout=5) == []  # nothing pending: returns at once
        gate = threading.Event()
        eng.submit("slow", lambda: gate.wait(5))
        eng.submit("fast", lambda: None)
        assert eng.wait_any(timeout=5) == ["fast"]
        assert eng.pending() == 1
        assert eng.wait_any(timeout=0.05) == []  # timed out, nothing new
        gate.set()
        assert eng.wait_any(timeout=5) == ["slow"]
        assert eng.pending() == 0 and eng.poll() == []


def test_engine_runs_jobs_concurrently() -> None:
    """FastSwitch: several copies in flight at once (two jobs that only finish together)."""
    barrier = threading.Barrier(2, timeout=5)
    with TransferEngine(num_threads=2) as eng:
        eng.submit("a", barrier.wait)
        eng.submit("b", barrier.wait)
        got: list[str] = []
        while len(got) < 2:
            got += eng.wait_any(timeout=5)
    assert sorted(got) == ["a", "b"]


def test_engine_surfaces_job_exceptions_naming_the_request() -> None:
    def boom() -> None:
        raise ValueError("disk on fire")

    with TransferEngine(num_threads=1) as eng:
        eng.submit("ok-1", lambda: None)
        eng.submit("bad", boom)
        eng.submit("ok-2", lambda: None)
        while eng.pending():
            time.sleep(0.001)
        with pytest.raises(TransferError, match="'bad'.*disk on fire") as info:
            eng.poll()
        assert info.value.request_id == "bad" and isinstance(info.value.__cause__, ValueError)
        assert eng.poll() == ["ok-1", "ok-2"]  # the others are not lost
        assert eng.poll() == []


def test_engine_close_finishes_queued_jobs_and_joins() -> None:
    eng = TransferEngine(num_threads=2)
    ran: list[int] = []
    for i in range(6):
        eng.submit(f"r{i}", lambda i=i: (time.sleep(0.01), ran.append(i)))
    threads = list(eng._threads)
    eng.close()
    assert sorted(ran) == list(range(6))
    assert not any(t.is_alive() for t in threads)
    assert sorted(eng.poll()) == [f"r{i}" for i in range(6)]
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit("late", lambda: None)
    eng.close()  # idempotent


# ---- runner: a tiny real model ------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(ModelConfig(model=str(STORIES), device="cpu", dtype="float32"))


@dataclass
class Seq:
    rid: str
    table: list[int]
    tokens: list[int] = field(default_factory=lambda: list(PROMPT))
    computed: int = 0  # tokens whose KV is in the cache

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(PROMPT):]


def _slice(seq: Seq) -> SeqSlice:
    return SeqSlice(seq.rid, seq.tokens[seq.computed:], seq.computed, seq.table, True, GREEDY,
                    len(seq.generated))


def _step_plan(*seqs: Seq, **extra: object) -> StepPlan:
    plan = StepPlan(**extra)  # type: ignore[arg-type]
    for s in seqs:
        (plan.prefill if s.computed == 0 else plan.decode).append(_slice(s))
    return plan


def _advance(result_sampled: dict[str, int], *seqs: Seq) -> None:
    for s in seqs:
        s.computed = len(s.tokens)
        s.tokens.append(result_sampled[s.rid])


def _step(runner: ModelRunner, *seqs: Seq, **extra: object) -> list[str]:
    res = runner.execute(_step_plan(*seqs, **extra))
    _advance(res.sampled, *seqs)
    return res.transfers_done


def _run(runner: ModelRunner, seq: Seq, steps: int) -> None:
    for _ in range(steps):
        _step(runner, seq)


def _reference(loaded: LoadedModel) -> list[int]:
    r = ModelRunner(loaded, num_blocks=8, block_size=BS)
    seq = Seq("ref", list(range(6)))
    _run(r, seq, 1 + STEPS)
    return seq.generated


def _wait_for(runner: ModelRunner, rid: str, done: list[str]) -> list[str]:
    deadline = time.monotonic() + 10
    while rid not in done:
        assert time.monotonic() < deadline, f"transfer of {rid} never completed"
        done = done + runner.execute(StepPlan()).transfers_done
    return done


def test_sync_swap_round_trip_is_bit_identical(loaded: LoadedModel) -> None:
    expected = _reference(loaded)
    r = ModelRunner(loaded, num_blocks=16, block_size=BS, num_host_blocks=10)
    a = Seq("a", [0, 1, 2, 3, 4, 5])
    _run(r, a, 1 + 5)  # prefill, 5 decodes: 14 tokens of KV in 4 blocks
    kv_before = r.kv[:, :, a.table].clone()
    host = [9, 8, 2, 3, 4, 5]  # reversed then contiguous: several runs
    res = r.execute(StepPlan(swap_out=list(zip(a.table, host))))
    assert res.sampled == {} and res.transfer_seconds > 0 and res.step_seconds >= res.transfer_seconds
    assert r.copied_out_bytes == 6 * r.block_bytes and r.copy_calls == len(copy_runs(list(zip(a.table, host))))

    # Another request reuses the freed device blocks: real KV writes over them, then noise.
    b = Seq("b", [0, 1, 2, 3, 4, 5])
    b.tokens = [1, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]
    _run(r, b, 3)
    r.kv[:, :, a.table] = torch.randn_like(r.kv[:, :, a.table])

    a.table = [15, 14, 10, 11, 12, 13]  # different device blocks, again several runs
    r.execute(StepPlan(swap_in=list(zip(host, a.table))))
    assert torch.equal(r.kv[:, :, a.table], kv_before)
    assert r.copied_in_bytes == 6 * r.block_bytes
    _run(r, a, STEPS - 5)
    assert a.generated == expected


def test_one_plan_swaps_out_then_in_through_the_same_device_blocks(loaded: LoadedModel) -> None:
    """KVManager contract: a device block a swap-out frees may be the destination of a swap-in
    of the same plan, because the executor copies swap_out before swap_in."""
    expected = _reference(loaded)
    r = ModelRunner(loaded, num_blocks=6, block_size=BS, num_host_blocks=12)
    a, b = Seq("a", list(range(6))), Seq("b", list(range(6)))
    _run(r, a, 1 + 4)
    r.execute(StepPlan(swap_out=list(zip(a.table, range(6)))))  # a to host 0..5
    _run(r, b, 1 + 7)  # b uses the same device blocks
    plan = StepPlan(swap_out=list(zip(b.table, range(6, 12))), swap_in=list(zip(range(6), a.table)))
    res = r.execute(_step_plan(a, **vars(plan)))  # and a decodes right after, in the same step
    _advance(res.sampled, a)
    _run(r, a, STEPS - 5)
    assert a.generated == expected
    r.execute(StepPlan(swap_in=list(zip(range(6, 12), b.table))))
    _run(r, b, STEPS - 7)
    assert b.generated == expected


def test_async_transfers_overlap_compute_and_round_trip(loaded: LoadedModel) -> None:
    expected = _reference(loaded)
    r = ModelRunner(loaded, num_blocks=16, block_size=BS, num_host_blocks=8, transfer_threads=2)
    a, b = Seq("a", [0, 1, 2, 3, 4, 5]), Seq("b", [6, 7, 8, 9, 10, 11])
    _run(r, a, 1 + 6)
    _run(r, b, 1)
    kv_before = r.kv[:, :, a.table].clone()
    host = [2, 3, 4, 5, 6, 7]
    done = _step(r, b, async_transfers=[BlockTransfer("a", "out", list(zip(a.table, host)))])  # b decodes meanwhile
    _wait_for(r, "a", done)
    assert r.transfers_pending == 0
    r.kv[:, :, a.table] = torch.randn_like(r.kv[:, :, a.table])
    a.table = [12, 13, 14, 15, 0, 1]
    done = _step(r, b, async_transfers=[BlockTransfer("a", "in", list(zip(host, a.table)))])
    for _ in range(3):
        done += _step(r, b)
    _wait_for(r, "a", done)
    assert torch.equal(r.kv[:, :, a.table], kv_before)
    _run(r, a, STEPS - 6)
    _run(r, b, STEPS - 5)
    assert a.generated == expected and b.generated == expected
    assert r.copied_out_bytes == r.copied_in_bytes == 6 * r.block_bytes
    threads = list(r._engine._threads)  # type: ignore[union-attr]
    LocalExecutor(r).close()
    assert not any(t.is_alive() for t in threads)


def test_empty_plan_waits_for_a_pending_transfer_instead_of_spinning(loaded: LoadedModel) -> None:
    r = ModelRunner(loaded, num_blocks=4, block_size=BS, num_host_blocks=4)
    gate = threading.Event()
    real = r._copy_runs

    def slow_copy(*args: object) -> None:
        gate.wait(5)
        real(*args)  # type: ignore[arg-type]

    r._copy_runs = slow_copy  # type: ignore[method-assign]
    res = r.execute(StepPlan(async_transfers=[BlockTransfer("a", "out", [(0, 0), (1, 1)])]))
    assert res.transfers_done == [] and res.step_seconds >= r.idle_wait_s * 0.9
    threading.Timer(0.05, gate.set).start()
    r.idle_wait_s = 5
    res = r.execute(StepPlan())
    assert res.transfers_done == ["a"] and res.step_seconds < 4
    assert r.copy_calls == 1 and r.copied_out_bytes == 2 * r.block_bytes
    r.close()


def test_async_failure_is_raised_naming_the_request(loaded: LoadedModel) -> None:
    r = ModelRunner(loaded, num_blocks=4, block_size=BS, num_host_blocks=4)

    def broken(*_: object) -> None:
        raise RuntimeError("DMA fault")

    r._copy_runs = broken  # type: ignore[method-assign]
    with pytest.raises(TransferError, match="'victim'.*DMA fault"):
        r.execute(StepPlan(async_transfers=[BlockTransfer("victim", "in", [(0, 3)])]))
        for _ in range(100):
            r.execute(StepPlan())
    r.close()


def test_out_of_range_blocks_are_refused(loaded: LoadedModel) -> None:
    r = ModelRunner(loaded, num_blocks=4, block_size=BS, num_host_blocks=2)
    with pytest.raises(ValueError, match="out of range"):
        r.execute(StepPlan(swap_out=[(3, 2)]))
    with pytest.raises(ValueError, match="out of range"):
        r.execute(StepPlan(async_transfers=[BlockTransfer("a", "in", [(0, 4)])]))


def test_int8_offload_round_trip_within_one_step_per_channel(loaded: LoadedModel) -> None:
    r = ModelRunner(loaded, num_blocks=12, block_size=BS, num_host_blocks=6, offload_dtype="int8")
    a = Seq("a", [0, 1, 2, 3, 4, 5])
    _run(r, a, 1 + 8)
    before = r.kv[:, :, a.table].clone().double()
    done = r.execute(StepPlan(async_transfers=[BlockTransfer("a", "out", list(zip(a.table, range(6))))]))
    _wait_for(r, "a", done.transfers_done)
    a.table = [6, 7, 8, 9, 10, 11]
    r.execute(StepPlan(swap_in=list(zip(range(6), a.table))))
    after = r.kv[:, :, a.table].double()
    bound = ((before.amax(-3) - before.amin(-3)) / 255).unsqueeze(-3)
    assert ((after - before).abs() <= bound).all()
    assert not torch.equal(after, before)  # it really went through 8 bits
    per_block = quantized_block_bytes(5, BS, 4, 8, torch.float32)
    assert r.host_block_bytes == per_block < r.block_bytes
    assert r.copied_out_bytes == r.copied_in_bytes == 6 * per_block
    assert r.copy_calls == 3 + 3  # one run each way; codes, span, zero
    _run(r, a, 3)  # decoding goes on from the dequantized KV
    r.close()


def test_num_host_kv_blocks(loaded: LoadedModel) -> None:
    cache = CacheConfig(block_size=16, swap_space_gb=0.001)
    per = host_block_bytes(loaded.arch, 16, torch.float32)
    assert per == 16 * 5 * 2 * 4 * 8 * 4
    assert num_host_kv_blocks(cache, loaded) == int(0.001 * 2**30) // per
    cache.offload_dtype = "int8"
    assert num_host_kv_blocks(cache, loaded) == int(0.001 * 2**30) // quantized_block_bytes(5, 16, 4, 8, torch.float32)
    assert num_host_kv_blocks(CacheConfig(swap_space_gb=0.0), loaded) == 0
    explicit = CacheConfig(swap_space_gb=4.0)
    explicit.host_kv_blocks = 7  # type: ignore[attr-defined]
    assert num_host_kv_blocks(explicit, loaded) == 7
