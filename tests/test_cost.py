"""CostModel: calibration, roofline shape, fitted profiles, load/save (tokenslice/predict/cost.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenslice.predict.cost import BatchShape, CostModel, TransferSpec, load_cost_model
from tokenslice.predict.fit import fit_profile, fit_transfer, nnls
from tokenslice.predict.profile import PROFILE_FEATURES, ProfileCostModel, profile_features
from tokenslice.predict.roofline import RooflineCostModel
from tokenslice.predict.specs import HARDWARE_SPECS, MODEL_SPECS, known_cost_models


def test_calibration_opt13b_a100_40gb() -> None:
    # Reference values the project's targets quote: ~23 ms decode at batch 1, ~80 ms lone 512 prefill.
    cm = load_cost_model("opt-13b@a100-40gb")
    assert cm.min_iteration_seconds() == pytest.approx(0.023, rel=0.15)
    assert cm.decode_seconds(1, 64) == pytest.approx(0.023, rel=0.15)
    assert cm.first_iteration_seconds(512) == pytest.approx(0.080, rel=0.15)


@pytest.mark.parametrize("name", sorted(MODEL_SPECS))
def test_model_specs_match_published_param_counts(name: str) -> None:
    spec = MODEL_SPECS[name]
    assert spec.derived_params == pytest.approx(spec.num_params, rel=0.02)
    assert spec.num_heads * spec.head_dim == spec.hidden_size


def test_kv_bytes_per_token() -> None:
    assert load_cost_model("opt-13b@a100-40gb").kv_bytes_per_token == 2 * 40 * 5120 * 2
    # GQA: llama-3-8b keeps 8 of 32 heads in the cache.
    assert load_cost_model("llama-3-8b@h100").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


@pytest.mark.parametrize("spec", known_cost_models())
def test_every_builtin_is_monotone_and_sane(spec: str) -> None:
    cm = load_cost_model(spec)
    assert cm.iteration_seconds(BatchShape()) == 0.0
    q1 = cm.min_iteration_seconds()
    assert 1e-3 < q1 < 2.0
    # More work never takes less time.
    assert cm.decode_seconds(8, 512) >= cm.decode_seconds(1, 512) >= q1
    assert cm.decode_seconds(8, 2048) >= cm.decode_seconds(8, 512)
    assert cm.first_iteration_seconds(1024) > cm.first_iteration_seconds(512) > cm.first_iteration_seconds(16)
    # Decode is memory-bound: batching 8 costs far less than 8 separate steps.
    assert cm.decode_seconds(8, 128) < 2 * cm.decode_seconds(1, 128)


def test_hardware_ordering() -> None:
    # Faster memory -> faster decode; more FLOPs -> faster prefill.
    d = {h: load_cost_model(f"opt-13b@{h}") for h in HARDWARE_SPECS}
    assert d["h100"].min_iteration_seconds() < d["a100-80gb"].min_iteration_seconds() \
        < d["a100-40gb"].min_iteration_seconds() < d["v100"].min_iteration_seconds() < d["a10"].min_iteration_seconds()
    assert d["h100"].first_iteration_seconds(512) < d["a100-40gb"].first_iteration_seconds(512) \
        < d["v100"].first_iteration_seconds(512)


def test_prefill_attention_grows_quadratically() -> None:
    cm = load_cost_model("opt-13b@a100-40gb")
    small = BatchShape.from_lengths(prefill=[(512, 0)])
    assert small.prefill_context == 512 * 513 // 2
    # A chunk with a long cached prefix attends more pairs than the same chunk with none.
    chunk_late = BatchShape.from_lengths(prefill=[(512, 1536)])
    assert chunk_late.prefill_context == 512 * 1536 + 512 * 513 // 2
    assert cm.iteration_seconds(chunk_late) > cm.iteration_seconds(small)


def test_from_lengths_mixed_batch() -> None:
    s = BatchShape.from_lengths(prefill=[(10, 0), (5, 20)], decode=[100, 7])
    assert (s.prefill_tokens, s.prefill_seqs, s.decode_seqs) == (15, 2, 2)
    assert s.context_tokens == 10 + 25 + 100 + 7
    assert s.num_tokens == 17 and s.num_seqs == 4


def test_transfer_seconds() -> None:
    cm = load_cost_model("opt-13b@a100-40gb")
    hw = HARDWARE_SPECS["a100-40gb"]
    assert cm.transfer_seconds(0, 0) == 0.0
    one_gb = cm.transfer_seconds(10**9, 1)
    assert one_gb == pytest.approx(1e9 / hw.host_link_bandwidth + hw.transfer_op_overhead_s)
    # Same bytes in many small copies costs more: the reason FastSwitch groups blocks.
    assert cm.transfer_seconds(10**9, 1000) > one_gb
    assert cm.kv_transfer_seconds(100, 1) == cm.transfer_seconds(100 * cm.kv_bytes_per_token, 1)


def test_tensor_parallel_speeds_up_and_splits_memory() -> None:
    one = load_cost_model("opt-66b@a100-80gb")
    four = load_cost_model("opt-66b@a100-80gb:tp4")
    assert isinstance(four, RooflineCostModel) and four.tensor_parallel == 4
    assert four.name == "opt-66b@a100-80gb:tp4"
    assert four.min_iteration_seconds() < one.min_iteration_seconds()
    # Not perfectly linear: the all-reduce and launches do not shrink.
    assert four.min_iteration_seconds() > one.min_iteration_seconds() / 4
    assert one.kv_capacity_tokens() == 0  # 131 GB of weights do not fit in 80 GB
    assert four.kv_capacity_tokens() > 10_000


def test_load_errors_list_known_names() -> None:
    with pytest.raises(ValueError, match="opt-13b") as e:
        load_cost_model("gpt-5@a100-40gb")
    assert "a100-40gb" in str(e.value)
    with pytest.raises(ValueError, match="unknown hardware"):
        load_cost_model("opt-13b@tpu")
    with pytest.raises(ValueError, match="model@hardware"):
        load_cost_model("opt-13b")
    with pytest.raises(ValueError, match="does not exist"):
        load_cost_model("/nonexistent/profile.json")
    with pytest.raises(ValueError, match="tensor-parallel"):
        load_cost_model("opt-13b@a100-40gb:tpx")
    assert load_cost_model("OPT-13B@A100-40GB").name == "opt-13b@a100-40gb"


def test_roofline_round_trip(tmp_path: Path) -> None:
    cm = load_cost_model("llama-3-8b@h100:tp2")
    path = tmp_path / "roof.json"
    cm.save(path)
    back = load_cost_model(str(path))
    assert isinstance(back, RooflineCostModel)
    assert back.to_dict() == cm.to_dict()
    shape = BatchShape.from_lengths(prefill=[(100, 0)], decode=[300] * 5)
    assert back.iteration_seconds(shape) == cm.iteration_seconds(shape)


def _synthetic_samples(coef: np.ndarray, n: int, seed: int, noise: float = 0.0) -> list[tuple[BatchShape, float]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prefill = [(int(rng.integers(1, 600)), int(rng.integers(0, 300))) for _ in range(rng.integers(0, 3))]
        decode = [int(x) for x in rng.integers(1, 2000, size=rng.integers(0, 40))]
        if not prefill and not decode:
            decode = [10]
        shape = BatchShape.from_lengths(prefill, decode)
        secs = float(np.dot(coef, profile_features(shape)))
        out.append((shape, secs * (1 + noise * rng.standard_normal())))
    return out


def test_fit_profile_recovers_known_coefficients() -> None:
    true = np.array([0.02, 1.2e-4, 3e-4, 2e-7, 5e-9, 1e-3, 2e-3, 5e-4])
    samples = _synthetic_samples(true, 200, seed=0)
    cm = fit_profile(samples, kv_bytes_per_token=1024, model="m", device="d")
    got = np.array([cm.coefficients[k] for k in PROFILE_FEATURES])
    np.testing.assert_allclose(got, true, rtol=1e-6)
    assert cm.r2 == pytest.approx(1.0)
    assert cm.samples == 200


def test_fit_profile_with_noise_and_zero_coefficient_stays_non_negative() -> None:
    true = np.array([0.015, 1e-4, 0.0, 3e-7, 0.0, 0.0, 1e-3, 0.0])  # e.g. decode sequences add nothing
    cm = fit_profile(_synthetic_samples(true, 300, seed=1, noise=0.02), kv_bytes_per_token=1)
    got = np.array([cm.coefficients[k] for k in PROFILE_FEATURES])
    assert (got >= 0).all()
    assert got[0] == pytest.approx(true[0], rel=0.1)
    assert got[1] == pytest.approx(true[1], rel=0.1)
    assert cm.r2 > 0.9


def test_fit_profile_rejects_too_few_samples() -> None:
    with pytest.raises(ValueError, match="at least"):
        fit_profile([(BatchShape(decode_seqs=1, context_tokens=1), 0.01)], kv_bytes_per_token=1)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=3, max_size=3), st.integers(0, 10_000))
def test_nnls_matches_unconstrained_when_feasible_and_is_non_negative(x_true: list[float], seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((20, 3))
    b = a @ np.array(x_true)
    x = nnls(a, b)
    assert (x >= 0).all()
    if min(x_true) > 1e-3:
        np.testing.assert_allclose(x, x_true, atol=1e-6)
    # KKT: the gradient is ~0 on positive entries and points outward on zero entries.
    g = a.T @ (a @ x - b)
    scale = 1e-6 * (1 + np.abs(a.T @ b).max())
    assert (np.abs(g[x > 0]) < scale).all()
    assert (g[x == 0] > -scale).all()


def test_fit_transfer() -> None:
    truth = TransferSpec(bytes_per_s=20e9, op_overhead_s=15e-6)
    samples = [(nb, ops, truth.seconds(nb, ops)) for nb in (1 << 20, 1 << 24, 1 << 28) for ops in (1, 16, 256)]
    fit = fit_transfer(samples)
    assert fit.bytes_per_s == pytest.approx(20e9, rel=1e-6)
    assert fit.op_overhead_s == pytest.approx(15e-6, rel=1e-6)


def test_profile_save_load_round_trip(tmp_path: Path) -> None:
    true = np.array([0.02, 1.2e-4, 3e-4, 2e-7, 5e-9, 1e-3, 2e-3, 5e-4])
    transfer_samples = [(nb, ops, 1e-5 * ops + nb / 12e9) for nb in (1 << 20, 1 << 26) for ops in (1, 64)]
    cm = fit_profile(_synthetic_samples(true, 50, seed=2), kv_bytes_per_token=819200, transfer=transfer_samples,
                     model="opt-13b", device="cuda:NVIDIA A100")
    path = tmp_path / "profile.json"
    cm.save(path)
    data = json.loads(path.read_text())
    assert data["kind"] == "profile"
    assert set(data) >= {"kind", "model", "device", "coefficients", "transfer", "kv_bytes_per_token", "samples", "r2"}
    assert set(data["coefficients"]) == set(PROFILE_FEATURES)
    back = load_cost_model(str(path))
    assert isinstance(back, ProfileCostModel)
    assert back.to_dict() == cm.to_dict()
    assert back.name == "opt-13b@cuda:NVIDIA A100"
    assert back.transfer.bytes_per_s == pytest.approx(12e9, rel=1e-6)
    shape = BatchShape.from_lengths(prefill=[(64, 0)], decode=[100, 200])
    assert back.iteration_seconds(shape) == pytest.approx(cm.iteration_seconds(shape))
    assert back.first_iteration_seconds(512) > back.min_iteration_seconds() > 0
    assert CostModel.from_dict(data).to_dict() == data
    with pytest.raises(ValueError, match="kind"):
        CostModel.from_dict({"kind": "magic"})


def test_profile_without_group_terms_still_loads() -> None:
    """Profiles written before the per-group terms existed load with those terms at zero."""
    old = {"kind": "profile", "model": "m", "device": "d", "kv_bytes_per_token": 8,
           "coefficients": {"base": 1e-3, "prefill_tokens": 1e-5, "decode_seqs": 1e-5, "context_tokens": 1e-8,
                            "prefill_context": 1e-9},
           "transfer": {"bytes_per_s": 1e10, "op_overhead_s": 1e-5}}
    cm = CostModel.from_dict(old)
    assert cm.coefficients["has_prefill"] == 0.0
    assert cm.iteration_seconds(BatchShape.from_lengths(decode=[10])) == pytest.approx(1e-3 + 1e-5 + 1e-7)


@pytest.mark.parametrize("spec", ["llama-8b@a10-24gb", "qwen-32b@a100-80gb"])
def test_fastswitch_profiles(spec: str) -> None:
    cm = load_cost_model(spec)
    assert cm.name == spec
    assert cm.kv_capacity_tokens() > 0  # the weights fit with room for KV
    # GQA with 8 KV heads of 128 in fp16, per layer K and V.
    layers = {"llama-8b": 32, "qwen-32b": 64}[spec.split("@")[0]]
    assert cm.kv_bytes_per_token == 2 * layers * 8 * 128 * 2


def test_fastswitch_a10_host_link() -> None:
    # PCIe 4.0 x16 at 32 GB/s and 10 us per copy call: one 1 MiB copy vs sixteen 64 KiB copies.
    cm = load_cost_model("llama-8b@a10-24gb")
    assert cm.transfer_seconds(1 << 20, 1) == pytest.approx(10e-6 + (1 << 20) / 32e9)
    assert cm.transfer_seconds(1 << 20, 16) == pytest.approx(16 * 10e-6 + (1 << 20) / 32e9)
    assert MODEL_SPECS["llama-8b"].derived_params == MODEL_SPECS["llama-3-8b"].derived_params


def test_tensor_parallel_communication() -> None:
    """Megatron-style TP collectives: none at tp1, more with more tokens, slower over PCIe."""
    one = load_cost_model("opt-66b@a100-80gb")
    nvlink = load_cost_model("opt-66b@a100-40gb:tp4")
    pcie = load_cost_model("opt-66b@a100-40gb:tp4:pcie")
    assert isinstance(one, RooflineCostModel) and isinstance(nvlink, RooflineCostModel)
    assert isinstance(pcie, RooflineCostModel)
    assert one.tp_comm_seconds(512, 1) == 0.0
    assert nvlink.link == "nvlink" and pcie.link == "pcie"
    assert pcie.name == "opt-66b@a100-40gb:tp4:pcie" and nvlink.name == "opt-66b@a100-40gb:tp4"
    assert load_cost_model("opt-66b@a100-40gb:tp4:nvlink").name == nvlink.name
    small, large = nvlink.tp_comm_seconds(16, 1), nvlink.tp_comm_seconds(2048, 1)
    assert 0.0 < small < large
    # The LM head gathers one logits row per sampled sequence.
    assert nvlink.tp_comm_seconds(16, 16) > small
    for tokens in (1, 512):
        assert pcie.tp_comm_seconds(tokens, 1) > nvlink.tp_comm_seconds(tokens, 1)
    prefill = BatchShape.from_lengths(prefill=[(512, 0)])
    assert pcie.iteration_seconds(prefill) - nvlink.iteration_seconds(prefill) == pytest.approx(
        pcie.tp_comm_seconds(512, 1) - nvlink.tp_comm_seconds(512, 1))
    # Ring all-reduce of 2048 tokens x 9216 fp16 activations, 129 times (64 layers x 2 + the embedding).
    hw = HARDWARE_SPECS["a100-40gb"]
    act = 2048 * 9216 * 2
    expected = 129 * (hw.allreduce_latency_s + 2 * 3 / 4 * act / hw.interconnect_bandwidth)
    assert large - (hw.allreduce_latency_s + 3 / 4 * 50272 * 2 / hw.interconnect_bandwidth) == pytest.approx(expected)
    assert CostModel.from_dict(pcie.to_dict()).name == pcie.name


def test_link_names_are_checked() -> None:
    assert load_cost_model("opt-13b@a10:tp2").link == "pcie"  # no NVLink on an A10
    with pytest.raises(ValueError, match="no NVLink"):
        load_cost_model("opt-13b@a10:tp2:nvlink")
    with pytest.raises(ValueError, match=":pcie"):
        load_cost_model("opt-13b@a100-40gb:tp2:infiniband")


def test_fastserve_fig11b_setting_fits() -> None:
    """OPT-66B on 4 x A100-40GB (FastServe Fig. 11b): the weight shard and some KV fit each GPU."""
    cost = load_cost_model("opt-66b@a100-40gb:tp4")
    assert isinstance(cost, RooflineCostModel)
    cost.check_fits()
    assert cost.weight_bytes_per_gpu() < 0.9 * 40e9
    assert cost.kv_capacity_tokens() > 2048  # the longest request the length filter keeps
    with pytest.raises(ValueError, match=r"does not fit.*:tp4"):
        load_cost_model("opt-66b@a100-40gb:tp2").check_fits()


def test_simulator_refuses_model_that_does_not_fit() -> None:
    from tokenslice.config import SchedulerConfig
    from tokenslice.sim.engine import simulated_engine

    with pytest.raises(ValueError, match="opt-66b@a100-40gb does not fit"):
        simulated_engine(SchedulerConfig(policy="fcfs"), load_cost_model("opt-66b@a100-40gb"), kv_cache_blocks=64)
    simulated_engine(SchedulerConfig(policy="fcfs"), load_cost_model("opt-66b@a100-40gb:tp4"), kv_cache_blocks=64)


def test_pipeline_stages_split_layers_and_cross_nodes() -> None:
    """:ppM: each stage computes its share of the layers; the batch crosses M-1 stage boundaries,
    over the node network when the stages do not fit one server (FastServe's 2 x p4d)."""
    pp = load_cost_model("opt-175b@a100-40gb:tp8:pp2")
    assert isinstance(pp, RooflineCostModel)
    assert pp.name == "opt-175b@a100-40gb:tp8:pp2" and pp.pipeline_parallel == 2 and pp.num_gpus == 16
    assert CostModel.from_dict(pp.to_dict()).name == pp.name
    hw = HARDWARE_SPECS["a100-40gb"]
    tokens = 512
    assert pp.p2p_seconds(tokens) == pytest.approx(hw.node_link_latency_s + tokens * 12288 * 2 / hw.node_link_bandwidth)
    for shape in (BatchShape.from_lengths(prefill=[(tokens, 0)]), BatchShape.from_lengths(decode=[600] * 16)):
        stages = pp.stage_seconds(shape)
        assert len(stages) == 2 and all(s > 0 for s in stages)
        assert pp.iteration_seconds(shape) == pytest.approx(sum(stages) + pp.p2p_seconds(shape.num_tokens))
        # The same TP group computing every layer: what the stages add up to, less the send.
        one = RooflineCostModel(pp.model, hw, 8).iteration_seconds(shape)
        assert sum(stages) == pytest.approx(one)
        assert max(stages) < 0.6 * one
    assert pp.stage_seconds(BatchShape()) == [0.0, 0.0] and pp.iteration_seconds(BatchShape()) == 0.0
    # Four stages inside one 8-GPU node send over NVLink: cheaper than the network.
    inside = load_cost_model("opt-66b@a100-40gb:tp2:pp4")
    assert inside.p2p_seconds(tokens) == pytest.approx(hw.allreduce_latency_s + tokens * 9216 * 2 / hw.interconnect_bandwidth)
    # Uneven split: the first stages take one layer more.
    three = load_cost_model("opt-66b@a100-40gb:tp2:pp3")
    shape = BatchShape.from_lengths(decode=[100])
    first, middle, last = three.stage_seconds(shape)
    assert first > middle  # 22 layers and the embedding's all-reduce against 21 layers
    assert load_cost_model("opt-66b@a100-40gb:pp1").name == "opt-66b@a100-40gb"


def test_pipeline_fit_check_divides_weights_over_all_gpus() -> None:
    """Weights per GPU = total / (TP x PP); the hint names the TP x PP that fits."""
    eight = load_cost_model("opt-175b@a100-40gb:tp8")
    sixteen = load_cost_model("opt-175b@a100-40gb:tp8:pp2")
    assert isinstance(eight, RooflineCostModel) and isinstance(sixteen, RooflineCostModel)
    assert sixteen.weight_bytes_per_gpu() == pytest.approx(eight.weight_bytes_per_gpu() / 2)
    with pytest.raises(ValueError, match=r"does not fit.*opt-175b@a100-40gb:tp8:pp2"):
        eight.check_fits()
    sixteen.check_fits()
    assert sixteen.kv_capacity_tokens() > 2048
    # Swaps: every GPU of every stage copies its own shard over its own host link.
    assert sixteen.transfer.bytes_per_s == pytest.approx(16 * HARDWARE_SPECS["a100-40gb"].host_link_bandwidth)
    with pytest.raises(ValueError, match="pipeline_parallel"):
        load_cost_model("opt-13b@a100-40gb:pp41")
    with pytest.raises(ValueError, match=":ppM"):
        load_cost_model("opt-13b@a100-40gb:pp")
