"""Background running: a systemd user unit (Linux) or a launchd agent (macOS).

`mlxcel-daemon install-service` renders the platform's template from `assets/`, writes it and
has the service manager load it; `uninstall-service` undoes that. Every service-manager call
goes through a `Runner`, so tests record the calls while the file writes stay real. The
rendered unit runs `<this python> -m mlxcel.daemon.cli start --foreground` and sets
`MLXCEL_SERVICE=<kind>` so the daemon (and `status`) can tell that a service manages it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal
from xml.sax.saxutils import escape as xml_escape

from mlxcel.shared.paths import get_paths
from mlxcel.shared.switches import switch_value

ServiceKind = Literal["systemd", "launchd"]
Runner = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]

UNIT_NAME = "mlxcel.service"
LAUNCHD_LABEL = "com.mlxcel.daemon"
SERVICE_ENV = "MLXCEL_SERVICE"
# Seconds the manager waits for the SIGTERM drain before it kills the daemon.
STOP_TIMEOUT_S = 30
# launchd: the agent's soft open-files limit (macOS defaults to 256; OPEN_MAX is 10240).
LAUNCHD_NUMBER_OF_FILES = 10240
# launchd: how long a bootstrap refused with EIO (the old agent still unloading) is retried.
BOOTSTRAP_RETRY_S = 10.0
# Variables of the installing shell that the service keeps, so it finds the same files.
PASSED_ENV = ("PATH", "MLXCEL_HOME", "MLXCEL_SOCKET")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
_TEMPLATES: dict[ServiceKind, str] = {
    "systemd": "mlxcel.service.in",
    "launchd": "com.mlxcel.daemon.plist.in",
}
DETECT = "detect"


class ServiceError(RuntimeError):
    """A service-manager command failed; the message says which and why."""


@dataclass(frozen=True)
class ServiceSpec:
    kind: ServiceKind
    path: Path
    text: str


@dataclass(frozen=True)
class Command:
    """One service-manager call; a failing `must_succeed` call aborts the action."""

    argv: tuple[str, ...]
    must_succeed: bool = True


@dataclass(frozen=True)
class ServiceStatus:
    kind: ServiceKind
    path: Path
    installed: bool
    active: bool | None  # None: no service manager here to ask


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False, timeout=60)


# ---------------------------------------------------------------- where and what


def host_kind(platform: str = sys.platform) -> ServiceKind:
    return "launchd" if platform == "darwin" else "systemd"


def service_manager() -> ServiceKind | None:
    """The service manager usable on this host, or None (e.g. a container without systemd)."""
    if sys.platform == "darwin":
        return "launchd" if shutil.which("launchctl") else None
    # sd_booted(): systemd is PID 1 exactly when this directory exists.
    if Path("/run/systemd/system").is_dir() and shutil.which("systemctl"):
        return "systemd"
    return None


def _home() -> Path:
    home = os.environ.get("HOME")
    return Path(home) if home else Path.home()


def unit_path(kind: ServiceKind) -> Path:
    if kind == "launchd":
        return _home() / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
    xdg = os.environ.get("XDG_CONFIG_HOME", "")
    # The XDG spec says a relative XDG_CONFIG_HOME is invalid and must be ignored.
    config = Path(xdg) if os.path.isabs(xdg) else _home() / ".config"
    return config / "systemd" / "user" / UNIT_NAME


def daemon_argv(python: str | None = None) -> list[str]:
    # abspath, not resolve: a venv's python is a symlink whose target has no venv.
    exe = os.path.abspath(python or sys.executable)
    return [exe, "-m", "mlxcel.daemon.cli", "start", "--foreground"]


def service_environment(kind: ServiceKind) -> dict[str, str]:
    env = {name: os.environ[name] for name in PASSED_ENV if os.environ.get(name)}
    env.setdefault("PATH", DEFAULT_PATH)
    env["PYTHONUNBUFFERED"] = "1"
    env[SERVICE_ENV] = kind
    return env


# ---------------------------------------------------------------- rendering


def _template(kind: ServiceKind) -> str:
    # one name per joinpath: Traversable.joinpath takes several only from Python 3.11
    assets = resources.files("mlxcel.daemon").joinpath("assets")
    return assets.joinpath(_TEMPLATES[kind]).read_text()


def _check_line(value: str) -> str:
    if "\n" in value or "\r" in value or "\0" in value:
        raise ValueError(f"a service unit value cannot hold a line break: {value!r}")
    return value


def _systemd_word(word: str, *, executable: bool = False) -> str:
    """One ExecStart word. % is a specifier everywhere; $ expands in arguments only."""
    text = _check_line(word).replace("%", "%%")
    if executable:
        if any(c in text for c in "\\\"'"):
            raise ValueError(f"systemd cannot run an executable whose path has quotes: {word!r}")
    else:
        text = text.replace("$", "$$")
    if text and not any(c in text for c in " \t\"\\';"):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _systemd_env(name: str, value: str) -> str:
    pair = _check_line(f"{name}={value}").replace("%", "%%")
    return 'Environment="' + pair.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_unit(
    kind: ServiceKind, argv: Sequence[str], environment: Mapping[str, str], log_dir: Path
) -> str:
    """The unit text for `kind`, whatever the host (tests render both)."""
    if kind == "systemd":
        values = _systemd_values(argv, environment)
    else:
        values = _launchd_values(argv, environment, log_dir)
    text = _template(kind)
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    return text


def _systemd_values(argv: Sequence[str], environment: Mapping[str, str]) -> dict[str, str]:
    return {
        "EXEC_START": " ".join(_systemd_word(a, executable=i == 0) for i, a in enumerate(argv)),
        "ENVIRONMENT": "\n".join(_systemd_env(k, v) for k, v in environment.items()),
        "STOP_TIMEOUT": str(STOP_TIMEOUT_S),
    }


def _launchd_values(
    argv: Sequence[str], environment: Mapping[str, str], log_dir: Path
) -> dict[str, str]:
    def xml(value: str) -> str:
        return xml_escape(_check_line(value))

    env_lines = (
        f"\t\t<key>{xml(k)}</key>\n\t\t<string>{xml(v)}</string>" for k, v in environment.items()
    )
    return {
        "LABEL": LAUNCHD_LABEL,
        "PROGRAM_ARGUMENTS": "\n".join(f"\t\t<string>{xml(a)}</string>" for a in argv),
        "ENVIRONMENT": "\n".join(env_lines),
        "WORKING_DIRECTORY": xml(str(_home())),
        "STOP_TIMEOUT": str(STOP_TIMEOUT_S),
        "NUMBER_OF_FILES": str(LAUNCHD_NUMBER_OF_FILES),
        "STDOUT_PATH": xml(str(log_dir / "service.out.log")),
        "STDERR_PATH": xml(str(log_dir / "service.err.log")),
    }


def build_spec(kind: ServiceKind) -> ServiceSpec:
    text = render_unit(kind, daemon_argv(), service_environment(kind), get_paths().log_dir)
    return ServiceSpec(kind, unit_path(kind), text)


# ---------------------------------------------------------------- manager commands


def _launchd_domain() -> str:
    return f"gui/{os.getuid()}"


def install_commands(
    kind: ServiceKind, path: Path, *, start: bool, reinstall: bool
) -> list[Command]:
    """The manager calls that load the written unit."""
    if kind == "systemd":
        cmds = [_systemctl("daemon-reload")]
        if not start:
            return [*cmds, _systemctl("enable", UNIT_NAME)]
        if reinstall:  # enable --now would leave the old unit running
            return [*cmds, _systemctl("enable", UNIT_NAME), _systemctl("restart", UNIT_NAME)]
        return [*cmds, _systemctl("enable", "--now", UNIT_NAME)]
    target = f"{_launchd_domain()}/{LAUNCHD_LABEL}"
    cmds = [Command(("launchctl", "enable", target))]
    if not start:  # LaunchAgents are loaded at the next login
        return cmds
    return [
        *cmds,
        Command(("launchctl", "bootout", target), must_succeed=False),  # not loaded yet: fine
        Command(("launchctl", "bootstrap", _launchd_domain(), str(path))),
    ]


def uninstall_commands(kind: ServiceKind) -> list[Command]:
    if kind == "systemd":
        return [_systemctl("disable", "--now", UNIT_NAME, must_succeed=False)]
    target = f"{_launchd_domain()}/{LAUNCHD_LABEL}"
    return [Command(("launchctl", "bootout", target), must_succeed=False)]


def _systemctl(*words: str, must_succeed: bool = True) -> Command:
    return Command(("systemctl", "--user", *words), must_succeed)


def _run_all(commands: list[Command], runner: Runner) -> None:
    for cmd in commands:
        result = runner(cmd.argv)
        if cmd.must_succeed and result.returncode != 0:
            reason = (result.stderr or result.stdout or "").strip() or f"exit {result.returncode}"
            raise ServiceError(f"`{' '.join(cmd.argv)}` failed: {reason}")


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _agent_pid() -> int | None:
    """The pid of the daemon holding the pid lock (the loaded agent's process), if any."""
    from mlxcel.daemon.process.lifecycle import running_pid

    return running_pid(get_paths())


def _wait_agent_gone(pid: int | None, timeout: float = STOP_TIMEOUT_S + 5.0) -> None:
    """`launchctl bootout` returns before the agent has drained and exited: wait for it (its
    pid lock is released at exit), or a bootstrap now would fail with EIO."""
    if pid is None:
        return
    from mlxcel.daemon.process.lifecycle import pid_file_locked

    lock = get_paths().pid_file
    deadline = time.monotonic() + timeout
    while pid_file_locked(lock):
        if time.monotonic() > deadline:
            raise ServiceError(f"the old agent (pid {pid}) did not exit within {timeout:.0f} s")
        time.sleep(0.1)


def _bootstrap(cmd: Command, runner: Runner) -> None:
    """Bootstrap, retrying while launchd still reports the old job (EIO, error 5 or 37)."""
    deadline = time.monotonic() + BOOTSTRAP_RETRY_S
    while True:
        result = runner(cmd.argv)
        if result.returncode == 0:
            return
        reason = (result.stderr or result.stdout or "").strip() or f"exit {result.returncode}"
        busy = result.returncode in (5, 37) or "Input/output error" in reason
        if not busy or time.monotonic() > deadline:
            raise ServiceError(f"`{' '.join(cmd.argv)}` failed: {reason}")
        time.sleep(0.25)


def install(spec: ServiceSpec, *, start: bool, runner: Runner) -> None:
    """Write the unit and load it; raises ServiceError when the manager refuses."""
    reinstall = spec.path.exists()
    if spec.kind == "launchd":  # launchd does not create the log folder
        get_paths().log_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(spec.path, spec.text)
    commands = install_commands(spec.kind, spec.path, start=start, reinstall=reinstall)
    if spec.kind != "launchd" or not start:
        _run_all(commands, runner)
        return
    *unload, bootstrap = commands  # enable, bootout (the old agent, if any), bootstrap
    old = _agent_pid()
    _run_all(unload, runner)
    _wait_agent_gone(old)
    _bootstrap(bootstrap, runner)


def uninstall(kind: ServiceKind, *, runner: Runner | None) -> bool:
    """Stop and unload (when a runner is given), remove the file; True if a file was removed."""
    path = unit_path(kind)
    if runner is not None and path.exists():
        old = _agent_pid() if kind == "launchd" else None
        _run_all(uninstall_commands(kind), runner)
        _wait_agent_gone(old)
    removed = path.exists()
    path.unlink(missing_ok=True)
    if runner is not None and kind == "systemd" and removed:
        _run_all([_systemctl("daemon-reload", must_succeed=False)], runner)
    return removed


# ---------------------------------------------------------------- who manages the daemon


def managed_by_service(environ: Mapping[str, str] | None = None) -> ServiceKind | None:
    """Which service manager started the process with this environment (default: ours)."""
    env = os.environ if environ is None else environ
    kind = switch_value(SERVICE_ENV, env)
    if kind in ("systemd", "launchd"):
        return kind  # type: ignore[return-value]
    if env.get("XPC_SERVICE_NAME") == LAUNCHD_LABEL:
        return "launchd"
    if environ is None and "INVOCATION_ID" in env and _own_cgroup_is_unit():
        return "systemd"
    return None


def _own_cgroup_is_unit() -> bool:
    try:
        return UNIT_NAME in Path("/proc/self/cgroup").read_text()
    except OSError:
        return False


def process_service(pid: int) -> ServiceKind | None:
    """Which service manager runs process `pid` (e.g. the daemon, for `status`); None if unknown."""
    import psutil

    try:
        return managed_by_service(psutil.Process(pid).environ())
    except (psutil.Error, OSError):
        return None


def service_status(runner: Runner | None = None) -> ServiceStatus:
    """Whether the unit file is installed and, where a manager answers, whether it runs."""
    kind = host_kind()
    path = unit_path(kind)
    installed = path.exists()
    manager = service_manager()
    if not installed or manager is None:
        return ServiceStatus(kind, path, installed, None if manager is None else False)
    run = runner or run_command
    if kind == "systemd":
        result = run(["systemctl", "--user", "is-active", UNIT_NAME])
        return ServiceStatus(kind, path, True, result.stdout.strip() == "active")
    result = run(["launchctl", "print", f"{_launchd_domain()}/{LAUNCHD_LABEL}"])
    return ServiceStatus(kind, path, True, "state = running" in result.stdout)


# ---------------------------------------------------------------- commands


def add_service_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add `install-service` and `uninstall-service` to the mlxcel-daemon subcommands."""
    p = subparsers.add_parser(
        "install-service",
        help="run the daemon in the background under launchd (macOS) or systemd (Linux)",
        description="Write the launchd agent / systemd user unit for this install and load it.",
    )
    p.add_argument("--print", action="store_true", help="print the unit and write nothing")
    p.add_argument("--no-start", action="store_true", help="write and enable, do not start now")
    p.set_defaults(service_action="install")
    u = subparsers.add_parser(
        "uninstall-service", help="stop, disable and remove the background service"
    )
    u.set_defaults(service_action="uninstall")


def run_service(
    args: argparse.Namespace,
    *,
    runner: Runner | None = None,
    manager: str | None = DETECT,
    kind: ServiceKind | None = None,
) -> int:
    """Run install-service / uninstall-service; `runner`, `manager` and `kind` are for tests."""
    kind = kind or host_kind()
    found = service_manager() if manager == DETECT else manager
    run = runner or run_command
    if getattr(args, "service_action", None) == "uninstall":
        return _cmd_uninstall(kind, run if found == kind else None)
    return _cmd_install(args, kind, run if found == kind else None)


def _cmd_install(args: argparse.Namespace, kind: ServiceKind, runner: Runner | None) -> int:
    spec = build_spec(kind)
    if getattr(args, "print", False):
        print(f"# {spec.path}", file=sys.stderr)
        print(spec.text, end="")
        return 0
    if runner is None:
        print(
            f"{_absent_reason(kind)}; nothing installed. "
            f"This is the unit that would be written to {spec.path}:",
            file=sys.stderr,
        )
        print(spec.text, end="")
        return 1
    start = not getattr(args, "no_start", False)
    blocker = _unmanaged_daemon_pid()
    if start and blocker is not None:
        print(
            f"a daemon started by hand is running (pid {blocker}); stop it first "
            "(mlxcel-daemon stop) or use --no-start, or the service could not start",
            file=sys.stderr,
        )
        return 1
    try:
        install(spec, start=start, runner=runner)
    except (ServiceError, OSError) as exc:
        print(f"install-service: {exc} (unit written to {spec.path})", file=sys.stderr)
        return 1
    print(f"installed {spec.path}")
    print(_next_step(kind, spec.path, start))
    return 0


def _cmd_uninstall(kind: ServiceKind, runner: Runner | None) -> int:
    path = unit_path(kind)
    try:
        removed = uninstall(kind, runner=runner)
    except (ServiceError, OSError) as exc:
        print(f"uninstall-service: {exc}", file=sys.stderr)
        return 1
    if not removed:
        print(f"no service installed ({path} does not exist)")
    elif runner is None:
        print(f"removed {path} ({_absent_reason(kind)}, so nothing was unloaded)")
    else:
        print(f"stopped and removed {path}")
    return 0


def _absent_reason(kind: ServiceKind) -> str:
    if kind == "launchd":
        return "launchd (launchctl) is not available here"
    return "systemd is not running on this machine (no /run/systemd/system, e.g. a container)"


def _next_step(kind: ServiceKind, path: Path, started: bool) -> str:
    if kind == "systemd":
        if started:
            return f"started; see `systemctl --user status {UNIT_NAME}` and `mlxcel-daemon status`"
        return f"enabled; it starts at your next login or with `systemctl --user start {UNIT_NAME}`"
    if started:
        return f"loaded and started as {LAUNCHD_LABEL}; see `mlxcel-daemon status`"
    bootstrap = f"launchctl bootstrap {_launchd_domain()} {path}"
    return f"enabled; it starts at your next login or with `{bootstrap}`"


def _unmanaged_daemon_pid() -> int | None:
    """The pid of a running daemon that no service manages (it would block the service)."""
    import psutil

    try:
        pid = int(get_paths().pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if not psutil.pid_exists(pid) or process_service(pid) is not None:
        return None
    return pid
