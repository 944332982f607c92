"""(prompt, output length) examples from Alpaca or ShareGPT files, and a seeded train/test split,
for seeding and evaluating the output-length predictor.

Text extraction and token counting are the workloads' own (bench/datasets.py), so the predictor
learns the same lengths the simulator and benchmarks replay.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenslice.bench.datasets import DatasetCache

TURNS = ("first", "all")


@dataclass(frozen=True)
class LengthExample:
    prompt: str
    output_len: int  # tokens of the response under the chosen tokenizer
    group: str  # ShareGPT conversation id, or the Alpaca record's index: the unit of the split
    turn: int = 0


@dataclass
class Split:
    train: list[LengthExample]
    test: list[LengthExample]


def dataset_kind(path: str | Path) -> str:
    """"alpaca" ({instruction, input, output} records) or "sharegpt" ({id, conversations})."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise ValueError(f"dataset {str(path)!r} must be a non-empty JSON list of records")
    if "instruction" in data[0]:
        return "alpaca"
    if "conversations" in data[0]:
        return "sharegpt"
    raise ValueError(f"dataset {str(path)!r}: records have neither 'instruction' (Alpaca) nor "
                     "'conversations' (ShareGPT)")


def load_examples(path: str | Path, tokenizer: str | Path, turns: str = "first",
                  cache: DatasetCache | None = None) -> list[LengthExample]:
    """Every (prompt, output length) pair. ShareGPT: the first human->gpt pair of each
    conversation, or with turns="all" every pair (each turn's human message alone as the prompt)."""
    if turns not in TURNS:
        raise ValueError(f"turns must be one of {', '.join(TURNS)}, got {turns!r}")
    cache = cache or DatasetCache()
    kind = dataset_kind(path)
    if kind == "sharegpt" and turns == "all":
        return [LengthExample(r.prompt, r.output_len, r.conversation_id or str(i), r.turn)
                for i, conv in enumerate(cache.conversation_records(path, tokenizer)) for r in conv]
    return [LengthExample(r.prompt, r.output_len, r.conversation_id or str(i), 0)
            for i, r in enumerate(cache.records(kind, path, tokenizer))]


def split_examples(examples: list[LengthExample], test_size: int, seed: int = 0) -> Split:
    """Hold out `test_size` groups (conversations, or Alpaca records) drawn with `seed`.

    Test examples are the held-out groups' first turns; training examples are every example of
    the other groups, so no conversation contributes to both sides.
    """
    groups = list(dict.fromkeys(e.group for e in examples))
    if not 0 < test_size < len(groups):
        raise ValueError(f"test size must be in [1, {len(groups) - 1}] for {len(groups)} groups, got {test_size}")
    order = np.random.default_rng(seed).permutation(len(groups))
    test_groups = {groups[i] for i in order[:test_size]}
    return Split(train=[e for e in examples if e.group not in test_groups],
                 test=[e for e in examples if e.group in test_groups and e.turn == 0])


def select(examples: list[LengthExample], part: str, test_size: int | None, seed: int) -> list[LengthExample]:
    """part "all", or "train"/"test" of `split_examples(examples, test_size, seed)`."""
    if part == "all":
        return examples
    if part not in ("train", "test"):
        raise ValueError(f"split must be all, train or test, got {part!r}")
    if test_size is None:
        raise ValueError("--split train/test needs --test-size")
    halves = split_examples(examples, test_size, seed)
    return halves.train if part == "train" else halves.test
