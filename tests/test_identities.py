"""Identities (`serve --api-keys`, server/identity.py): fairness and priority bound to the API key's
tenant, each tenant seeing and changing only its own requests, per-tenant limits, and /metrics
bounded whatever the clients' `user` strings. Real servers on 127.0.0.1 (the engine core in its
own process), the simulator for the scheduler-level checks."""
from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from serverkit import REACH_MODES, RunningServer, server_reached, start_server, until, wait_idle
from tokenslice.config import SchedulerConfig
from tokenslice.engine.protocol import EngineStats, RequestStream
from tokenslice.predict.cost import load_cost_model
from tokenslice.request import EngineRequest, RequestMetrics, RequestOutput, SamplingParams
from tokenslice.server.identity import OPERATOR, Tenant, TenantBook, TenantLimitError, load_keyring
from tokenslice.server.metrics import MAX_USER_LABEL_CHARS, ServerMetrics, user_label
from tokenslice.sim.engine import simulated_engine

MODEL = "builtin:tiny"
OPS_KEY = "key-ops"
KEYS = f"""
[tenants.attacker]
keys = ["key-attacker"]
priority_min = 5
priority_max = 100

[tenants.victim]
keys = ["key-victim", "key-victim-2"]

[tenants.inflight]
keys = ["key-inflight"]
max_in_flight = 1

[tenants.tpm]
keys = ["key-tpm"]
tokens_per_minute = 300

[tenants.ops]
key_sha256 = ["{hashlib.sha256(OPS_KEY.encode()).hexdigest()}"]
admin = true
"""
# The stall guard (sched/stall_guard.py) protects started streams one by one, whoever sent them
# (benchmarks/scheduling/sybil_sim.py); off here, so that these tests see the policies' own order.
GUARD_FLAGS = ["--stall-guard", "off"]
HTTP_TIMEOUT_S = 60.0  # failure deadlines, not performance checks


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    return str(path)


@contextmanager
def output_log(srv: RunningServer) -> Iterator[list[tuple[str, str | None, int]]]:
    """Every engine output while inside, in the engine's order: (request id, tenant, new tokens)."""
    engine = srv.server.async_engine
    inner = engine.observer
    log: list[tuple[str, str | None, int]] = []

    def observe(out: RequestOutput) -> None:
        log.append((out.request_id, out.tenant, len(out.new_token_ids)))
        inner(out)

    engine.observer = observe
    try:
        yield log
    finally:
        engine.observer = inner


def tokens_of_others_while(log: list[tuple[str, str | None, int]], rid: str) -> int:
    """Tokens other requests got between `rid`'s first and last outputs."""
    mine = [i for i, (r, _, _) in enumerate(log) if r == rid]
    return sum(n for r, _, n in log[mine[0]:mine[-1] + 1] if r != rid)


def live_of(srv: RunningServer, key: str) -> list[dict]:
    r = httpx.get(srv.url("/v1/state"), headers=auth(key), timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 200, r.text
    return r.json()["requests"]


# ---- the keys file -------------------------------------------------------------------------------
def test_keys_file_in_toml_or_json(keys_file: str, tmp_path: Path) -> None:
    ring = load_keyring(keys_file, api_key="operator-key")
    assert ring.tenant_names == ("attacker", "victim", "inflight", "tpm", "ops")
    attacker = ring.identify(b"key-attacker")
    assert attacker is not None and (attacker.priority_min, attacker.priority_max) == (5, 100)
    assert ring.identify(b"key-victim-2") is ring.identify(b"key-victim")
    assert ring.identify(OPS_KEY.encode()).admin and not attacker.admin
    assert ring.identify(b"operator-key") is OPERATOR and ring.identify(b"nope") is None
    assert attacker.clamp(-9007199254740991) == 5 and attacker.clamp(7) == 7 and attacker.clamp(10**9) == 100
    as_json = tmp_path / "keys.json"
    as_json.write_text(json.dumps({"tenants": {"a": {"keys": ["k"], "weight": 2, "tokens_per_minute": 10}}}))
    ring = load_keyring(str(as_json))
    assert ring.tenants[0].weight == 2.0 and ring.tenant_weights() == "a=2.0"
    assert SchedulerConfig(tenant_weights=ring.tenant_weights()).tenant_weights == "a=2.0"


@pytest.mark.parametrize(("text", "why"), [
    ('[tenants."bad name"]\nkeys = ["k"]', "a name is"),
    ('[tenants.a]\nkeys = ["k"]\n[tenants.b]\nkeys = ["k"]', "also another tenant's"),
    ('[tenants.a]\nkeys = []', "no keys"),
    ('[tenants.a]\nkeys = ["k"]\npriority_min = 3\npriority_max = 1', "priority_max 1 < priority_min 3"),
    ('[tenants.a]\nkeys = ["k"]\nweight = 0', "weight"),
    ('[tenants.a]\nkeys = ["k"]\nmax_in_fligth = 3', "max_in_fligth"),
    ('[tenants.a]\nkey_sha256 = ["abc"]', "64 hex digits"),
    ('[tenants.a\n', "--api-keys"),
])
def test_keys_file_errors_say_what_is_wrong(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=why):
        load_keyring(str(path))


# ---- limits ----------------------------------------------------------------------------------
def test_tenant_limits_in_flight_and_tokens_per_minute() -> None:
    now = [1000.0]
    book = TenantBook(clock=lambda: now[0])
    assert not load_keyring(None).required
    t = Tenant("t", max_in_flight=2, tokens_per_minute=100)
    loop = asyncio.new_event_loop()
    try:
        streams = [RequestStream(f"r{i}", loop) for i in range(3)]
        with book.admit(t, 2, 40) as accepted:
            accepted(streams[0])
            accepted(streams[1])
        assert book.in_flight(t) == 2 and book.owns(t, "r0") and not book.owns(Tenant("u"), "r0")
        with pytest.raises(TenantLimitError, match="too many requests in flight") as exc:
            book.check(t, 1, 1)
        assert exc.value.limit == "max_in_flight"
        streams[0].finished = True  # finished or aborted: its place is free
        assert book.in_flight(t) == 1 and not book.owns(t, "r0")
        with pytest.raises(TenantLimitError, match="it needs 101 tokens"):
            book.check(t, 1, 101)  # never fits: no Retry-After
        with pytest.raises(TenantLimitError, match="40 tokens used in the last minute") as exc:
            book.check(t, 1, 61)
        assert exc.value.retry_after_s == 60
        now[0] += 45.0
        assert book.tokens_spent(t) == 40 and exc.value.limit == "tokens_per_minute"
        with pytest.raises(RuntimeError):  # the engine took none: neither place nor tokens are kept
            with book.admit(t, 1, 60):
                raise RuntimeError("refused")
        assert book.tokens_spent(t) == 40 and book.in_flight(t) == 1
        now[0] += 15.0  # the first charge leaves the window
        assert book.tokens_spent(t) == 0
        with book.admit(OPERATOR, 10**6, 10**9):  # the operator has no limits and is not kept
            pass
        assert book.in_flight(OPERATOR) == 0
    finally:
        loop.close()


# ---- metrics ---------------------------------------------------------------------------------
# /metrics at its largest: the 100 user labels the cap allows (and `_other`, `_none`), each of
# MAX_USER_LABEL_CHARS, with their token counters and latency histogram (measured: 495,139 bytes).
METRICS_BOUND_BYTES = 512 * 1024


def test_metrics_stay_bounded_with_a_huge_user_and_many_users() -> None:
    metrics = ServerMetrics("m", EngineStats, lambda: 0, tenants=("a", "b"))
    huge = "x" * 1_000_000

    def finished(user: str, tenant: str | None) -> RequestOutput:
        m = RequestMetrics(arrival_time=0.0, token_times=[0.5, 1.0], finish_time=1.0)
        return RequestOutput("r", [1], "", True, "length", 3, 1, m, user, tenant=tenant)

    metrics.observe(finished(huge, "a"))
    metrics.observe(finished(huge + "\ud800", None))  # a lone surrogate cannot reach a label either
    for i in range(10_000):
        metrics.observe(finished(f"user-{i}-" + "y" * 80, "b"))
    text = metrics.render()
    assert len(text) < METRICS_BOUND_BYTES, len(text)
    assert b"x" * (MAX_USER_LABEL_CHARS + 1) not in text and b"_other" in text
    assert b'tenant="a"' in text and b'tenant="b"' in text
    label = user_label(huge)
    assert len(label) == MAX_USER_LABEL_CHARS and label != user_label(huge + "z") and user_label("alice") == "alice"


# ---- vtc over tenants (simulator) ------------------------------------------------------------
COST = load_cost_model("opt-13b@a100-40gb")


def victim_window(tenants: bool, attacker_ids: int, weights: str | None = None) -> tuple[int, int]:
    """48 attacker requests on `attacker_ids` users, then one victim request of 32 tokens, 2 slots:
    (steps from the victim's arrival to its end, attacker tokens in them)."""
    eng = simulated_engine(SchedulerConfig(policy="vtc", max_batch_size=2, tenant_weights=weights, stall_guard="off"),
                           COST, kv_cache_blocks=100_000)
    for i in range(48):
        eng.add(EngineRequest(f"a{i}", [0] * 8, SamplingParams(max_tokens=400, ignore_eos=True),
                              user=f"u{i % attacker_ids}", tenant="attacker" if tenants else None))
    for _ in range(30):
        eng.step()
    victim = eng.add(EngineRequest("v", [0] * 8, SamplingParams(max_tokens=32, ignore_eos=True), user="v",
                                   tenant="victim" if tenants else None))
    steps = others = 0
    while not victim.is_finished:
        others += sum(len(o.new_token_ids) for o in eng.step() if o.request_id != "v")
        steps += 1
    return steps, others


def test_vtc_shares_service_per_tenant_whatever_its_users() -> None:
    one, many = victim_window(True, 1), victim_window(True, 48)
    assert many[0] <= 1.5 * one[0] and many[1] <= 1.5 * one[1]
    assert one[0] <= 32 + 2  # its arrival's step, its prefill, then one token in every step
    # Without tenants the `user` is the fairness key, as before: 48 ids take the victim's share.
    users_one, users_many = victim_window(False, 1), victim_window(False, 48)
    assert users_one == one and users_many[0] > 10 * one[0]
    # A tenant's weight divides its service: weighted 3, the attacker gets about 3 slots in 4.
    steps, others = victim_window(True, 48, weights="attacker=3")
    assert others > 2 * 32


# ---- a real server: priority ranges, who sees what, limits, /metrics -------------------------
@pytest.fixture(scope="module", params=REACH_MODES)
def psrv(keys_file: str, request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    """Reached directly, with --root-path, and through a prefix-stripping proxy: the keys hold in each."""
    with server_reached(request.param, "--policy", "priority", "--max-batch-size", "1", "--kv-cache-blocks", "512",
                        "--api-keys", keys_file, "--metrics-require-key", *GUARD_FLAGS) as s:
        yield s


@pytest.mark.parametrize("method,path", [("GET", "/v1/state"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
                                         ("GET", "/metrics"), ("POST", "/v1/requests/x/priority")])
def test_no_key_no_answer(psrv: RunningServer, method: str, path: str) -> None:
    """The keyless caller sees nothing and changes nothing, however the server is reached."""
    r = httpx.request(method, psrv.url(path), json={"model": MODEL, "prompt": "hi", "priority": 0},
                      timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 401, (path, r.status_code, r.text[:200])


def completion(srv: RunningServer, key: str, max_tokens: int, **extra: object) -> httpx.Response:
    return httpx.post(srv.url("/v1/completions"), headers=auth(key), timeout=HTTP_TIMEOUT_S,
                      json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
                            "ignore_eos": True, **extra})


@contextmanager
def long_stream(srv: RunningServer, key: str, **extra: object) -> Iterator[str]:
    """A streamed request that runs until closed; yields its id once it produced a token."""
    with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True,
                "stream": True, **extra}
        with client.stream("POST", srv.url("/v1/completions"), headers=auth(key), json=body) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            yield json.loads(first[len("data: "):])["id"]


def test_out_of_range_priority_is_clamped_and_does_not_outrank(psrv: RunningServer) -> None:
    """One batch slot. The attacker asks for the schema's lowest priority and gets its range's
    best, 5; the victim's request at 0 then preempts it and runs to its end while it waits."""
    with output_log(psrv) as log, long_stream(psrv, "key-attacker", priority=-9007199254740991) as a_id:
        r = completion(psrv, "key-victim", 8)
        assert r.status_code == 200, r.text
        v_id = r.json()["id"]
        assert tokens_of_others_while(log, v_id) == 0  # the attacker got no token meanwhile
        mine = {q["id"]: q for q in live_of(psrv, "key-attacker")}
        assert mine[a_id]["priority"] == 5 and mine[a_id]["output_tokens"] < 2000
        r = httpx.post(psrv.url(f"/v1/requests/{a_id}/priority"), json={"priority": -50},
                       headers=auth("key-attacker"), timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 200 and r.json() == {"id": a_id, "priority": 5}
    wait_idle_state(psrv)


def wait_idle_state(srv: RunningServer) -> None:
    until(lambda: not live_of(srv, OPS_KEY), timeout=HTTP_TIMEOUT_S)


def test_a_tenant_sees_and_changes_only_its_own_requests(psrv: RunningServer) -> None:
    # The victim's request waits at priority 10 behind the attacker's (5: its range's best).
    with long_stream(psrv, "key-victim", user="victim-user-7", priority=10) as v_id, \
            long_stream(psrv, "key-attacker", user="attacker-user") as a_id:
        # /v1/state is a snapshot up to 0.25 s old (server/state.py): wait until it holds both.
        until(lambda: {q["id"] for q in live_of(psrv, OPS_KEY)} == {v_id, a_id}, timeout=HTTP_TIMEOUT_S)
        seen = {q["id"] for q in live_of(psrv, "key-attacker")}
        assert a_id in seen and v_id not in seen
        raw = httpx.get(psrv.url("/v1/state"), headers=auth("key-attacker"), timeout=HTTP_TIMEOUT_S).text
        assert v_id not in raw and "victim-user-7" not in raw
        with httpx.stream("GET", psrv.url("/v1/state/stream"), headers=auth("key-attacker"),
                          timeout=HTTP_TIMEOUT_S) as r:
            event = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert a_id in event and v_id not in event and "victim-user-7" not in event
        r = httpx.post(psrv.url(f"/v1/requests/{v_id}/priority"), json={"priority": 50},
                       headers=auth("key-attacker"), timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"
        assert {q["id"] for q in live_of(psrv, "key-victim-2")} == {v_id}  # any of its keys
        everything = {q["id"]: q["tenant"] for q in live_of(psrv, OPS_KEY)}
        assert everything == {v_id: "victim", a_id: "attacker"}
        r = httpx.post(psrv.url(f"/v1/requests/{v_id}/priority"), json={"priority": 50},
                       headers=auth(OPS_KEY), timeout=HTTP_TIMEOUT_S)
        assert r.status_code == 200  # an admin may
    wait_idle_state(psrv)


def test_limits_answer_429_with_a_clear_message(psrv: RunningServer) -> None:
    with long_stream(psrv, "key-inflight"):
        r = completion(psrv, "key-inflight", 4)
        assert r.status_code == 429 and "too many requests in flight" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "rate_limit_error" and r.headers["Retry-After"] == "1"
    until(lambda: completion(psrv, "key-inflight", 4).status_code == 200, timeout=HTTP_TIMEOUT_S)
    r = completion(psrv, "key-tpm", 400)
    assert r.status_code == 429 and "it needs" in r.json()["error"]["message"] and "Retry-After" not in r.headers
    assert completion(psrv, "key-tpm", 100).status_code == 200
    assert completion(psrv, "key-tpm", 100).status_code == 200
    r = completion(psrv, "key-tpm", 100)
    assert r.status_code == 429 and "tokens used in the last minute" in r.json()["error"]["message"]
    assert int(r.headers["Retry-After"]) >= 1
    assert completion(psrv, "key-victim", 400).status_code == 200  # other tenants are not held back
    text = httpx.get(psrv.url("/metrics"), headers=auth(OPS_KEY), timeout=HTTP_TIMEOUT_S).text
    assert f'limited_total{{limit="tokens_per_minute",model_name="{MODEL}",tenant="tpm"}} 2.0' in text
    assert f'limited_total{{limit="max_in_flight",model_name="{MODEL}",tenant="inflight"}} 1.0' in text


def test_metrics_need_an_admin_key_and_show_tenants(psrv: RunningServer) -> None:
    assert httpx.get(psrv.url("/metrics"), timeout=HTTP_TIMEOUT_S).status_code == 401
    r = httpx.get(psrv.url("/metrics"), headers=auth("key-victim"), timeout=HTTP_TIMEOUT_S)
    assert r.status_code == 403
    assert completion(psrv, "key-victim", 2, user="u" * 1_000_000).status_code == 200
    text = httpx.get(psrv.url("/metrics"), headers=auth(OPS_KEY), timeout=HTTP_TIMEOUT_S).text
    assert len(text) < METRICS_BOUND_BYTES and "u" * (MAX_USER_LABEL_CHARS + 1) not in text
    assert f'tokenslice:tenant_generation_tokens_total{{model_name="{MODEL}",tenant="victim"}}' in text


# ---- a real server: the sybil under vtc ---------------------------------------------------------
@pytest.fixture(scope="module")
def vsrv(keys_file: str) -> Iterator[RunningServer]:
    with start_server("--policy", "vtc", "--max-batch-size", "2", "--api-keys", keys_file, *GUARD_FLAGS) as s:
        yield s


async def sybil_round(srv: RunningServer, attacker_ids: int) -> int:
    """48 attacker streams on `attacker_ids` user ids, then one victim request of 32 tokens:
    the tokens the attacker got between the victim's first and last tokens."""
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S, limits=httpx.Limits(max_connections=64)) as client:
        async def attack(i: int) -> None:
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True,
                    "stream": True, "user": f"sybil-{i % attacker_ids}"}
            async with client.stream("POST", srv.url("/v1/completions"), json=body,
                                     headers=auth("key-attacker")) as r:
                async for _ in r.aiter_bytes():
                    pass

        tasks = [asyncio.ensure_future(attack(i)) for i in range(48)]
        try:
            while sum(q["tenant"] == "attacker" for q in (await client.get(
                    srv.url("/v1/state"), headers=auth(OPS_KEY))).json()["requests"]) < 48:
                assert not any(t.done() for t in tasks)
                await asyncio.sleep(0.05)
            with output_log(srv) as log:
                r = await client.post(srv.url("/v1/completions"), headers=auth("key-victim"),
                                      json={"model": MODEL, "prompt": "Hello", "max_tokens": 32, "ignore_eos": True})
                assert r.status_code == 200, r.text
            return tokens_of_others_while(log, r.json()["id"])
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def test_sybil_user_ids_do_not_take_the_victims_share(vsrv: RunningServer) -> None:
    """The issue's scenario: with the attacker spread over 48 user ids, the victim's request
    takes at most 1.5x the engine's tokens it takes against one id (vtc shares per tenant)."""
    one = asyncio.run(sybil_round(vsrv, 1))
    wait_idle(vsrv)
    many = asyncio.run(sybil_round(vsrv, 48))
    wait_idle(vsrv)
    assert one <= 32 + 2 and many <= 1.5 * (one + 32) - 32, (one, many)
