"""The output-length predictor's history: every finished request's prompt embedding, prompt and
output lengths (and its text only when asked), in an embedded SQLite database (ALISE §3.1 keeps
such a store and updates it online). The database is created 0600; SQLite gives its -wal and -shm
files the database's mode.

SQLite is the source of truth: the vector index is rebuilt from it on load, so the two can never
disagree after a crash. WAL mode with synchronous=NORMAL makes each committed insert survive a
killed process (kill -9) — a half-written transaction is rolled back on the next open — while a
commit costs no fsync on the serving path (only an OS crash can lose the last few commits).
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PRIVATE_FILE_MODE = 0o600  # the predictor's files: readable by the serving user only

SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    prompt TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    output_len INTEGER NOT NULL,
    censored INTEGER NOT NULL,
    embedding BLOB NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass
class HistoryArrays:
    """The whole history as arrays, in insertion order (what the index and the regressor need)."""

    ids: np.ndarray  # int64 [n], the rows' ids (increasing)
    embeddings: np.ndarray  # float32 [n, dim]
    prompt_tokens: np.ndarray  # int64 [n]
    output_len: np.ndarray  # int64 [n]
    censored: np.ndarray  # bool [n]: output_len is a lower bound (cut off by max_tokens)

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class HistoryRow:
    """One record to insert."""

    prompt: str  # "" unless the predictor stores text
    prompt_tokens: int
    output_len: int
    censored: bool
    embedding: np.ndarray


class HistoryStore:
    """(prompt, embedding, output length, censored) rows in `path`, a SQLite file in WAL mode."""

    def __init__(self, path: str | Path, dim: int) -> None:
        self.path = Path(path)
        self.dim = dim
        # Created private before SQLite opens it (an existing file keeps the mode it has).
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE))
        # check_same_thread=False: the predictor serialises access with its own lock, and the
        # engine thread and the trainer thread both go through it.
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        stored = self.get_meta("dim")
        if stored is None:
            self.set_meta("dim", dim)
        elif int(stored) != dim:
            raise ValueError(f"history {self.path} holds {stored}-dimensional embeddings, the embedder gives {dim}")

    def add(self, rows: list[HistoryRow]) -> list[int]:
        """Insert rows in one transaction (all or none survive a crash); returns their ids."""
        ids = []
        now = time.time()
        with self._transaction():
            for r in rows:
                vec = np.ascontiguousarray(r.embedding, dtype=np.float32)
                if vec.shape != (self.dim,):
                    raise ValueError(f"embedding of shape {vec.shape}, expected ({self.dim},)")
                cur = self._db.execute(
                    "INSERT INTO records (prompt, prompt_tokens, output_len, censored, embedding, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (r.prompt, int(r.prompt_tokens), int(r.output_len), int(bool(r.censored)), vec.tobytes(), now))
                ids.append(int(cur.lastrowid))
        return ids

    def load(self, after_id: int = 0) -> HistoryArrays:
        """Rows with id > after_id, in id order."""
        rows = self._db.execute("SELECT id, prompt_tokens, output_len, censored, embedding FROM records "
                                "WHERE id > ? ORDER BY id", (after_id,)).fetchall()
        emb = np.frombuffer(b"".join(r[4] for r in rows), dtype=np.float32).reshape(len(rows), self.dim)
        return HistoryArrays(ids=np.array([r[0] for r in rows], dtype=np.int64), embeddings=emb.copy(),
                             prompt_tokens=np.array([r[1] for r in rows], dtype=np.int64),
                             output_len=np.array([r[2] for r in rows], dtype=np.int64),
                             censored=np.array([bool(r[3]) for r in rows], dtype=bool))

    def get_meta(self, key: str) -> Any:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def set_meta(self, key: str, value: Any) -> None:
        with self._transaction():
            self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def close(self) -> None:
        self._db.close()

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on an exception (autocommit connections need it
    spelled out to group several inserts)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
