"""Edge guards of the HTTP API (docs/reliability.md, "Hostile input"): who may talk to it and how.

- `host_middleware`: the `Host` header must name this machine (a loopback name or address,
  `--host`, an address the daemon is bound to, `--allowed-hosts`); anything else is
  `403 host_not_allowed`. A page on a DNS-rebinding name (evil.example re-pointed at 127.0.0.1)
  reaches the daemon with `Host: evil.example`, so it is refused whatever it asks.
- `origin_middleware`: a state-changing request (POST, PUT, DELETE, PATCH: every such route,
  present and future) from a web page whose origin the operator did not allow
  (`allowed_origins`) is `403 origin_not_allowed` unless its body is JSON. A browser sends
  JSON cross-site only after a CORS preflight, which such an origin fails; the types it sends
  without one (none at all, text/plain, a form, a blob's type) are refused here.
- `GuardedAppRunner`: connection limits below the request level: a connection has
  `header_timeout` seconds to send its first request head (aiohttp's keep-alive timeout, set
  to the same, bounds the idle time between requests and a later half-sent head), and at most
  `max_connections` are open at once (more get a 503 and are closed at once).
- `read_body`: a request body is read once, and one that stops arriving for `header_timeout`
  seconds is `408 request_timeout`.
- `keys_match`: API-key comparison in constant time that takes any characters.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import socket
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import psutil
from aiohttp import web
from mlxcel.daemon.server.errors import APIError

log = logging.getLogger("mlxcel.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

STATE_CHANGING_METHODS = frozenset({"POST", "PUT", "DELETE", "PATCH"})
ALL_INTERFACES = frozenset({"0.0.0.0", "::", ""})
INTERFACES_REFRESH_S = 10.0  # a miss re-reads the interface addresses at most this often


# --- Host ------------------------------------------------------------------------------------


def host_name(value: str) -> str | None:
    """The host of a `Host` header value, lowercased, without port, brackets or a final dot;
    None when it is not a host[:port]."""
    v = value.strip().lower()
    if v.startswith("["):  # [v6]:port
        end = v.find("]")
        if end < 0:
            return None
        name, rest = v[1:end], v[end + 1 :]
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return None
        return name or None
    if v.count(":") == 1:
        v, _, port = v.partition(":")
        if port and not port.isdigit():
            return None
    if v.endswith(".") and not v.endswith(".."):
        v = v[:-1]
    return v or None


def _canonical(name: str) -> str:
    """An address in its one spelling (zone ids dropped, v4-mapped v6 as v4), else the name."""
    ip = _address(name)
    return name if ip is None else str(ip)


def _address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(name.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: always loopback
        return True
    ip = _address(name)
    return ip is not None and ip.is_loopback


def interface_names() -> set[str]:
    """This machine's interface addresses and its host name (`--host 0.0.0.0`/`::`)."""
    names: set[str] = set()
    try:
        for addrs in psutil.net_if_addrs().values():
            for addr in addrs:
                if addr.family in (socket.AF_INET, socket.AF_INET6):
                    names.add(_canonical(addr.address.lower()))
    except (OSError, psutil.Error) as exc:
        log.warning("cannot list the network interfaces: %s", exc)
    hostname = socket.gethostname().lower().rstrip(".")
    if hostname:
        names.update({hostname, hostname.split(".", 1)[0], hostname.split(".", 1)[0] + ".local"})
    return names


class HostAllowlist:
    """Which `Host` header values the API answers (docs/reliability.md, "DNS rebinding").

    Always: `localhost`, `*.localhost`, 127.0.0.0/8, ::1; the configured `--host`; the
    addresses the daemon is bound to; `allowed` (`*`: any host). When the daemon listens on
    every interface (`--host 0.0.0.0` or `::`), also the machine's interface addresses and host
    name. A request without a `Host` header (HTTP/1.0) is answered: a browser always sends one.
    """

    def __init__(self, host: str = "127.0.0.1", allowed: Iterable[str] = ()) -> None:
        self.any = "*" in allowed
        self.all_interfaces = host.strip().lower() in ALL_INTERFACES
        self._fixed: set[str] = {_canonical(n) for n in (host_name(h) for h in allowed) if n}
        configured = host_name(host)
        if configured and not self.all_interfaces:
            self._fixed.add(_canonical(configured))
        self._interfaces: set[str] = set()
        self._read_at = -INTERFACES_REFRESH_S
        if self.all_interfaces:
            self._refresh()

    def bound(self, addresses: Iterable[Any]) -> None:
        """Add the addresses the listener is bound to (`AppRunner.addresses`)."""
        for addr in addresses:
            if isinstance(addr, tuple) and addr and isinstance(addr[0], str):
                self._fixed.add(_canonical(addr[0].lower()))

    def _refresh(self) -> None:
        self._interfaces = interface_names()
        self._read_at = time.monotonic()

    def allows(self, header: str | None) -> bool:
        if header is None:
            return True
        name = host_name(header)
        if name is None:
            return False
        if self.any or is_loopback_name(name):
            return True
        name = _canonical(name)
        if name in self._fixed or name in self._interfaces:
            return True
        if self.all_interfaces and time.monotonic() - self._read_at >= INTERFACES_REFRESH_S:
            self._refresh()  # an address gained since (DHCP, a VPN)
            return name in self._interfaces
        return False


def make_host_middleware(hosts: Callable[[web.Request], HostAllowlist]) -> Any:
    """A middleware answering `403 host_not_allowed` to a `Host` that `hosts(request)` refuses."""

    @web.middleware
    async def host_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        values = request.headers.getall("Host", [])
        allowlist = hosts(request)
        bad = next((v for v in values if not allowlist.allows(v)), None)
        if bad is not None or len(values) > 1:
            shown = (bad if bad is not None else ", ".join(values))[:100]
            raise APIError(
                403,
                f"Host {shown!r} is not this server (start it with --allowed-hosts to answer it)",
                "permission_error",
                "host_not_allowed",
            )
        return await handler(request)

    return host_middleware


# --- Origin ----------------------------------------------------------------------------------


def is_json_type(request: web.Request) -> bool:
    """The body says it is JSON: application/json or application/*+json."""
    if "Content-Type" not in request.headers:
        return False
    ctype = request.content_type
    return ctype == "application/json" or (
        ctype.startswith("application/") and ctype.endswith("+json")
    )


def origin_allowed(origin: str, allowed: frozenset[str]) -> bool:
    return "*" in allowed or origin.rstrip("/") in allowed


def make_origin_middleware(allowed: Callable[[web.Request], frozenset[str]]) -> Any:
    """A middleware refusing a state-changing request from a web page of an origin not in
    `allowed(request)` unless its body is JSON (`403 origin_not_allowed`)."""

    @web.middleware
    async def origin_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if (
            origin is not None
            and request.method in STATE_CHANGING_METHODS
            and not is_json_type(request)
            and not origin_allowed(origin, allowed(request))
        ):
            ctype = request.headers.get("Content-Type")
            what = "no Content-Type" if ctype is None else f"Content-Type {ctype[:80]!r}"
            raise APIError(
                403,
                f"a {request.method} from the web page {origin[:100]!r} with {what} is refused: "
                "send application/json (allowed_origins lists the pages that may call the API)",
                "permission_error",
                "origin_not_allowed",
            )
        return await handler(request)

    return origin_middleware


# --- bodies ----------------------------------------------------------------------------------

# the request's body once read (read_body reads the stream once)
BODY_KEY: Any = (
    web.RequestKey("mlxcel_body", bytes)
    if hasattr(web, "RequestKey")  # aiohttp >= 3.13; a plain key before
    else "mlxcel_body"
)


async def read_body(request: web.Request, idle_s: float, limit: int) -> bytes:
    """The whole body, read once (later calls get the same bytes). A body that stops arriving
    for `idle_s` seconds is `408 request_timeout`, and the connection closes as soon as that
    is sent (`_end_stalled_body`); over `limit` bytes, aiohttp's 413."""
    cached = request.get(BODY_KEY)
    if cached is not None:
        return cached
    body = bytearray()
    while True:
        try:
            chunk = await asyncio.wait_for(request.content.readany(), idle_s)
        except asyncio.TimeoutError:
            _end_stalled_body(request)
            raise APIError(
                408,
                f"the request body stopped arriving (nothing for {idle_s:g} s: header_timeout)",
                code="request_timeout",
                headers={"Connection": "close"},
            ) from None
        if not chunk:
            break
        body += chunk
        if limit and len(body) > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(body))
    request[BODY_KEY] = data = bytes(body)
    return data


def _end_stalled_body(request: web.Request) -> None:
    """The rest of a stalled body is not coming: whatever else the client sends on this
    connection is dropped and the body ends here, so aiohttp closes the connection once the
    408 is out instead of waiting up to its lingering time (10 s) for the rest, a connection
    slot held all along. Only behind `GuardedProtocol` (the daemon's sites)."""
    transport = request.transport
    protocol = transport.get_protocol() if transport is not None else None
    if isinstance(protocol, GuardedProtocol):
        protocol.drop_input()
        request.content.feed_eof()


# --- keys ------------------------------------------------------------------------------------


def keys_match(token: str, key: str) -> bool:
    """`token` (a header value, decoded as UTF-8 with surrogateescape) equals `key`, compared in
    constant time. A non-ASCII key matches when the client sent it as UTF-8 or as Latin-1 (what
    Python's http.client sends)."""
    got = token.encode("utf-8", "surrogateescape")
    ok = hmac.compare_digest(got, key.encode("utf-8", "surrogateescape"))
    try:
        latin = key.encode("latin-1")
    except UnicodeEncodeError:
        return ok
    return hmac.compare_digest(got, latin) or ok


# --- header names ----------------------------------------------------------------------------

TOKEN_SAFE = "!#$&'*+-.^_`|~"  # RFC 9110 tchar punctuation but `%` (the escape) and `,`
MAX_HEADER_NAME_CHARS = 64
MAX_HEADER_CHARS = 1024


def header_list(names: Iterable[str]) -> str:
    """`names` as one header value: each percent-escaped to RFC 9110 token characters (no CR,
    LF or control character can reach the header), cut to 64 characters, the whole at most
    about 1 KiB (then `+N more`)."""
    out: list[str] = []
    items = list(names)
    size = 0
    for i, name in enumerate(items):
        text = urllib.parse.quote(str(name), safe=TOKEN_SAFE)
        if len(text) > MAX_HEADER_NAME_CHARS:
            text = text[: MAX_HEADER_NAME_CHARS - 3] + "..."
        if size + len(text) + 2 > MAX_HEADER_CHARS:
            out.append(f"+{len(items) - i} more")
            break
        out.append(text)
        size += len(text) + 2
    return ", ".join(out)


# --- connections -----------------------------------------------------------------------------

_OVER_CAPACITY_BODY = (
    b'{"error": {"message": "too many open connections (max_connections)", '
    b'"type": "server_error", "code": "too_many_connections"}}'
)
OVER_CAPACITY_REPLY = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: application/json\r\n"
    b"Connection: close\r\n"
    b"Retry-After: 1\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_OVER_CAPACITY_BODY), _OVER_CAPACITY_BODY)
)


class ConnectionLimits:
    """Counts the open connections; logs once per burst of refusals."""

    def __init__(self, max_connections: int, header_timeout: float) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.open = 0
        self.refused = 0  # in the current burst
        self.timed_out = 0

    def admit(self) -> bool:
        if self.open < self.max_connections:
            self.open += 1
            return True
        if self.refused == 0:
            log.warning(
                "%d connections open (max_connections): closing new ones until some end",
                self.open,
            )
        self.refused += 1
        return False

    def release(self) -> None:
        self.open -= 1
        if self.refused and self.open < self.max_connections:
            log.info("accepting connections again (%d refused)", self.refused)
            self.refused = 0


class GuardedProtocol(asyncio.Protocol):
    """aiohttp's protocol for one connection behind the limits: over `max_connections` it never
    starts; until its first request head has arrived (an empty line) a timer closes it after
    `header_timeout`. Everything else goes to aiohttp's RequestHandler unchanged."""

    def __init__(self, inner: Any, limits: ConnectionLimits) -> None:
        self.inner = inner
        self.limits = limits
        self.admitted = False
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""  # the last bytes seen, for an empty line split across reads
        self._dropping = False  # after a stalled body: nothing more reaches aiohttp

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if not self.limits.admit():
            transport.write(OVER_CAPACITY_REPLY)  # type: ignore[attr-defined]
            transport.close()
            return
        self.admitted = True
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.limits.header_timeout, self._head_timed_out)
        self.inner.connection_made(transport)

    def _head_timed_out(self) -> None:
        self._timer = None
        self.limits.timed_out += 1
        log.info("closing a connection: no request head within %g s", self.limits.header_timeout)
        if self.transport is not None:
            self.transport.abort()

    def drop_input(self) -> None:
        """From now on the client's bytes are dropped (this connection ends with the response
        being written; read_body's stalled body)."""
        self._dropping = True

    def data_received(self, data: bytes) -> None:
        if not self.admitted or self._dropping:
            return
        if self._timer is not None:
            seen = self._tail + data
            if b"\n\n" in seen or b"\n\r\n" in seen:
                self._timer.cancel()
                self._timer = None
            else:
                self._tail = seen[-2:]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if not self.admitted:
            return None
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.admitted:
            return
        self.admitted = False
        self.limits.release()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()


class GuardedServer:
    """The protocol factory the sites listen with: aiohttp's `Server`, each connection wrapped
    in a `GuardedProtocol`."""

    def __init__(self, server: web.Server, limits: ConnectionLimits) -> None:
        self.server = server
        self.limits = limits

    def __call__(self) -> GuardedProtocol:
        return GuardedProtocol(self.server(), self.limits)


class GuardedAppRunner(web.AppRunner):
    """`web.AppRunner` whose sites accept connections through `GuardedServer`
    (`max_connections`, `header_timeout`); aiohttp's keep-alive timeout is `header_timeout`
    too, so an idle connection, or a later half-sent head, is closed after as long."""

    def __init__(
        self, app: web.Application, *, header_timeout: float, max_connections: int, **kwargs: Any
    ) -> None:
        super().__init__(app, keepalive_timeout=header_timeout, **kwargs)
        self.limits = ConnectionLimits(max_connections, header_timeout)
        self._guarded: GuardedServer | None = None

    @property
    def server(self) -> Any:  # the sites' protocol factory
        inner = super().server
        if inner is None:
            return None
        if self._guarded is None or self._guarded.server is not inner:
            self._guarded = GuardedServer(inner, self.limits)
        return self._guarded
