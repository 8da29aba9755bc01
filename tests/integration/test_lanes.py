"""Priority lanes and deadlines: the pure policy, the real engine on a tiny model, the HTTP
headers and fields on the real daemon (docs/tuning.md "Priority lanes", docs/api.md)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemon_helpers import embedded_daemon
from engine_driver import Driver
from mlxcel.daemon.engine.lanes import effective_rank, parse_lane, parse_timeout, queue_order
from mlxcel.daemon.engine.types import (
    FINISH_TIMEOUT,
    GREEDY,
    GenerationRequest,
    SamplingParams,
)

# -- the policy --------------------------------------------------------------------------


def test_lanes_parse_names_and_vllm_integers() -> None:
    assert [parse_lane(v) for v in ("high", " LOW ", "normal")] == ["high", "low", "normal"]
    lanes = [parse_lane(v) for v in (-5, 0, 3, "-1", "2")]
    assert lanes == ["high", "normal", "low", "high", "low"]
    for bad in ("urgent", "", True, 1.5, None):
        with pytest.raises(ValueError, match="priority must be"):
            parse_lane(bad)
    assert parse_timeout("2.5") == 2.5
    for bad in ("0", "-1", "soon", True, 1e9):
        with pytest.raises(ValueError, match="timeout must be"):
            parse_timeout(bad)


def test_queue_order_is_lane_then_arrival_and_aging_lifts_a_low_request() -> None:
    entries = [("low", 0.0), ("normal", 1.0), ("high", 2.0), ("high", 3.0), ("normal", 4.0)]
    assert queue_order(entries, now=5.0, aging_s=100.0) == [2, 3, 1, 4, 0]
    # after 2 x aging a low request ranks as high, and it came first
    assert effective_rank("low", 20.0, 10.0) == 0
    assert queue_order(entries, now=20.0, aging_s=10.0)[0] == 0
    assert queue_order(entries, now=5.0, aging_s=0.0) == [2, 3, 1, 4, 0]  # 0: no aging


def test_aging_bounds_a_low_wait_under_a_steady_high_stream() -> None:
    """A new high request every second, one served per second: the low one is served within
    2 x aging (+1 s), not never."""
    aging, queue, served_at = 5.0, [("low", 0.0)], None
    for now in range(1, 60):
        queue.append(("high", float(now)))
        first = queue_order(queue, float(now), aging)[0]
        if queue.pop(first) == ("low", 0.0):
            served_at = now
            break
    assert served_at is not None and served_at <= 2 * aging + 1
    # without aging it starves
    queue = [("low", 0.0)]
    for now in range(1, 60):
        queue.append(("high", float(now)))
        assert queue.pop(queue_order(queue, float(now), 0.0)[0]) != ("low", 0.0)


# -- the engine --------------------------------------------------------------------------


def request(rid: str, lane: str = "normal", max_tokens: int = 6, **kw: Any) -> GenerationRequest:
    return GenerationRequest(rid, (5, 6, 7, 8, 9, 10), max_tokens, GREEDY, lane=lane, **kw)


def fake_clock(driver: Driver) -> list[float]:
    now = [1000.0]
    driver.engine.clock = lambda: now[0]
    return now


def admission_order(driver: Driver) -> list[str]:
    order: list[str] = []
    while driver.engine.has_work:
        snap = driver.step()
        for slot in snap.slots:
            if slot.request_id and slot.request_id not in order:
                order.append(slot.request_id)
    return order


def one_slot(tiny: Any, **config: Any) -> tuple[Driver, list[float]]:
    """One slot, no prompt cache, no preemption, on a stopped clock: the queue's order alone."""
    d = Driver(
        tiny, parallel=1, max_batch_prefill=1, prompt_cache=False, preemption=False, **config
    )
    return d, fake_clock(d)


def test_a_high_request_is_admitted_before_earlier_normal_and_low_ones(tiny: Any) -> None:
    d, _ = one_slot(tiny, priority_aging=0)
    d.add(request("first")).step()  # "first" runs; the rest wait for its slot
    d.add(request("low", "low"), request("normal"), request("high", "high"))
    queue = d.step().queue
    assert [(q.request_id, q.lane) for q in queue] == [
        ("high", "high"),
        ("normal", "normal"),
        ("low", "low"),
    ]
    assert admission_order(d) == ["first", "high", "normal", "low"]
    slots_lanes = {s.request_id: s.lane for snap in d.snapshots for s in snap.slots}
    assert slots_lanes["high"] == "high" and slots_lanes["low"] == "low"
    assert {rid: len(t) for rid, t in d.tokens.items()} == dict.fromkeys(
        ("first", "low", "normal", "high"), 6
    )


def test_without_lanes_the_queue_stays_fifo(tiny: Any) -> None:
    d = Driver(tiny, parallel=1, max_batch_prefill=1, prompt_cache=False)
    fake_clock(d)
    d.add(*(request(f"r{i}") for i in range(4)))
    assert admission_order(d) == ["r0", "r1", "r2", "r3"]


def test_aging_lets_a_waiting_low_request_pass_newer_high_ones(tiny: Any) -> None:
    d, now = one_slot(tiny, priority_aging=5)
    d.add(request("first", max_tokens=3)).step()
    d.add(request("low", "low", max_tokens=3))
    now[0] += 11.0  # the low one has waited past 2 x aging
    d.add(request("high", "high", max_tokens=3))
    assert admission_order(d) == ["first", "low", "high"]


def test_a_timed_out_request_frees_its_slot_and_kv_at_once(tiny: Any) -> None:
    d = Driver(tiny, parallel=2, prompt_cache=False, kv_cache_budget=1 << 22)
    now = fake_clock(d)
    d.add(request("slow", max_tokens=200, timeout_s=2.0), request("ok", max_tokens=8))
    d.add(request("queued", max_tokens=4, timeout_s=1.0))  # waits: no slot
    for _ in range(3):
        d.step()
    before = d.snapshots[-1]
    assert {s.request_id for s in before.slots} >= {"slow", "ok"}
    now[0] += 1.5  # "queued" is past its deadline while it waits
    d.step()
    assert d.finals["queued"].finish_reason == FINISH_TIMEOUT
    assert "timeout (1 s)" in (d.finals["queued"].error or "")
    now[0] += 1.0  # "slow" is past its own
    snap = d.step()
    final = d.finals["slow"]
    assert final.finish_reason == FINISH_TIMEOUT and 0 < final.completion_tokens < 200
    assert "slow" not in {s.request_id for s in snap.slots}
    d.run()
    assert d.finals["ok"].finish_reason == "length" and len(d.tokens["ok"]) == 8
    assert d.engine.kv.num_used == 0 and not d.engine._deadlines


def test_the_server_default_timeout_applies_when_a_request_names_none(tiny: Any) -> None:
    d = Driver(tiny, parallel=1, prompt_cache=False, request_timeout=3)
    now = fake_clock(d)
    d.add(request("a", max_tokens=200), request("b", max_tokens=200, timeout_s=60.0))
    d.step()
    now[0] += 4.0
    d.step()
    assert d.finals["a"].finish_reason == FINISH_TIMEOUT
    assert "b" not in d.finals  # its own, longer timeout wins over the server's


# -- the HTTP API ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with embedded_daemon(tmp_path_factory, tiny_model_dir, parallel=2) as d:
        yield d


async def post(daemon: Any, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{daemon.http_url}/v1/completions", json=body, headers=headers or {}) as resp,
    ):
        return resp.status, await resp.text()


BODY = {"prompt": "hello there", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}


@pytest.mark.parametrize(
    ("headers", "extra", "field"),
    [
        ({"X-Priority": "urgent"}, {}, "X-Priority"),
        ({"X-Timeout": "never"}, {}, "X-Timeout"),
        ({}, {"priority": "asap"}, "priority"),
        ({}, {"timeout": -3}, "timeout"),
        ({}, {"timeout": [1]}, "timeout"),
    ],
)
async def test_bad_priority_or_timeout_is_a_400(
    daemon: Any, headers: dict[str, str], extra: dict[str, Any], field: str
) -> None:
    status, text = await post(daemon, {**BODY, "max_tokens": 2, **extra}, headers)
    assert status == 400, text
    assert json.loads(text)["error"]["param"] == field


@pytest.mark.parametrize(
    ("headers", "extra", "field"),
    [({"X-Speculative": "maybe"}, {}, "X-Speculative"), ({}, {"speculative": "no"}, "speculative")],
)
async def test_bad_speculative_header_or_field_is_a_400(
    daemon: Any, headers: dict[str, str], extra: dict[str, Any], field: str
) -> None:
    status, text = await post(daemon, {**BODY, "max_tokens": 2, **extra}, headers)
    assert status == 400, text
    assert json.loads(text)["error"]["param"] == field
    for headers, extra in (({"X-Speculative": "off"}, {}), ({}, {"speculative": False})):
        status, text = await post(daemon, {**BODY, "max_tokens": 2, **extra}, headers)
        assert status == 200, text


async def test_a_timeout_header_ends_a_request_with_a_504(daemon: Any) -> None:
    status, text = await post(daemon, BODY, {"X-Timeout": "0.5", "X-Priority": "low"})
    assert status == 504, text
    error = json.loads(text)["error"]
    assert error["code"] == "timeout" and "timeout (0.5 s)" in error["message"]
    status, text = await post(daemon, {**BODY, "max_tokens": 3})  # still serving
    assert status == 200 and json.loads(text)["choices"][0]["finish_reason"] == "length"


async def test_a_streamed_request_past_its_timeout_field_names_it(daemon: Any) -> None:
    body = {**BODY, "stream": True, "timeout": 0.5, "priority": "high"}
    status, text = await post(daemon, body)
    assert status == 200
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    reasons = [c["finish_reason"] for e in events for c in e.get("choices", [])]
    assert reasons[-1] == "timeout"
    assert events[-1]["error"]["code"] == "timeout"
    metrics = await _metrics(daemon)
    assert 'finish_reason="timeout"' in metrics


async def _metrics(daemon: Any) -> str:
    url = f"{daemon.http_url}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return await resp.text()


# -- preemption --------------------------------------------------------------------------


def alone_tokens(tiny: Any, req: GenerationRequest) -> list[int]:
    d = Driver(tiny, parallel=1, prompt_cache=False)
    d.add(req).run()
    return d.tokens[req.request_id]


PROMPT = tuple(range(3, 80))  # over two KV blocks: the resumed prompt hits the prompt cache


@pytest.mark.parametrize(
    "sampling",
    [
        GREEDY,
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, seed=7),  # its random stream resumes where it was
        SamplingParams(temperature=1.2, top_p=0.9, seed=3, frequency_penalty=0.5),
    ],
)
def test_a_preempted_request_gives_the_tokens_it_gives_alone(
    tiny: Any, sampling: SamplingParams
) -> None:
    low = GenerationRequest("low", PROMPT, 40, sampling, lane="low")
    high = GenerationRequest("high", PROMPT[:20], 12, GREEDY, lane="high")
    expected = {"low": alone_tokens(tiny, low), "high": alone_tokens(tiny, high)}
    d = Driver(tiny, parallel=1, max_batch_prefill=1)
    d.add(low)
    for _ in range(8):
        d.step()  # "low" decodes a few tokens
    emitted = len(d.tokens["low"])
    assert 0 < emitted < 40
    d.add(high)
    snap = d.step()  # "high" takes the slot at once
    assert [s.request_id for s in snap.slots] == ["high"]
    assert [(q.request_id, q.lane) for q in snap.queue] == [("low", "low")]
    d.run()
    assert d.tokens == expected
    assert d.finals["low"].finish_reason == "length"
    assert d.finals["low"].prompt_tokens == len(PROMPT)  # the client's prompt, not the resumed one
    assert d.finals["low"].completion_tokens == 40
    assert d.engine.stats.counters().preemptions == 1
    assert d.engine.kv.num_used == 0


def test_a_preempted_rows_kv_goes_to_the_prompt_cache_so_it_resumes_without_recomputing(
    tiny: Any,
) -> None:
    low = GenerationRequest("low", PROMPT, 120, GREEDY, lane="low")
    high = GenerationRequest("high", PROMPT[:20], 4, GREEDY, lane="high")
    expected = {"low": alone_tokens(tiny, low), "high": alone_tokens(tiny, high)}
    d = Driver(tiny, parallel=1, max_batch_prefill=1)
    d.add(low)
    while len(d.tokens.get("low", [])) < 70:  # 77 + 70 tokens: 4 whole blocks of 32
        d.step()
    d.add(high)
    d.step()  # "high" preempts "low"
    while "high" not in d.finals:
        d.step()
    computed = d.engine.stats.counters().prompt_tokens_computed
    while d.engine.running.get("low") is None or d.engine.running["low"].state != "decode":
        d.step()
    resumed = d.engine.stats.counters().prompt_tokens_computed - computed
    assert resumed <= 32  # the last partial block, not the 147 tokens the row held
    d.run()
    assert d.tokens == expected


def test_a_high_requests_first_token_leaves_before_the_copies_that_make_its_room(
    tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The preempted row's KV copied into the prompt cache, and the decode batch's merged KV
    (a copy of every running row's) evaluated: both in the step that admits the high request,
    after its first token has left the engine, so neither is in its time to first token."""
    lows = [GenerationRequest(f"low{i}", PROMPT, 40, GREEDY, lane="low") for i in range(2)]
    high = GenerationRequest("high", PROMPT[:20], 6, GREEDY, lane="high")
    expected = {r.request_id: alone_tokens(tiny, r) for r in (*lows, high)}
    d = Driver(tiny, parallel=2, max_batch_prefill=2)
    runner, events = d.engine.runner, []
    evaluate, payload, on_flush = runner._evaluate_decode_kv, runner.kv_payload, d.engine.on_flush

    def flushed() -> None:
        if d.tokens.get("high") and "out" not in events:
            events.append("out")  # the high request's first token leaves the engine thread
        on_flush()

    def merged() -> None:
        events.append("merge")
        evaluate()

    def copied(caches: Any, num_tokens: int) -> Any:
        events.append("victim kv" if num_tokens > len(PROMPT) else "prompt kv")
        return payload(caches, num_tokens)

    monkeypatch.setattr(d.engine, "on_flush", flushed)
    monkeypatch.setattr(runner, "_evaluate_decode_kv", merged)
    monkeypatch.setattr(runner, "kv_payload", copied)
    d.add(*lows)
    for _ in range(6):
        d.step()
    events.clear()
    d.add(high)
    d.step()
    assert d.engine.stats.counters().preemptions == 1
    assert events[0] == "out", events
    assert {"merge", "victim kv"} <= set(events), events
    d.run()
    assert d.tokens == expected


def test_a_preempted_request_waits_ahead_of_those_that_came_after_it(tiny: Any) -> None:
    d = Driver(tiny, parallel=1, max_batch_prefill=1)
    d.add(GenerationRequest("first", PROMPT, 30, GREEDY, lane="low"))
    for _ in range(4):
        d.step()
    d.add(GenerationRequest("later", PROMPT[:10], 5, GREEDY, lane="low"))
    d.step()
    d.add(GenerationRequest("high", PROMPT[:20], 4, GREEDY, lane="high"))
    snap = d.step()
    assert [s.request_id for s in snap.slots] == ["high"]
    assert [q.request_id for q in snap.queue] == ["first", "later"]
    assert admission_order(d) == ["high", "first", "later"]


def test_a_high_request_does_not_wait_for_a_low_prefill_cohort(tiny: Any) -> None:
    decoding = GenerationRequest("decoding", PROMPT, 40, GREEDY, lane="low")
    prefilling = GenerationRequest("prefilling", PROMPT * 4, 20, GREEDY, lane="low")
    high = GenerationRequest("high", PROMPT[:20], 6, GREEDY, lane="high")
    expected = {r.request_id: alone_tokens(tiny, r) for r in (decoding, prefilling, high)}
    d = Driver(tiny, parallel=3, max_batch_prefill=1, prefill_chunk_size=32)
    d.add(decoding)
    for _ in range(4):
        d.step()
    d.add(prefilling)
    d.step()
    d.step()
    assert d.engine.running["prefilling"].state == "prefill"  # 308 tokens, 32 a step
    d.add(high)
    snap = d.step()
    assert {s.request_id for s in snap.slots if s.request_id} == {"decoding", "high"}
    assert [q.request_id for q in snap.queue] == ["prefilling"]
    d.run()
    assert d.tokens == expected
    assert d.engine.stats.counters().preemptions == 1
    assert d.engine.kv.num_used == 0


def test_lower_lane_rows_sit_out_the_step_of_a_higher_lane_prefill(tiny: Any) -> None:
    low = GenerationRequest("low", PROMPT, 30, GREEDY, lane="low")
    high = GenerationRequest("high", PROMPT[:40], 6, GREEDY, lane="high")
    expected = {"low": alone_tokens(tiny, low), "high": alone_tokens(tiny, high)}
    d = Driver(tiny, parallel=2, max_batch_prefill=1)
    d.add(low)
    for _ in range(4):
        d.step()
    before = len(d.tokens["low"])
    d.add(high)
    d.step()  # "high" prefills alone and has its first token
    assert len(d.tokens["low"]) == before and len(d.tokens["high"]) == 1
    d.step()  # both decode again
    assert len(d.tokens["low"]) > before
    d.run()
    assert d.tokens == expected
    assert d.engine.stats.counters().preemptions == 0  # a slot was free: nobody preempted


def test_no_preemption_keeps_the_running_request(tiny: Any) -> None:
    d = Driver(tiny, parallel=1, max_batch_prefill=1, preemption=False)
    d.add(GenerationRequest("low", PROMPT, 30, GREEDY, lane="low"))
    for _ in range(4):
        d.step()
    d.add(GenerationRequest("high", PROMPT[:20], 4, GREEDY, lane="high"))
    snap = d.step()
    assert [s.request_id for s in snap.slots] == ["low"]
    d.run()
    assert d.engine.stats.counters().preemptions == 0
    assert len(d.tokens["low"]) == 30


def test_a_high_request_short_of_kv_preempts_a_low_one_with_slots_free(tiny: Any) -> None:
    low = GenerationRequest("low", PROMPT, 40, SamplingParams(temperature=0.8, seed=11), lane="low")
    normal = GenerationRequest("normal", PROMPT[:30], 30, GREEDY)
    high = GenerationRequest("high", PROMPT[:20], 12, GREEDY, lane="high")
    expected = {r.request_id: alone_tokens(tiny, r) for r in (low, normal, high)}
    probe = Driver(tiny, parallel=4)
    kv = probe.engine.kv
    # room for "low" and "normal", not for "high" beside them
    blocks = kv.blocks_for(len(PROMPT) + 40) + kv.blocks_for(30 + 30)
    d = Driver(tiny, parallel=4, kv_cache_budget=blocks * kv.bytes_per_block)
    d.add(low, normal)
    while [s.state for s in d.step().slots if s.request_id] != ["decode", "decode"]:
        pass
    assert {s.request_id for s in d.snapshots[-1].slots if s.request_id} == {"low", "normal"}
    d.add(high)
    snap = d.step()
    assert {s.request_id for s in snap.slots if s.request_id} == {"normal", "high"}  # not normal
    assert [q.request_id for q in snap.queue] == ["low"]
    d.run()
    assert d.tokens == expected
    assert d.engine.stats.counters().preemptions == 1
    assert d.engine.kv.num_used == 0


def test_nobody_is_preempted_when_that_would_not_make_room(tiny: Any) -> None:
    probe = Driver(tiny, parallel=4)
    kv = probe.engine.kv
    blocks = kv.blocks_for(len(PROMPT) + 40) + kv.blocks_for(30 + 30)
    d = Driver(tiny, parallel=4, kv_cache_budget=blocks * kv.bytes_per_block)
    d.add(GenerationRequest("low", PROMPT, 40, GREEDY, lane="low"))
    d.add(GenerationRequest("other", PROMPT[:30], 30, GREEDY, lane="high"))
    for _ in range(4):
        d.step()
    # "high" needs more than "low" holds: only "other" ending makes room, and it cannot go
    high = GenerationRequest("high", PROMPT + PROMPT[:20], 40, GREEDY, lane="high")
    assert kv.blocks_for(len(high.prompt_ids) + 40) > kv.blocks_for(len(PROMPT) + 40)
    d.add(high)
    d.step()
    assert d.engine.stats.counters().preemptions == 0
    assert {s.request_id for s in d.snapshots[-1].slots if s.request_id} == {"low", "other"}
    d.run()
    assert [len(d.tokens[r]) for r in ("low", "other", "high")] == [40, 30, 40]


async def test_a_high_request_preempts_full_slots_and_the_low_streams_only_pause(
    daemon: Any,
) -> None:
    async def stream(body: dict[str, Any], headers: dict[str, str]) -> tuple[str, int, float]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{daemon.http_url}/v1/completions", json=body, headers=headers) as resp,
        ):
            text = await resp.text()
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        finish = [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]]
        usage = chunks[-1]["usage"]["completion_tokens"]
        return finish[-1], usage, time.monotonic()

    low = {**BODY, "max_tokens": 1500, "stream": True, "stream_options": {"include_usage": True}}
    lows = [asyncio.create_task(stream(low, {"X-Priority": "low"})) for _ in range(2)]
    for _ in range(200):  # both slots decoding
        slots = daemon.daemon.bridge.snapshot().slots
        if all(s.state == "decode" and s.generated_tokens > 5 for s in slots):
            break
        await asyncio.sleep(0.02)
    high = {**BODY, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    high_done = await stream(high, {"X-Priority": "high"})
    results = await asyncio.gather(*lows)
    assert high_done[:2] == ("length", 5)
    assert [r[:2] for r in results] == [("length", 1500)] * 2
    assert min(r[2] for r in results) > high_done[2]  # it did not wait for a low one to end
    assert "mlxcel_preemptions_total 1.0" in await _metrics(daemon)


# -- per-key lanes (--api-keys-file) -------------------------------------------------------


def keys_file(folder: Path, text: str, mode: int = 0o600) -> Path:
    path = folder / "keys"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_keys_file_gives_each_key_its_lane_and_refuses_bad_ones(tmp_path: Path) -> None:
    from mlxcel.daemon.process.option_sources import read_api_keys_file
    from mlxcel.shared.config import ConfigError

    text = "# editor, batch\nk-editor high\nk-batch\t1\n\nk-plain\n"
    assert read_api_keys_file(keys_file(tmp_path, text)) == {
        "k-editor": "high",
        "k-batch": "low",
        "k-plain": "normal",
    }
    for bad, says in (
        ("k1 urgent\n", "line 1"),
        ("k1\nk1 low\n", "listed twice"),
        ("# none\n", "no key"),
    ):
        with pytest.raises(ConfigError, match=says):
            read_api_keys_file(keys_file(tmp_path, bad))
    with pytest.raises(ConfigError, match="chmod 600"):
        read_api_keys_file(keys_file(tmp_path, "k1\n", 0o644))


async def test_a_keys_lane_is_its_requests_default_and_preempts_by_it(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    path = keys_file(tmp_path, "k-batch low\nk-editor high\n")
    with embedded_daemon(
        tmp_path_factory, tiny_model_dir, parallel=1, api_keys_file=str(path)
    ) as d:

        async def call(key: str | None, body: dict[str, Any]) -> tuple[int, str, float]:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            url = f"{d.http_url}/v1/completions"
            async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
                return r.status, await r.text(), time.monotonic()

        assert (await call(None, {**BODY, "max_tokens": 2}))[0] == 401
        assert (await call("k-other", {**BODY, "max_tokens": 2}))[0] == 401
        batch = asyncio.create_task(call("k-batch", {**BODY, "max_tokens": 1500}))
        for _ in range(200):
            slots = d.daemon.bridge.snapshot().slots
            if slots and slots[0].state == "decode" and slots[0].generated_tokens > 5:
                break
            await asyncio.sleep(0.02)
        assert slots[0].lane == "low"
        status, text, editor_done = await call("k-editor", {**BODY, "max_tokens": 5})
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 5
        status, text, batch_done = await batch
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 1500
        assert editor_done < batch_done
        assert d.daemon.bridge.engine.stats.counters().preemptions == 1
