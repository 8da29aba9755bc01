"""The HTTP API's edge guards (docs/reliability.md, "Hostile input"), on an in-process daemon and
the tiny model, with the requests a browser page, a DNS-rebinding page or a slow client sends:

- a web page of a foreign origin cannot drive any state-changing route without JSON (what
  `fetch(..., {mode: "no-cors"})`, `sendBeacon` and forms send needs no preflight);
- a `Host` that is not this machine (DNS rebinding) is refused on every route;
- NaN, infinities and 1e999 are refused where a body enters, and the control socket answers a
  status that holds one instead of closing;
- a half-sent request head is closed after `header_timeout`; connections over
  `max_connections` are closed at once;
- a non-ASCII API key is a 401 (or works when it is the key); a CR/LF in an ignored field's
  name never reaches a response header.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import math
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from daemon_helpers import control, embedded_daemon, wait_until
from mlxcel.daemon.server.control_server import encode_message
from mlxcel.daemon.server.guards import (
    STATE_CHANGING_METHODS,
    HostAllowlist,
    header_list,
    host_name,
    interface_names,
    keys_match,
)
from mlxcel.daemon.server.http_app import ServingState, make_app
from mlxcel.daemon.server.metrics import DaemonMetrics
from mlxcel.shared.protocol import Event, Reply

GOOD_ORIGIN = "http://good.example"
EVIL_ORIGIN = "http://evil.example"
ASK = [{"role": "user", "content": "hi"}]
HEADER_TIMEOUT_S = 1.5
MAX_CONNECTIONS = 4
# what a page sends without a preflight: nothing (a blob without a type, sendBeacon of bytes),
# the three form types, and a blob's own type
NO_PREFLIGHT_TYPES = (
    None,
    "text/plain",
    "text/plain; charset=utf-8",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/octet-stream",
    "image/png",
)


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with embedded_daemon(
        tmp_path_factory,
        tiny_model_dir,
        allowed_origins=(GOOD_ORIGIN,),
        allowed_hosts=("mybox.lan", "10.1.2.3"),
        header_timeout=HEADER_TIMEOUT_S,
    ) as d:
        yield d


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A daemon whose API key is not ASCII; at most MAX_CONNECTIONS connections."""
    with embedded_daemon(
        tmp_path_factory, tiny_model_dir, api_key="clé-秘密", max_connections=MAX_CONNECTIONS
    ) as d:
        yield d


def address(d: Any) -> tuple[str, int]:
    host, port = d.http_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def raw(
    d: Any,
    method: str,
    path: str,
    headers: dict[str, Any] | None = None,
    body: bytes | None = None,
) -> tuple[int, dict[str, str], Any]:
    """One request with exactly these headers (http.client adds Host unless given, and
    Content-Length for a body, never a Content-Type); (status, headers, parsed body)."""
    conn = http.client.HTTPConnection(*address(d), timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        try:
            parsed = json.loads(data)
        except ValueError:
            parsed = data
        return resp.status, dict(resp.headers), parsed
    finally:
        conn.close()


def refused_as(path: str, payload: Any, code: str) -> bool:
    """The error is in the envelope of the path's dialect: OpenAI's with `code`, Anthropic's
    (a permission_error), Ollama's (a bare message)."""
    err = payload.get("error") if isinstance(payload, dict) else None
    if path.startswith("/api/"):
        return isinstance(err, str) and bool(err)
    if path.startswith("/v1/messages"):
        return payload.get("type") == "error" and err["type"] == "permission_error"
    return isinstance(err, dict) and err.get("code") == code


def counters(d: Any) -> dict[str, Any]:
    """What a served request moves: its finish, tokens and cache lookups (not `steps`: the
    engine also steps with no request, for a finished row's deferred prompt-cache copy)."""
    engine = control(d.socket_path, "status")["result"]["engine"]
    moved = {k: v for k, v in engine["counters"].items() if k != "steps"}
    return {"counters": moved, "lookups": engine["prompt_cache"]["lookups"]}


def state_changing_routes() -> list[tuple[str, str]]:
    """(method, path) of every POST/PUT/DELETE/PATCH route the app has: new routes are
    covered without touching this test."""
    app = make_app(ServingState(api_key=None, metrics=DaemonMetrics(lambda: None)))
    routes = []
    for resource in app.router.resources():
        for route in resource:
            if route.method in STATE_CHANGING_METHODS:
                routes.append((route.method, resource.canonical))
    assert ("POST", "/v1/cache/reset") in routes and ("POST", "/v1/chat/completions") in routes
    return routes


def valid_body(path: str) -> bytes:
    body: dict[str, Any] = {"messages": ASK, "max_tokens": 2}
    if path.endswith("/completions") and "chat" not in path:
        body = {"prompt": "hi", "max_tokens": 2}
    elif path == "/api/generate":
        body = {"prompt": "hi", "options": {"num_predict": 2}}
    return json.dumps(body).encode()


# --- Origin ----------------------------------------------------------------------------------


def test_a_foreign_page_cannot_post_to_any_route_without_json(daemon: Any) -> None:
    before = counters(daemon)
    routes = state_changing_routes()
    for method, path in routes:
        for ctype in NO_PREFLIGHT_TYPES:
            headers = {"Origin": EVIL_ORIGIN}
            if ctype is not None:
                headers["Content-Type"] = ctype
            status, _, payload = raw(daemon, method, path, headers, valid_body(path))
            assert status == 403, (method, path, ctype, status, payload)
            assert refused_as(path, payload, "origin_not_allowed"), (path, ctype, payload)
    assert counters(daemon) == before  # nothing was generated, looked up or reset


def test_a_foreign_page_cannot_reset_the_cache(daemon: Any) -> None:
    status, _, _ = raw(
        daemon, "POST", "/v1/chat/completions", {"Content-Type": "application/json"},
        valid_body("/v1/chat/completions"),
    )  # fmt: skip
    assert status == 200
    entries = control(daemon.socket_path, "status")["result"]["engine"]["prompt_cache"]["entries"]
    assert entries > 0
    for headers in ({"Origin": EVIL_ORIGIN}, {"Origin": "null", "Content-Type": "text/plain"}):
        status, _, payload = raw(daemon, "POST", "/v1/cache/reset", headers)
        assert status == 403 and payload["error"]["code"] == "origin_not_allowed", payload
    after = control(daemon.socket_path, "status")["result"]["engine"]["prompt_cache"]["entries"]
    assert after == entries
    # the allowed page (CORS configured) still resets it, and sees the answer
    headers = {"Origin": GOOD_ORIGIN, "Content-Type": "application/json"}
    status, resp_headers, _ = raw(daemon, "POST", "/v1/cache/reset", headers)
    assert status == 200 and resp_headers["Access-Control-Allow-Origin"] == GOOD_ORIGIN
    emptied = control(daemon.socket_path, "status")["result"]["engine"]["prompt_cache"]["entries"]
    assert emptied == 0


def test_json_from_any_page_and_any_type_without_origin_are_served(daemon: Any) -> None:
    body = valid_body("/v1/chat/completions")
    for headers in (
        {"Origin": GOOD_ORIGIN, "Content-Type": "application/json"},
        {"Origin": GOOD_ORIGIN},  # the allowed page, as today: read as JSON
        {"Origin": EVIL_ORIGIN, "Content-Type": "application/json; charset=utf-8"},
        {"Origin": EVIL_ORIGIN, "Content-Type": "application/vnd.api+json"},
        {"Content-Type": "text/plain"},  # no Origin: curl, scripts
        {},
    ):
        status, _, payload = raw(daemon, "POST", "/v1/chat/completions", headers, body)
        assert status == 200, (headers, payload)


# --- Host ------------------------------------------------------------------------------------

FOREIGN_HOSTS = ("evil.example", "evil.example:8080", "127.0.0.1.evil.example", "localhost.evil")


def test_a_foreign_host_is_refused_on_every_route(daemon: Any) -> None:
    chat = valid_body("/v1/chat/completions")
    json_type = {"Content-Type": "application/json"}
    before = counters(daemon)
    for host in FOREIGN_HOSTS:
        for method, path, body in (
            ("GET", "/v1/models", None),
            ("GET", "/metrics", None),
            ("GET", "/health", None),
            ("GET", "/api/tags", None),
            ("OPTIONS", "/v1/chat/completions", None),
            ("POST", "/v1/chat/completions", chat),
            ("POST", "/api/chat", chat),
        ):
            status, _, payload = raw(daemon, method, path, {"Host": host, **json_type}, body)
            assert status == 403, (host, path, status, payload)
            assert refused_as(path, payload, "host_not_allowed"), (host, path, payload)
    assert counters(daemon) == before


async def test_a_foreign_host_cannot_open_the_control_socket(daemon: Any) -> None:
    url = daemon.http_url + "/v1/control"
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.WSServerHandshakeError) as info:
            await session.ws_connect(url, headers={"Host": "evil.example"})
        assert info.value.status == 403
        async with session.ws_connect(url) as ws:  # loopback Host: the read-only console
            await ws.send_str(json.dumps({"id": 1, "method": "hello", "params": {}}))
            reply = json.loads((await ws.receive(timeout=10)).data)
            assert reply["id"] == 1 and "result" in reply


def test_loopback_and_allowed_hosts_are_answered(daemon: Any) -> None:
    _, port = address(daemon)
    for host in (
        f"127.0.0.1:{port}",
        "127.0.0.1",
        "127.9.8.7",
        "localhost",
        f"localhost:{port}",
        "LocalHost.",
        "app.localhost:1",
        "[::1]",
        f"[::1]:{port}",
        "mybox.lan",
        "MyBox.lan:8080",
        "10.1.2.3:80",
    ):
        status, _, payload = raw(daemon, "GET", "/health", {"Host": host})
        assert status == 200, (host, payload)


def test_a_request_without_host_is_answered(daemon: Any) -> None:
    """HTTP/1.0 needs no Host; a browser always sends one, so this is no rebinding path."""
    with socket.create_connection(address(daemon), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.0 200") or reply.startswith(b"HTTP/1.1 200"), reply[:200]


def test_host_names_parse_and_the_allowlist_decides() -> None:
    assert host_name("Example.COM:80") == "example.com"
    assert host_name("[::1]:8080") == "::1"
    assert host_name("[::1") is None and host_name("a:b") is None and host_name("") is None
    assert host_name("[::1]x") is None
    plain = HostAllowlist("127.0.0.1")
    assert plain.allows(None) and plain.allows("[::ffff:127.0.0.1]:1")
    assert not plain.allows("0.0.0.0") and not plain.allows("[fe80::1]")
    named = HostAllowlist("mybox.local", ("192.168.7.7", "[fe80::2]:9"))
    assert named.allows("mybox.local:11434") and named.allows("192.168.7.7")
    assert named.allows("[fe80::2]") and not named.allows("mybox.local.evil.example")
    assert HostAllowlist("127.0.0.1", ("*",)).allows("anything.example")
    everywhere = HostAllowlist("0.0.0.0")
    everywhere.bound([("0.0.0.0", 1234)])
    assert everywhere.allows("0.0.0.0:1234")
    for name in interface_names():  # the machine's own addresses and host name
        assert everywhere.allows(f"[{name}]" if ":" in name else name), name
    assert not everywhere.allows("evil.example")


# --- finite numbers --------------------------------------------------------------------------


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
def test_non_finite_numbers_in_a_body_are_refused(daemon: Any, number: str) -> None:
    """Where no check would catch it later too: in a field the API ignores, and a number."""
    json_type = {"Content-Type": "application/json"}
    for field in ('"x_probe": %s', '"temperature": %s', '"x_probe": {"a": [1, %s]}'):
        text = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, ' + field + "}"
        body = (text % number).encode()
        status, _, payload = raw(daemon, "POST", "/v1/chat/completions", json_type, body)
        assert status == 400 and payload["error"]["code"] == "invalid_json", (field, payload)
        assert number.lstrip("-") in payload["error"]["message"], payload
        status, _, payload = raw(daemon, "POST", "/v1/messages", json_type, body)
        assert status == 400 and "not valid JSON" in payload["error"]["message"], payload
        status, _, payload = raw(daemon, "POST", "/api/chat", json_type, body)
        assert status == 400 and "not valid JSON" in payload["error"], payload


def test_the_control_socket_answers_a_status_holding_infinity(daemon: Any) -> None:
    host = daemon.daemon.host
    resident = next(iter(host.resident.values()))

    def set_keep_alive(value: Any) -> None:
        resident.own_keep_alive = value

    daemon.call(set_keep_alive, (math.inf,))  # what a keep_alive of 1e999 used to leave
    try:
        reply = control(daemon.socket_path, "status")
        assert "result" in reply, reply
        assert reply["result"]["daemon"]["host"]["models"][0]["expires_in_s"] is None  # was inf
        listed = control(daemon.socket_path, "model.list")
        assert "result" in listed, listed
        assert "Infinity" not in json.dumps(listed)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # a subscriber too
            sock.settimeout(10)
            sock.connect(str(daemon.socket_path))
            lines = sock.makefile("rb")
            sock.sendall(b'{"id": 5, "method": "subscribe", "params": {"interval_ms": 50}}\n')
            messages = [json.loads(lines.readline()) for _ in range(3)]
            sock.sendall(b'{"id": 6, "method": "status"}\n')
            while (last := json.loads(lines.readline())).get("id") != 6:
                pass
        assert messages[0]["id"] == 5 and messages[0]["result"]["subscribed"]
        assert any(m.get("event") == "snapshot" for m in messages[1:]), messages
        assert "result" in last
    finally:
        daemon.call(set_keep_alive, None)
    assert "result" in control(daemon.socket_path, "status")


def test_an_unencodable_reply_becomes_an_error_with_its_id() -> None:
    line = encode_message(Reply(7, result={"x": math.nan, "y": [math.inf, 1.5]}))
    assert line is not None and json.loads(line) == {
        "id": 7,
        "result": {"x": None, "y": [None, 1.5]},
    }
    line = encode_message(Reply(8, result={"x": object()}))
    assert line is not None
    reply = json.loads(line)
    assert reply["id"] == 8 and reply["error"]["code"] == "internal_error"
    assert encode_message(Event("snapshot", {"x": object()})) is None
    assert json.loads(encode_message(Event("e", {"x": -math.inf})) or b"") == {
        "event": "e",
        "data": {"x": None},
    }


# --- connections -----------------------------------------------------------------------------


def closed_after(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closes `sock` (reads and drops what it sends); fails after
    `limit`."""
    start = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"still open after {limit} s")
    return time.monotonic() - start


def test_a_half_sent_request_head_is_closed_after_the_header_timeout(daemon: Any) -> None:
    limit = HEADER_TIMEOUT_S + 20  # a loaded machine fires timers late, never early
    with socket.create_connection(address(daemon), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        waited = closed_after(sock, limit)
    assert waited >= HEADER_TIMEOUT_S * 0.8, waited
    with socket.create_connection(address(daemon), timeout=10) as sock:  # says nothing at all
        assert closed_after(sock, limit) >= HEADER_TIMEOUT_S * 0.8
    with socket.create_connection(address(daemon), timeout=10) as sock:  # a byte at a time
        start = time.monotonic()
        head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000
        with pytest.raises(OSError):
            for byte in head:
                sock.sendall(bytes([byte]))
                time.sleep(0.02)
                assert time.monotonic() - start < limit
        assert time.monotonic() - start >= HEADER_TIMEOUT_S * 0.8


def test_an_idle_keep_alive_connection_is_closed_after_the_header_timeout(daemon: Any) -> None:
    with socket.create_connection(address(daemon), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # keep-alive works
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # then half a head
        assert closed_after(sock, HEADER_TIMEOUT_S + 20) >= HEADER_TIMEOUT_S * 0.8


def test_a_stalled_body_is_a_408_after_the_header_timeout(
    daemon: Any, caplog: pytest.LogCaptureFixture
) -> None:
    limit = HEADER_TIMEOUT_S + 20
    before = counters(daemon)
    caplog.set_level(logging.ERROR)
    with socket.create_connection(address(daemon), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"messages": '
        )
        sock.settimeout(limit)
        reply = sock.recv(4096)
        waited = time.monotonic() - start
        assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
        assert b"request_timeout" in reply and waited >= HEADER_TIMEOUT_S * 0.8, waited
        with contextlib.suppress(OSError):  # the rest of the body, late: dropped, no error
            sock.sendall(b'[{"role": "user", "content": "late"}]}' + b" " * 60)
        # and the connection is closed with it, not after aiohttp's 10 s wait for the rest
        assert closed_after(sock, limit) < 5.0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert counters(daemon) == before


def test_connections_over_the_cap_are_closed_at_once(
    keyed: Any, caplog: pytest.LogCaptureFixture
) -> None:
    host, port = address(keyed)
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    held = [socket.create_connection((host, port), timeout=10) for _ in range(MAX_CONNECTIONS)]
    caplog.set_level(logging.INFO, "mlxcel.http")
    try:
        for sock in held:  # the first N work
            sock.sendall(request)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        for _ in range(3):  # a burst: each closed at once, one warning for all
            with socket.create_connection((host, port), timeout=10) as extra:
                start = time.monotonic()
                reply = b""
                try:
                    while chunk := extra.recv(4096):
                        reply += chunk
                except ConnectionResetError:
                    pass
                assert time.monotonic() - start < 5
            assert reply == b"" or reply.startswith(b"HTTP/1.1 503"), reply[:200]
            if reply:
                assert b"too_many_connections" in reply
        warnings = [r for r in caplog.records if "max_connections" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
        for sock in held:  # still served
            sock.sendall(request)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()

    def served() -> bool:
        try:
            return raw(keyed, "GET", "/health")[0] == 200
        except OSError:
            return False

    # the closed ones are released: new connections work
    wait_until(served, 20, 0.05, what="new connections served again")


# --- keys and header names -------------------------------------------------------------------


def test_a_non_ascii_key_is_a_401_or_works_when_it_is_the_key(keyed: Any) -> None:
    body = json.dumps({"messages": ASK, "max_tokens": 1}).encode()
    json_type = {"Content-Type": "application/json"}
    for token in ("é", "clé-秘", "秘密", "\udcff"):
        header = f"Bearer {token}".encode("utf-8", "surrogateescape")
        status, _, payload = raw(
            keyed, "POST", "/v1/chat/completions", {**json_type, "Authorization": header}, body
        )
        assert status == 401 and payload["error"]["code"] == "invalid_api_key", (token, payload)
    good = "Bearer clé-秘密".encode()
    status, _, payload = raw(
        keyed, "POST", "/v1/chat/completions", {**json_type, "Authorization": good}, body
    )
    assert status == 200, payload
    status, _, _ = raw(keyed, "GET", "/v1/models", {"x-api-key": "clé-秘密".encode()})
    assert status == 200
    assert keys_match("clé", "clé") and keys_match("cl\udce9", "clé")  # UTF-8 or Latin-1 bytes
    assert not keys_match("é", "clé") and not keys_match("\udcff", "x")


def test_a_cr_lf_in_an_unknown_field_name_never_reaches_a_header(daemon: Any) -> None:
    fields = {
        "x\r\nSet-Cookie: a=b": 1,
        "y\nz": 2,
        "é,ü": 3,
        **{f"f{i}" + "w" * 80: i for i in range(30)},
    }
    body = json.dumps({"messages": ASK, "max_tokens": 1, **fields}).encode()
    status, headers, payload = raw(
        daemon, "POST", "/v1/chat/completions", {"Content-Type": "application/json"}, body
    )
    assert status == 200, payload
    ignored = headers["X-Mlxcel-Ignored-Fields"]
    assert "\r" not in ignored and "\n" not in ignored and "Set-Cookie" not in headers
    assert ignored.startswith("x%0D%0ASet-Cookie%3A%20a%3Db, y%0Az, %C3%A9%2C%C3%BC, f0w")
    assert len(ignored) <= 1100 and ignored.endswith("more")
    assert all(32 < ord(c) < 127 or c == " " for c in ignored)
    assert header_list(["a", "b"]) == "a, b"


def test_the_daemon_still_serves_after_all_of_it(daemon: Any) -> None:
    status, _, payload = raw(
        daemon, "POST", "/v1/chat/completions", {"Content-Type": "application/json"},
        valid_body("/v1/chat/completions"),
    )  # fmt: skip
    assert status == 200 and payload["usage"]["completion_tokens"] >= 1
