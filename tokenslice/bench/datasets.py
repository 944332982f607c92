"""Dataset workloads: Alpaca and ShareGPT records, their token counts, and the vLLM length filter
(docs/DESIGN.md, "Benchmark protocols").

Alpaca is a JSON list of `{instruction, input, output}`, ShareGPT of `{id, conversations}`. Token
counts come from a local Hugging Face tokenizer and are cached in a `DatasetCache` object (in
memory only). No torch here.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# File names looked for when --dataset names a directory rather than a file.
DEFAULT_DATASET_FILES: dict[str, tuple[str, ...]] = {
    "alpaca": ("alpaca_4500.json", "alpaca_data.json", "alpaca.json"),
    "sharegpt": ("sharegpt_multiturn_800.json", "ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt.json"),
}

# vLLM's benchmark filter: drop degenerate and over-long pairs so every request fits a 2k context.
FILTER_MIN_LEN = 4
FILTER_MAX_PROMPT = 1024
FILTER_MAX_TOTAL = 2048


@dataclass(frozen=True)
class DatasetRecord:
    """One (prompt, response) pair with its token counts under some tokenizer."""

    prompt: str
    prompt_len: int
    output_len: int
    prompt_token_ids: tuple[int, ...] = ()
    conversation_id: str | None = None
    turn: int = 0


@dataclass(frozen=True)
class Conversation:
    """A multi-turn ShareGPT conversation: (human, gpt) text pairs in order."""

    conversation_id: str
    turns: tuple[tuple[str, str], ...]


# ---------------------------------------------------------------- dataset text extraction

def alpaca_pairs(records: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(prompt, response): instruction + "\\n" + input when input is non-empty, else instruction."""
    out = []
    for r in records:
        inp = r.get("input") or ""
        prompt = f"{r['instruction']}\n{inp}" if inp else r["instruction"]
        out.append((prompt, r.get("output") or ""))
    return out


def sharegpt_turns(record: dict[str, Any]) -> list[tuple[str, str]]:
    """(human, gpt) pairs in order, after skipping leading non-human turns (some records open with
    a gpt or system turn). A human turn not followed by a gpt turn is dropped."""
    conv = record.get("conversations") or []
    i = 0
    while i < len(conv) and conv[i].get("from") != "human":
        i += 1
    pairs = []
    while i + 1 < len(conv):
        if conv[i].get("from") == "human" and conv[i + 1].get("from") == "gpt":
            pairs.append((conv[i]["value"], conv[i + 1]["value"]))
            i += 2
        else:
            i += 1
    return pairs


def sharegpt_first_pair(record: dict[str, Any]) -> tuple[str, str] | None:
    """The first human->gpt pair after leading non-human turns, or None (record skipped)."""
    conv = record.get("conversations") or []
    i = 0
    while i < len(conv) and conv[i].get("from") != "human":
        i += 1
    if i + 1 < len(conv) and conv[i + 1].get("from") == "gpt":
        return conv[i]["value"], conv[i + 1]["value"]
    return None


def load_conversations(path: str | Path) -> list[Conversation]:
    """Every ShareGPT conversation with at least one (human, gpt) pair."""
    out = []
    for i, rec in enumerate(_read_json_list(path)):
        turns = sharegpt_turns(rec)
        if turns:
            out.append(Conversation(str(rec.get("id", i)), tuple(turns)))
    return out


def _read_json_list(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file {str(p)!r} does not exist")
    data = json.loads(p.read_text())
    if not isinstance(data, list):
        raise ValueError(f"dataset {str(p)!r} must be a JSON list of records")
    return data


# ---------------------------------------------------------------- tokenized, cached datasets

class DatasetCache:
    """Tokenizers and tokenized datasets, kept in memory per (dataset file, tokenizer directory).

    An object rather than module state, so that callers decide its lifetime (a test session, one
    benchmark sweep); pass the same one to repeated `make_workload` calls to tokenize once.
    """

    def __init__(self) -> None:
        self._tokenizers: dict[str, Any] = {}
        self._records: dict[tuple[str, str, str, float], list[DatasetRecord]] = {}
        self._turns: dict[tuple[str, str, float], list[list[DatasetRecord]]] = {}

    def tokenizer(self, path: str | Path) -> Any:
        """A tokenizer directory's, or a known model's or GGUF file's (the one it carries)."""
        from tokenslice.model.known_models import known_model

        key = str(path) if known_model(str(path)) is not None else str(Path(path).resolve())
        if key not in self._tokenizers:
            from tokenslice.model.loader import load_tokenizer  # heavy imports: only when a dataset is tokenized

            tok = load_tokenizer(key)
            tok.model_max_length = 1 << 62  # we count tokens, never feed a model: silence length warnings
            self._tokenizers[key] = tok
        return self._tokenizers[key]

    def _encode(self, tokenizer: str | Path, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        # One batch call: the Rust tokenizer parallelises it (4,500 Alpaca records in well under a second).
        return self.tokenizer(tokenizer)(texts, add_special_tokens=False)["input_ids"]

    def _pairs_to_records(self, pairs: list[tuple[str, str]], tokenizer: str | Path,
                          ids: list[str | None], turns: list[int]) -> list[DatasetRecord]:
        prompts = self._encode(tokenizer, [p for p, _ in pairs])
        outputs = self._encode(tokenizer, [o for _, o in pairs])
        return [DatasetRecord(prompt=p, prompt_len=len(pi), output_len=len(oi), prompt_token_ids=tuple(pi),
                              conversation_id=cid, turn=t)
                for (p, _), pi, oi, cid, t in zip(pairs, prompts, outputs, ids, turns)]

    def records(self, kind: str, path: str | Path, tokenizer: str | Path) -> list[DatasetRecord]:
        """Tokenized prompt/response pairs: kind "alpaca", or "sharegpt" (first pair per conversation)."""
        p = Path(path).resolve()
        key = (kind, str(p), str(Path(tokenizer).resolve()), p.stat().st_mtime if p.exists() else 0.0)
        if key not in self._records:
            raw = _read_json_list(p)
            if kind == "alpaca":
                pairs = alpaca_pairs(raw)
                ids: list[str | None] = [None] * len(pairs)
            elif kind == "sharegpt":
                found = [(str(r.get("id", i)), sharegpt_first_pair(r)) for i, r in enumerate(raw)]
                kept = [(cid, pair) for cid, pair in found if pair is not None]
                if not kept:
                    raise ValueError(f"{str(p)!r} has no human->gpt pair "
                                     "(prompt-only files cannot give output lengths)")
                ids = [cid for cid, _ in kept]
                pairs = [pair for _, pair in kept]
            else:
                raise ValueError(f"unknown dataset kind {kind!r}; expected alpaca or sharegpt")
            self._records[key] = self._pairs_to_records(pairs, tokenizer, ids, [0] * len(pairs))
        return self._records[key]

    def conversation_records(self, path: str | Path, tokenizer: str | Path) -> list[list[DatasetRecord]]:
        """Per conversation, one record per (human, gpt) turn. prompt_len counts the human turn
        alone: a multi-turn client prepends the history itself."""
        p = Path(path).resolve()
        key = (str(p), str(Path(tokenizer).resolve()), p.stat().st_mtime if p.exists() else 0.0)
        if key not in self._turns:
            convs = load_conversations(p)
            flat = [(c.conversation_id, t, pair) for c in convs for t, pair in enumerate(c.turns)]
            recs = self._pairs_to_records([x[2] for x in flat], tokenizer, [x[0] for x in flat],
                                          [x[1] for x in flat])
            grouped: list[list[DatasetRecord]] = []
            for rec in recs:
                if rec.turn == 0:
                    grouped.append([])
                grouped[-1].append(rec)
            self._turns[key] = grouped
        return self._turns[key]


def load_alpaca(path: str | Path, tokenizer: str | Path, cache: DatasetCache | None = None) -> list[DatasetRecord]:
    return (cache or DatasetCache()).records("alpaca", path, tokenizer)


def load_sharegpt(path: str | Path, tokenizer: str | Path, cache: DatasetCache | None = None) -> list[DatasetRecord]:
    return (cache or DatasetCache()).records("sharegpt", path, tokenizer)


def filter_lengths(records: Sequence[DatasetRecord], min_len: int = FILTER_MIN_LEN,
                   max_prompt: int = FILTER_MAX_PROMPT, max_total: int = FILTER_MAX_TOTAL) -> list[DatasetRecord]:
    """vLLM's benchmark filter: drop prompt or output < min_len, prompt > max_prompt,
    prompt + output > max_total."""
    return [r for r in records if r.prompt_len >= min_len and r.output_len >= min_len
            and r.prompt_len <= max_prompt and r.prompt_len + r.output_len <= max_total]


def resolve_dataset(kind: str, dataset: str | Path | None) -> Path:
    """The dataset file: `dataset` itself, or a default file name inside a `dataset` directory."""
    if dataset is None:
        raise ValueError(f"workload needs a dataset path (--dataset FILE or DIRECTORY); looked for "
                         f"{', '.join(DEFAULT_DATASET_FILES[kind])} in a directory")
    p = Path(dataset)
    if p.is_dir():
        for name in DEFAULT_DATASET_FILES[kind]:
            if (p / name).is_file():
                return p / name
        raise ValueError(f"no {kind} dataset in {str(p)!r}; expected one of {', '.join(DEFAULT_DATASET_FILES[kind])}")
    if not p.is_file():
        raise ValueError(f"dataset {str(p)!r} does not exist")
    return p


__all__ = ["DEFAULT_DATASET_FILES", "FILTER_MIN_LEN", "FILTER_MAX_PROMPT", "FILTER_MAX_TOTAL", "DatasetRecord",
           "Conversation", "DatasetCache", "alpaca_pairs", "sharegpt_turns", "sharegpt_first_pair",
           "load_conversations", "load_alpaca", "load_sharegpt", "filter_lengths", "resolve_dataset"]
