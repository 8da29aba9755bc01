"""The foreground serving process: pid lock, HTTP listener, model, engine, control socket,
signals and graceful drain.

Start order: lock the pid file → listen on HTTP (so /health answers 503 while loading) →
load the model and build the engine in a worker thread → start the engine thread → open the
control socket → mark ready. Stop order (SIGTERM, SIGINT, `shutdown` over the socket):
refuse new requests → drain the engine → close the socket → close HTTP → remove files.
A startup failure logs one `FATAL <reason>` line and exits 1, never a traceback.

Why one module: `Daemon` is the process's start order, signals, drain and stop order, one
sequence whose steps depend on each other's state (the pid lock, the listeners, the host, the
control socket).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import logging.handlers
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from mlxcel.daemon.hosting.drain import DEFAULT_DRAIN_TIMEOUT_S, StopRequest
from mlxcel.daemon.process.lifecycle import (
    DETACHED_ENV,
    FATAL_MARK,
    LifecycleError,
    PidLock,
    PrivateRotatingFileHandler,
    raise_open_files_limit,
    write_state,
)
from mlxcel.daemon.server.control_server import ControlServer
from mlxcel.daemon.server.daemon_runtime import DaemonIdentity, DaemonRuntime
from mlxcel.daemon.server.guards import GuardedAppRunner, HostAllowlist
from mlxcel.daemon.server.history import CoarseHistory
from mlxcel.daemon.server.http_app import ModelContext, ServingState, make_app
from mlxcel.daemon.server.log_stream import LogHub
from mlxcel.daemon.server.metrics import DaemonMetrics
from mlxcel.daemon.server.openai_schema import SamplingDefaults
from mlxcel.shared import __version__
from mlxcel.shared.config import ServingConfig
from mlxcel.shared.paths import Paths
from mlxcel.shared.protocol import EV_SHUTDOWN
from mlxcel.shared.switches import switch_flag

if TYPE_CHECKING:  # annotations only: this module must not import mlx before ensure_fast_blas
    from mlxcel.daemon.engine.bridge import EngineBridge
    from mlxcel.daemon.engine.memory import MlxLimits
    from mlxcel.daemon.hosting.host import ModelHost

log = logging.getLogger("mlxcel.daemon")

LOG_MAX_BYTES = 10 * 1024 * 1024
LOG_BACKUPS = 3
OBSERVATION_PERIOD_S = 1.0


class StartupError(RuntimeError):
    """A one-line reason the daemon cannot start."""


def setup_logging(log_file: Path, to_stderr: bool) -> None:
    log_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers: list[logging.Handler] = [
        PrivateRotatingFileHandler(  # 0600: docs/reliability.md
            log_file, maxBytes=LOG_MAX_BYTES, backupCount=LOG_BACKUPS, encoding="utf-8"
        )
    ]
    if to_stderr:
        handlers.append(logging.StreamHandler(sys.stderr))
    root = logging.getLogger()
    for handler in handlers:
        handler.setFormatter(fmt)
        root.addHandler(handler)
    root.setLevel(logging.INFO)


class Daemon:
    """One serving run (event-loop thread)."""

    def __init__(self, cfg: ServingConfig, paths: Paths, socket_path: Path, argv: list[str]):
        if cfg.prompt_cache_dir is None:  # the disk tier lives in the user cache dir
            cfg = cfg.replace(prompt_cache_dir=str(paths.prompt_cache_dir))
        self.cfg = cfg
        self.paths = paths
        self.socket_path = socket_path
        self.argv = argv
        self.stop_event = asyncio.Event()
        self.ready_event = asyncio.Event()
        self.stop = StopRequest()
        self.host: ModelHost | None = None  # every model, the first included (hosting/host.py)
        self.state = ServingState(
            api_key=cfg.api_key,
            strict_api=cfg.strict_api,
            allowed_origins=frozenset(cfg.allowed_origins),
            hosts=HostAllowlist(cfg.host, cfg.allowed_hosts),
            header_timeout=cfg.header_timeout,
            readonly_api_key=cfg.readonly_api_key,
            key_lanes=_key_lanes(cfg),
            sampling_defaults=SamplingDefaults.with_set(cfg.sampling_set()),
            metrics=DaemonMetrics(
                self._engine_snapshot, self._engine_observations, self._engine_rejections
            ),
        )
        self.http_url = ""
        self._runner: web.AppRunner | None = None
        self._control: ControlServer | None = None
        self._state_doc: dict[str, Any] = {}
        self._mlx_limits: MlxLimits | None = None  # while the engine runs
        self.logs: LogHub | None = None  # the log lines `logs.subscribe` streams
        self.history: CoarseHistory | None = None
        self._warming: asyncio.Future[None] | None = None  # --warm-prompts, while it runs
        self.warm_result: dict[str, int] | None = None  # what warming did, once done

    @property
    def bridge(self) -> EngineBridge | None:
        """The primary model's bridge (requests that name no model); None while none is."""
        primary = None if self.host is None else self.host.primary
        return None if primary is None else primary.bridge

    def _engine_snapshot(self) -> Any:
        return None if self.host is None else self.host.facade.snapshot()

    def _engine_observations(self) -> list[Any]:
        return [] if self.host is None else self.host.facade.drain_observations()

    def _engine_rejections(self) -> dict[str, int] | None:
        return None if self.host is None else self.host.facade.rejections()

    def request_stop(self, drain: bool = True, timeout: float | None = None) -> None:
        if self.stop_event.is_set():
            self.stop.drain = self.stop.drain and drain  # a second request may only hurry it
            return
        self.stop = StopRequest(drain, DEFAULT_DRAIN_TIMEOUT_S if timeout is None else timeout)
        self.stop_event.set()

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.stop_event.is_set():
            log.info("%s again: stopping without waiting for requests", name)
            self.request_stop(drain=False)
            return
        log.info("%s: draining in-flight requests, then exiting", name)
        self.request_stop(drain=True)

    def _write_state(self, status: str) -> None:
        self._state_doc = {
            "pid": os.getpid(),
            "status": status,
            "version": __version__,
            "http_url": self.http_url,
            "socket": str(self.socket_path),
            "log_file": str(self.paths.log_file),
            "model": self.cfg.model,
            "started_at": self._state_doc.get("started_at", time.time()),
            "argv": self.argv,
            "auth": bool(self.cfg.api_key or self.cfg.api_keys_file),
        }
        write_state(self.paths, self._state_doc)

    async def run(self, install_signals: bool = True) -> int:
        loop = asyncio.get_running_loop()
        self.logs = LogHub(loop).install()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            warm = self._read_warm_prompts()  # a bad file stops the start at once
            await self._listen_http()
            self._write_state("loading")
            runtime = self._wire_host()
            resident = await self._load_first()
            if resident is None:
                return 0  # stopped while loading
            await self._go_live(resident, runtime)
            del resident  # the host owns the model: unloading it must free it
            log.info("ready: %s, socket %s", self.http_url, self.socket_path)
            self.ready_event.set()
            if warm:
                self._warming = asyncio.ensure_future(self._warm(warm))
            await self._serve_until_stopped()
        finally:
            await self._teardown()
        return 0

    async def _listen_http(self) -> None:
        cfg = self.cfg
        app = make_app(self.state)
        self._runner = GuardedAppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            header_timeout=cfg.header_timeout,
            max_connections=cfg.max_connections,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.host, cfg.port)
        try:
            await site.start()
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StartupError(f"port {cfg.port} on {cfg.host} is already in use") from None
            raise StartupError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror}") from None
        self.state.hosts.bound(self._runner.addresses)
        port = self._runner.addresses[0][1]
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        self.http_url = f"http://{host}:{port}"
        log.info("listening on %s (loading %s)", self.http_url, cfg.model)

    def _wire_host(self) -> DaemonRuntime:
        """The model host, wired to the runtime, the HTTP state and the metrics before the
        first model loads (the runtime's identity names the model once it has loaded)."""
        identity = DaemonIdentity(
            model=self.cfg.model,
            model_path="",
            family="",
            backend="",
            dtype="",
            blas="",
            http_url=self.http_url,
            socket_path=str(self.socket_path),
            service=_service_kind(),
        )
        host = self.host = _make_host(self.cfg)
        runtime = DaemonRuntime(
            host.facade, identity, self.cfg, self.paths.config_file, self.request_stop
        )
        host.make_context = lambda ld, br: _model_context(ld, br, runtime, host.cfg)
        host.add_event_sink(runtime.publish)
        host.on_primary_change(lambda resident: self._on_primary(resident, runtime))
        runtime.host = host
        self.state.host = host
        from mlxcel.daemon.hosting.collector import HostCollector

        self.state.metrics.registry.register(HostCollector(host))
        return runtime

    async def _load_first(self) -> Any:
        """The daemon's model, loaded by the host; None when a stop came first."""
        from mlxcel.daemon.models.info import ModelLoadError

        assert self.host is not None  # _wire_host made it
        waiter = asyncio.ensure_future(self.host.load_first(self.cfg.model))
        stopper = asyncio.ensure_future(self.stop_event.wait())
        either: set[asyncio.Future[Any]] = {waiter, stopper}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not waiter.done():
            log.info("stopped while the model was loading")
            waiter.cancel()
            return None
        try:
            return waiter.result()
        except ModelLoadError as exc:
            raise StartupError(str(exc)) from None

    async def _go_live(self, resident: Any, runtime: DaemonRuntime) -> None:
        """The control socket, the history and MLX's limits, once the first model serves."""
        self._control = ControlServer(runtime, self.socket_path, logs=self.logs)
        try:
            await self._control.start()
        except (LifecycleError, OSError) as exc:
            raise StartupError(f"control socket {self.socket_path}: {exc}") from None
        runtime.add_event_sink(self._control.broadcast)
        self.state.control = self._control  # /v1/control (remote consoles) from here on
        self.history = CoarseHistory(self._engine_snapshot)  # `history`: 15 min of 10 s points
        self._control.history = self.history
        self.history.start()
        eff = resident.bridge.snapshot().config
        from mlxcel.daemon.engine.memory import MlxLimits

        self._mlx_limits = MlxLimits.engage(eff.kv_cache_budget, eff.prompt_cache_bytes)
        if eff.parallel_clamp_reason:
            log.warning("parallel clamped to %d: %s", eff.parallel, eff.parallel_clamp_reason)
        info = resident.loaded.info
        log.info(
            "model %s (%s, %s, %s, blas %s); effective config %s",
            info.name,
            info.family,
            info.dtype,
            info.backend,
            info.blas,
            eff.to_dict(),
        )
        self._write_state("ready")

    def _on_primary(self, resident: Any, runtime: DaemonRuntime) -> None:
        """The model requests without a name go to (and status names) changed."""
        if resident is not None:
            info = resident.loaded.info
            runtime.set_identity(
                dataclasses.replace(
                    runtime.identity,
                    model=info.name,
                    model_path=info.path,
                    family=info.family,
                    backend=info.backend,
                    dtype=info.dtype_label,
                    blas=info.blas,
                )
            )

    def _read_warm_prompts(self) -> list[Any]:
        if not self.cfg.warm_prompts:
            return []
        from mlxcel.daemon.server.warm import WarmPromptsError, read_warm_prompts

        try:
            return read_warm_prompts(self.cfg.warm_prompts)
        except WarmPromptsError as exc:
            raise StartupError(str(exc)) from None

    async def _warm(self, items: list[Any]) -> None:
        """Prefill the warm prompts (docs/tuning.md), while the daemon already serves."""
        from mlxcel.daemon.server.warm import warm_prompts

        ctx = self.state.model
        if ctx is None:
            return
        if getattr(ctx.info, "kind", "chat") == "embedding":
            log.warning("--warm-prompts ignored: %s is an embedding model", ctx.name)
            return
        try:
            self.warm_result = await warm_prompts(items, self.state, ctx)
        except Exception:
            log.exception("warming the prompt cache failed")

    async def _serve_until_stopped(self) -> None:
        while not self.stop_event.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stop_event.wait(), OBSERVATION_PERIOD_S)
            self.state.metrics.absorb_observations()

    async def _teardown(self) -> None:
        self.state.draining = True
        if self._warming is not None:
            self._warming.cancel()
        if self._control is not None:
            self._control.broadcast(EV_SHUTDOWN, {"drain": self.stop.drain})
        if self.host is not None:  # every model: the one drain path (hosting/drain.py)
            log.info("stopping: drain=%s, timeout %.0f s", self.stop.drain, self.stop.timeout)
            await self.host.close(self.stop)
        if self._mlx_limits is not None:
            self._mlx_limits.restore()  # the engine has stopped: MLX's previous limits
        if self.history is not None:
            await self.history.stop()
        if self._control is not None:
            await self._control.close()
        if self._runner is not None:
            await self._runner.cleanup()
        with contextlib.suppress(FileNotFoundError):
            self.paths.state_file.unlink()
        log.info("stopped")
        if self.logs is not None:
            self.logs.uninstall()


def _key_lanes(cfg: ServingConfig) -> dict[str, str]:
    """`--api-keys-file`: each key's default lane (read again here: the CLI checked it)."""
    if not cfg.api_keys_file:
        return {}
    from mlxcel.daemon.process.option_sources import read_api_keys_file

    return read_api_keys_file(Path(cfg.api_keys_file).expanduser())


def load_engine(cfg: ServingConfig, spec: str) -> tuple[Any, Any, Any]:
    """(LoadedModel, Engine, EngineBridge) for model `spec`; the bridge not started yet."""
    from mlxcel.daemon.engine.bridge import EngineBridge
    from mlxcel.daemon.engine.core import Engine
    from mlxcel.daemon.engine.disk_cache import open_tier
    from mlxcel.daemon.models import load_model

    loaded = load_model(spec, cfg.dtype, progress=log.info)
    info = loaded.info
    # an encoder: no slots, KV or prompt cache (models/encoder/encoder_engine.py)
    if info.kind == "embedding":
        from mlxcel.daemon.models.encoder.encoder_engine import EncoderEngine

        def make_encoder(config: ServingConfig) -> EncoderEngine:
            """An encoder engine on the loaded weights: the first, and any the watchdog starts."""
            return EncoderEngine(loaded.model, config, info.context_length)

        encoder = make_encoder(cfg)
        # EncoderEngine stands in for Engine structurally, all that the bridge calls on it
        bridge = EngineBridge(encoder, make_engine=make_encoder)  # type: ignore[arg-type]
        return loaded, encoder, bridge
    draft = load_draft(cfg, loaded, spec)
    # Keyed to the forward plan too: a KV the float32 path wrote is never read by the quantized
    # one (their values differ in the last bits), nor one of the native steps by the MLX path.
    weights_path = f"{info.dtype} | {info.forward}" if info.forward else info.dtype

    def make_engine(config: ServingConfig) -> Engine:
        """An engine on the loaded weights: the first, and any the step watchdog starts."""
        engine = Engine(
            loaded.model,
            config,
            info.can_batch,
            info.batch_reason,
            info.context_length,
            tokenizer=loaded.tokenizer,  # for JSON-schema grammars
            draft=draft.model if draft is not None else None,
        )
        tier = open_tier(config, info.path, weights_path, loaded.model, engine.runner)
        engine.attach_disk_tier(tier)
        return engine

    engine = make_engine(cfg)
    return loaded, engine, EngineBridge(engine, make_engine=make_engine)


# The draft models loaded (`--draft-model`), by (spec, dtype): one copy of the weights serves
# every model that shares its tokenizer, and every engine the watchdog starts.
_DRAFTS: dict[tuple[str, str], Any] = {}
_DRAFTS_LOCK = threading.Lock()


def load_draft(cfg: ServingConfig, loaded: Any, spec: str) -> Any | None:
    """The draft model (a LoadedModel) for `loaded`, model `spec`: None without
    `--draft-model`, for a family that cannot batch, or (logged) for a model whose tokenizer
    the draft model does not share. For the daemon's own model (`--model`) a draft model that
    cannot draft for it is a load error that names why."""
    if not cfg.draft_model or not loaded.info.can_batch:
        return None
    from mlxcel.daemon.engine.draft_model import DraftModelError, check_pair
    from mlxcel.daemon.models import ModelLoadError, load_model

    key = (cfg.draft_model, cfg.dtype)
    with _DRAFTS_LOCK:
        draft = _DRAFTS.get(key)
        if draft is None:
            log.info("loading draft model %s", cfg.draft_model)
            try:
                draft = load_model(cfg.draft_model, cfg.dtype, progress=log.info)
            except ModelLoadError as exc:
                raise ModelLoadError(f"draft model {cfg.draft_model}: {exc}") from None
            _DRAFTS[key] = draft
    try:
        if draft.info.kind == "embedding" or not draft.info.can_batch:
            why = draft.info.batch_reason or "an embedding model"
            raise DraftModelError(f"it cannot batch ({why})")
        check_pair(loaded.tokenizer, draft.tokenizer, draft.model)
    except DraftModelError as exc:
        message = f"draft model {cfg.draft_model} cannot draft for {spec}: {exc}"
        if spec == cfg.model:
            raise ModelLoadError(message) from None
        log.warning("%s; speculation drafts by prompt lookup for it", message)
        return None
    log.info("draft model %s drafts for %s", cfg.draft_model, spec)
    return draft


def _make_host(cfg: ServingConfig) -> ModelHost:
    from mlxcel.daemon.hosting.host import ModelHost

    def loader(spec: str) -> tuple[Any, Any, Any]:
        if cfg.hosts:  # one model across several ranks (docs/distributed.md)
            return _load_group(host.cfg)
        return load_engine(host.cfg, spec)

    host = ModelHost(
        cfg,
        loader=loader,
        make_context=None,
        keep_alive_s=cfg.keep_alive,
        max_loaded=cfg.max_loaded_models,
        fixed=bool(getattr(cfg, "hosts", None)),  # a distributed group serves its one model
    )
    return host


def _load_group(cfg: ServingConfig) -> tuple[Any, Any, Any]:
    from mlxcel.daemon.distributed.hosts import HostsError
    from mlxcel.daemon.distributed.launch import GroupStartError, load_group
    from mlxcel.daemon.engine.bridge import EngineBridge
    from mlxcel.daemon.models import ModelLoadError
    from mlxcel.shared.paths import get_paths

    try:
        loaded, engine, _ranks = load_group(cfg, get_paths().log_file.parent)
    except (HostsError, GroupStartError, ModelLoadError) as exc:
        raise StartupError(str(exc)) from None
    bridge = EngineBridge(engine)
    engine.start_watchdog(bridge)
    return loaded, engine, bridge


def _model_context(loaded: Any, bridge: Any, runtime: DaemonRuntime, cfg: ServingConfig):
    tokenizer = loaded.tokenizer
    eos = frozenset(int(t) for t in tokenizer.eos_token_ids)
    special = frozenset(int(t) for t in getattr(tokenizer, "all_special_ids", []) or [])
    vocab = len(tokenizer)
    embed_rows = getattr(getattr(loaded.model, "args", None), "vocab_size", None)
    if isinstance(embed_rows, int) and embed_rows > 0:
        vocab = min(vocab, embed_rows)
    names = {loaded.info.name, cfg.model, Path(loaded.info.path).name}
    return ModelContext(
        info=loaded.info,
        name=loaded.info.name,
        names=frozenset(n for n in names if n),
        tokenizer=tokenizer,
        vocab_size=vocab,
        eos_ids=eos,
        skip_ids=eos | special,
        bridge=bridge,
        runtime=runtime,
        created=int(time.time()),
    )


def _service_kind() -> str | None:
    try:
        from mlxcel.daemon.process.service_units import managed_by_service
    except ImportError:
        return None
    return managed_by_service()


def fatal(reason: str) -> int:
    log.error("%s%s", FATAL_MARK, reason)
    return 1


def serve(cfg: ServingConfig, paths: Paths, socket_path: Path, argv: list[str]) -> int:
    """Run the daemon in this process until it is stopped; returns the exit status."""
    setup_logging(paths.log_file, to_stderr=not switch_flag(DETACHED_ENV))
    log.info("mlxcel-daemon %s starting (pid %d)", __version__, os.getpid())
    from mlxcel.daemon.mlx_lm_compat import untested_version_warning
    from mlxcel.daemon.process.platform_check import check_runtime

    problem = check_runtime()  # imports mlx_lm, which sets RLIMIT_NOFILE to (2048, 4096)
    if problem is not None:
        return fatal(problem)
    untested = untested_version_warning()  # a newer mlx-lm may have moved its private names
    if untested is not None:
        log.warning("%s", untested)
    before, after = raise_open_files_limit()
    if after != before:
        log.info("open files limit raised from %d to %d", before, after)
    lock = PidLock(paths.pid_file)
    try:
        lock.acquire()
    except LifecycleError as exc:
        return fatal(str(exc))
    with contextlib.suppress(FileNotFoundError):
        paths.state_file.unlink()  # a killed daemon's leftover
    try:
        return asyncio.run(Daemon(cfg, paths, socket_path, argv).run())
    except StartupError as exc:
        return fatal(str(exc))
    except Exception as exc:
        log.exception("the daemon failed")
        return fatal(f"{type(exc).__name__}: {exc}")
    finally:
        lock.release()
