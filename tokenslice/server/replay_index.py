"""An index of a `simulate --record-state` recording (JSON lines, bench/record_state.py), so that
`tokenslice view` serves a paper-scale file (hundreds of MB) page by page: each run's snapshots
with their byte ranges and times, and the few numbers per snapshot the page's history line needs.
Built in one pass that decodes only those fields (msgspec skips the rest)."""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec


class _Pool(msgspec.Struct):
    used: int = 0


class _KV(msgspec.Struct):
    host: _Pool = msgspec.field(default_factory=_Pool)
    transfers_in_flight: int = 0


class _Head(msgspec.Struct):
    """The fields of one snapshot line the index keeps; every other field is skipped unread."""
    t: float
    run: dict[str, Any] = msgspec.field(default_factory=dict)
    kv: _KV = msgspec.field(default_factory=_KV)


@dataclass
class RunIndex:
    labels: dict[str, Any]
    offsets: list[int] = field(default_factory=list)  # byte offset of each snapshot's line
    lengths: list[int] = field(default_factory=list)  # its length in bytes, newline included
    times: list[float] = field(default_factory=list)  # simulated seconds
    host_used: list[int] = field(default_factory=list)  # host KV blocks used
    in_flight: list[int] = field(default_factory=list)  # KV transfers in flight

    def range_for_times(self, t0: float, t1: float) -> tuple[int, int]:
        """The snapshots taken at t0 <= t <= t1, as [start, stop) indices."""
        return bisect.bisect_left(self.times, t0), bisect.bisect_right(self.times, t1)

    def summary(self, run_id: int) -> dict[str, Any]:
        return {"id": run_id, "labels": self.labels, "snapshots": len(self.offsets), "bytes": sum(self.lengths),
                "t": self.times, "host_used": self.host_used, "in_flight": self.in_flight}


@dataclass
class RecordingIndex:
    path: Path
    runs: list[RunIndex]

    def summary(self) -> dict[str, Any]:
        """What the page loads first: every run's labels, size, times and history numbers."""
        return {"runs": [run.summary(i) for i, run in enumerate(self.runs)]}

    def read(self, run_id: int, start: int, stop: int) -> bytes:
        """Snapshots [start, stop) of a run, as the JSON lines they are in the file."""
        run = self.runs[run_id]
        out = bytearray()
        with self.path.open("rb") as f:
            for offset, length in zip(run.offsets[start:stop], run.lengths[start:stop]):
                f.seek(offset)
                out += f.read(length)
        return bytes(out)


def index_recording(path: str | Path) -> RecordingIndex:
    """One pass over the file; snapshots are grouped into runs by their `run` labels."""
    path = Path(path)
    decoder = msgspec.json.Decoder(_Head)
    runs: list[RunIndex] = []
    by_label: dict[str, RunIndex] = {}
    offset = 0
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    head = decoder.decode(line)
                except msgspec.DecodeError as e:
                    raise ValueError(f"{path}:{number}: not a state snapshot ({e})") from None
                key = json.dumps(head.run, sort_keys=True)
                run = by_label.get(key)
                if run is None:
                    run = by_label[key] = RunIndex(head.run)
                    runs.append(run)
                run.offsets.append(offset)
                run.lengths.append(len(line))
                run.times.append(head.t)
                run.host_used.append(head.kv.host.used)
                run.in_flight.append(head.kv.transfers_in_flight)
            offset += len(line)
    return RecordingIndex(path, runs)


__all__ = ["RunIndex", "RecordingIndex", "index_recording"]
