"""Which of --data-parallel-size engines a new request goes to (engine/dp_client.py asks).

Each replica's outstanding work is counted here, from what the router itself sent: the tokens a
request still has to compute (its prompt until its first token, then what is left of max_tokens,
or of the length the predictor expects when one was given). Policies (`--router`):

- round-robin: the next live replica in turn (the baseline).
- least-work: a replica with a free batch slot first (a request that must wait for a slot waits
  however little work is ahead of it: tokens alone would send it behind a batch of short
  requests), then the fewest outstanding tokens, then the lowest index.
- prefix-aware: a conversation's next turn goes where its earlier turns ran (their KV is in that
  replica's prefix cache): the prefixes of PREFIX_LENGTHS tokens of each placed prompt, and of
  prompt + answer once it finished, are remembered, and a new prompt goes home to the replica of
  its longest remembered prefix, unless that replica has more than OVERLOAD_FACTOR x the
  least-loaded one's work (plus OVERLOAD_SLACK_TOKENS) or no free slot where another has one;
  otherwise least-work. (A long system
  prompt every conversation shares makes its replica everyone's home until it is busy enough:
  load, not the prefix, then decides, as in routers that match on prefixes and balance on load.)
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

from tokenslice.request import EngineRequest

PREFIX_LENGTHS = tuple(2**k for k in range(5, 16))  # 32 .. 32,768 tokens
MAX_PREFIXES = 100_000  # remembered prompt prefixes (least recently used dropped first)
OVERLOAD_FACTOR = 2.0
OVERLOAD_SLACK_TOKENS = 2048  # below this much work a replica is never "far busier"


@dataclass
class Placement:
    replica: int
    prompt_tokens: int
    output_tokens: int  # expected (max_tokens, or the prediction); shrinks as tokens come
    started: bool = False

    @property
    def work(self) -> int:
        return (0 if self.started else self.prompt_tokens) + max(0, self.output_tokens)


class Router:
    def __init__(self, policy: str, num_replicas: int, slots: int | None = None) -> None:
        """`slots`: requests one replica runs at once (its max batch size); None: unbounded."""
        if policy not in ("round-robin", "least-work", "prefix-aware"):
            raise ValueError(f"unknown router {policy!r}")
        self.policy = policy
        self.slots = slots
        self.alive = [True] * num_replicas
        self.work = [0] * num_replicas  # outstanding tokens per replica
        self.live = [0] * num_replicas  # requests placed and not finished
        self.routed = [0] * num_replicas  # requests placed, ever
        self._placed: dict[str, Placement] = {}
        self._turn = itertools.count()
        self._prefixes: OrderedDict[int, int] = OrderedDict()  # prompt-prefix hash -> replica

    @property
    def live_replicas(self) -> list[int]:
        return [i for i, a in enumerate(self.alive) if a]

    def choose(self, request: EngineRequest) -> int:
        """The replica for `request` (not yet counted: `place` does). Raises RuntimeError when
        no replica is alive."""
        live = self.live_replicas
        if not live:
            raise RuntimeError("no engine replica is alive")
        if self.policy == "round-robin":
            return live[next(self._turn) % len(live)]
        least = min(live, key=lambda i: (self._waiting_if_added(i), self.work[i], i))
        if self.policy == "prefix-aware":
            home = self._home(request.prompt_token_ids)
            if home is not None and self.alive[home] and (
                    self._waiting_if_added(home) <= self._waiting_if_added(least)
                    and self.work[home] <= OVERLOAD_FACTOR * self.work[least] + OVERLOAD_SLACK_TOKENS):
                return home
        return least

    def _waiting_if_added(self, i: int) -> int:
        return 0 if self.slots is None else max(0, self.live[i] + 1 - self.slots)

    def place(self, request: EngineRequest, replica: int) -> None:
        expected = request.predicted_output_tokens or request.params.max_tokens
        p = Placement(replica, len(request.prompt_token_ids), expected)
        self._placed[request.request_id] = p
        self.work[replica] += p.work
        self.live[replica] += 1
        self.routed[replica] += 1
        self._remember(request.prompt_token_ids, replica)

    def _remember(self, ids: list[int], replica: int) -> None:
        if self.policy != "prefix-aware":
            return
        for n in PREFIX_LENGTHS:
            if n > len(ids):
                break
            key = hash(tuple(ids[:n]))
            self._prefixes[key] = replica
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > MAX_PREFIXES:
            self._prefixes.popitem(last=False)

    def _home(self, ids: list[int]) -> int | None:
        """The replica of the longest remembered prefix of `ids`."""
        for n in reversed(PREFIX_LENGTHS):
            if n <= len(ids):
                home = self._prefixes.get(hash(tuple(ids[:n])))
                if home is not None:
                    return home
        return None

    def produced(self, request_id: str, new_tokens: int) -> None:
        """`new_tokens` more tokens of the request came out."""
        p = self._placed.get(request_id)
        if p is None:
            return
        before = p.work
        p.started = True
        p.output_tokens -= new_tokens
        self.work[p.replica] += p.work - before

    def finished(self, request_id: str, token_ids: list[int] | None = None) -> None:
        """The request ended; `token_ids`: its prompt and answer (the next turn's prefix)."""
        p = self._placed.pop(request_id, None)
        if p is not None:
            self.work[p.replica] -= p.work
            self.live[p.replica] -= 1
            if token_ids is not None and self.alive[p.replica]:
                self._remember(token_ids, p.replica)

    def replica_of(self, request_id: str) -> int | None:
        p = self._placed.get(request_id)
        return None if p is None else p.replica

    def remove(self, replica: int) -> list[str]:
        """A replica died: no request goes there any more; returns the requests it held."""
        self.alive[replica] = False
        gone = [rid for rid, p in self._placed.items() if p.replica == replica]
        for rid in gone:
            self.finished(rid)
        self.work[replica] = 0
        self.live[replica] = 0
        for key in [k for k, r in self._prefixes.items() if r == replica]:
            del self._prefixes[key]
        return gone

