"""`tokenslice profile`: a reduced grid on builtin:tiny writes a profile the simulator loads.

No timing thresholds: only that measurements exist, are positive, and flow into a usable model.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tokenslice.cli import main
from tokenslice.predict.fit import fit_relative
from tokenslice.sim.profile_timing import GridPoint, profile_grid, reduce_grid
from tokenslice.predict.cost import BatchShape, load_cost_model
from tokenslice.predict.profile import ProfileCostModel


def test_profile_builtin_tiny_loads_in_simulate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "profile.json"
    rc = main(["profile", "--model", "builtin:tiny", "--out", str(out), "--samples", "8", "--repeats", "1",
               "--max-batch-size", "4", "--max-context", "128", "--device", "cpu", "--quiet"])
    assert rc == 0
    assert "r^2" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert len(data["measurements"]) == data["samples"] == 8
    assert all(m["seconds"] > 0 for m in data["measurements"])
    assert {m["ops"] for m in data["transfer_measurements"]} > {1}  # one copy and many copies
    cost = load_cost_model(str(out))
    assert isinstance(cost, ProfileCostModel)
    assert cost.min_iteration_seconds() > 0
    assert cost.kv_bytes_per_token > 0 and cost.transfer.bytes_per_s > 0
    assert cost.r2 is not None

    # The profile drives the simulator; the default SLO comes from its decode time.
    res = tmp_path / "sim.json"
    assert main(["simulate", "--profile", str(out), "--workload", "synthetic-fixed", "--policy",
                 "fcfs,skip-join-mlfq", "--rates", "5", "--num-requests", "20", "--out", str(res), "--quiet"]) == 0
    sim = json.loads(res.read_text())
    assert sim["slo"]["mean_normalized_latency"] == pytest.approx(10 * cost.min_iteration_seconds())
    assert all(r["metrics"]["num_finished"] == 20 for r in sim["runs"])


def test_grid_covers_every_kind_and_reduces_evenly() -> None:
    grid = profile_grid(max_batch_size=8, max_context=512, max_tokens_per_step=2048)
    kinds = {p.kind for p in grid}
    assert kinds == {"prefill", "decode", "mixed"}
    assert all(max(p.total_tokens_per_seq()) < 512 for p in grid)  # room for the sampled token
    assert all(sum(q for q, _ in p.prefill) + len(p.decode) <= 2048 for p in grid)
    assert any(past > 0 for p in grid for _, past in p.prefill)  # chunked prefill over a cached prefix
    small = reduce_grid(grid, 10)
    assert len(small) == 10 and small[0] == grid[0] and small[-1] == grid[-1]
    assert {"prefill", "decode"} <= {p.kind for p in small}
    assert reduce_grid(grid, None) == grid
    with pytest.raises(ValueError):
        reduce_grid(grid, 3)


def test_fit_relative_recovers_a_linear_machine() -> None:
    """On exact linear data the relative fit returns the generating coefficients."""
    true = {"base": 1e-3, "prefill_tokens": 2e-5, "decode_seqs": 5e-5, "context_tokens": 3e-7,
            "prefill_context": 1e-8}
    points = profile_grid(max_batch_size=16, max_context=512, max_tokens_per_step=1024)
    shapes = [BatchShape.from_lengths(prefill=list(p.prefill), decode=list(p.decode)) for p in points]
    w = np.array(list(true.values()))
    samples = [(s, float(w @ [1, s.prefill_tokens, s.decode_seqs, s.context_tokens, s.prefill_context]))
               for s in shapes]
    cost = fit_relative(samples, kv_bytes_per_token=64)
    for k, v in true.items():
        assert cost.coefficients[k] == pytest.approx(v, rel=1e-4)
    assert cost.r2 == pytest.approx(1.0)
    assert GridPoint(decode=(4, 4)).kind == "decode"


def test_profile_records_tensor_parallel_degree(tmp_path: Path) -> None:
    """A profile of a tensor-parallel engine says so: `:tpN` in its name, kept through JSON."""
    points = profile_grid(max_batch_size=4, max_context=128, max_tokens_per_step=256)
    samples = [(BatchShape.from_lengths(prefill=list(p.prefill), decode=list(p.decode)), 1e-3 * (i + 1))
               for i, p in enumerate(points)]
    cost = fit_relative(samples, kv_bytes_per_token=64, model="stories260k", device="cuda", tensor_parallel=2)
    assert cost.tensor_parallel == 2 and cost.name == "stories260k@cuda:tp2"
    path = tmp_path / "tp2.json"
    cost.save(path)
    assert json.loads(path.read_text())["tensor_parallel"] == 2
    loaded = load_cost_model(str(path))
    assert isinstance(loaded, ProfileCostModel) and loaded.name == "stories260k@cuda:tp2"
    assert fit_relative(samples, kv_bytes_per_token=64, model="m", device="cpu").name == "m@cpu"


@pytest.mark.timeout(300)
def test_profile_tensor_parallel_stories260k(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`tokenslice profile -tp 2` times the grid on two worker processes and says so in the profile."""
    from conftest import STORIES

    out = tmp_path / "tp2.json"
    rc = main(["profile", "--model", str(STORIES), "-tp", "2", "--out", str(out), "--samples", "8", "--repeats", "1",
               "--max-batch-size", "4", "--max-context", "128", "--device", "cpu", "--dtype", "float32", "--quiet"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["tensor_parallel"] == 2
    assert len(data["measurements"]) == data["samples"] == 8
    assert all(m["seconds"] > 0 for m in data["measurements"])
    cost = load_cost_model(str(out))
    assert isinstance(cost, ProfileCostModel) and cost.name.endswith(":tp2")
    assert cost.min_iteration_seconds() > 0
    assert "over 2 tensor-parallel ranks" in capsys.readouterr().out
