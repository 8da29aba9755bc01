#!/usr/bin/env python
"""What does watching cost? Daemon throughput with and without `mlxcel-top` attached.

One daemon, one run: closed-loop HTTP clients keep it busy the whole time while measurement
windows alternate between no console and a console attached at the given refresh (default
1 s), off/on/off/on... Each window's output tok/s comes from the daemon's own generated-token
counter (read over the control socket at both ends), so no request straddles a boundary.
Windows go off, on, off, ..., on, off; the cost is the median over console windows of
1 - on / mean(off before, off after). It also prints the console's CPU next to the daemon's.
Target: under 3 %.

The console runs as a real terminal app inside tmux (`--console tmux`, the default when tmux
is installed), headless (`--console headless`, rendering without a terminal), or is replaced
by a bare subscribed ControlClient (`--console subscriber`: what serving the subscription
costs the daemon, without any rendering).

  python scripts/bench_console.py                       # default model (models pull first)
  python scripts/bench_console.py --model DIR --phase-s 10 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil
from mlxcel.shared.control_client import ControlClient

WORDS = [
    "river",
    "stone",
    "cloud",
    "lantern",
    "orchard",
    "harbor",
    "meadow",
    "copper",
    "violet",
    "ember",
    "signal",
]


@dataclass
class Phase:
    name: str
    tokens: int
    seconds: float
    console_cpu_s: float | None
    daemon_cpu_s: float | None = None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias or model directory")
    p.add_argument("--clients", type=int, default=4, help="concurrent closed-loop clients")
    p.add_argument("--parallel", type=int, default=4, help="daemon --parallel")
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens per request")
    p.add_argument("--prompt-words", type=int, default=40, help="words per distinct prompt")
    p.add_argument("--phase-s", type=float, default=10.0, help="seconds measured per phase")
    p.add_argument("--settle-s", type=float, default=2.0, help="pause around console start/stop")
    p.add_argument("--rounds", type=int, default=6, help="console windows (between plain ones)")
    p.add_argument("--interval-ms", type=int, default=1000, help="console refresh")
    default_console = "tmux" if shutil.which("tmux") else "headless"
    p.add_argument(
        "--console",
        choices=("tmux", "headless", "subscriber"),
        default=default_console,
        help="tmux: the real app in a terminal; headless: the app without one; subscriber: "
        "only a subscribed ControlClient (the daemon-side cost, no rendering)",
    )
    return p.parse_args(argv)


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_daemon(args: argparse.Namespace, workdir: Path, port: int) -> subprocess.Popen:
    env = dict(os.environ, MLXCEL_HOME=str(workdir / "home"))
    argv = [sys.executable, "-m", "mlxcel.daemon.cli", "start", "--foreground"]
    argv += ["--model", args.model, "--port", str(port), "--socket", str(workdir / "d.sock")]
    argv += ["--parallel", str(args.parallel)]
    log = open(workdir / "daemon.out", "wb")  # noqa: SIM115 - lives as long as the daemon
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


async def wait_healthy(url: str, daemon: subprocess.Popen, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if daemon.poll() is not None:
                raise SystemExit(f"daemon exited with {daemon.returncode} before it was ready")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise SystemExit("daemon not healthy in time")


class Load:
    """Closed-loop clients; distinct prompts so the prompt cache does not flatter a phase."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.args = args
        self._counter = 0

    def _prompt(self) -> str:
        self._counter += 1
        n = self._counter
        words = [
            WORDS[(n * 7 + i * (n % 5 + 1)) % len(WORDS)] for i in range(self.args.prompt_words)
        ]
        return f"Request {n}: " + " ".join(words)

    async def run(self, stop: asyncio.Event) -> int:
        """Keep the clients busy until `stop` is set; returns the number of requests."""
        done = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

            async def client() -> None:
                nonlocal done
                while not stop.is_set():
                    body = {
                        "prompt": self._prompt(),
                        "max_tokens": self.args.max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    }
                    async with session.post(f"{self.url}/v1/completions", json=body) as resp:
                        data = await resp.json()
                        if resp.status != 200:
                            raise SystemExit(f"request failed: {resp.status} {data}")
                    done += 1

            await asyncio.gather(*(client() for _ in range(self.args.clients)))
        return done


async def generated_tokens(sock: Path) -> tuple[int, float]:
    """The daemon's own count of generated tokens, and when it was read: exact windows."""
    async with ControlClient(str(sock)) as client:
        status = await client.call("status")
    return int(status["engine"]["counters"]["generation_tokens"]), time.monotonic()


HEADLESS = (
    "import sys; from mlxcel.tui.app import make_app; "
    "make_app(sys.argv[1], interval_ms=int(sys.argv[2])).run(headless=True)"
)
SUBSCRIBER = """
import asyncio, sys
from mlxcel.shared.control_client import ControlClient
async def main():
    async with ControlClient(sys.argv[1]) as client:
        await client.call("subscribe", {"interval_ms": int(sys.argv[2])})
        async for _ in client.events():
            pass
asyncio.run(main())
"""


class Console:
    """`mlxcel-top` attached to the daemon, in tmux or headless."""

    def __init__(self, mode: str, sock: Path, interval_ms: int, workdir: Path) -> None:
        self.mode = mode
        self.sock = sock
        self.interval_ms = interval_ms
        self.session = f"mlxcel-bench-{os.getpid()}"
        self.proc: psutil.Process | None = None
        self._popen: subprocess.Popen | None = None
        self._workdir = workdir

    def start(self) -> None:
        top = [sys.executable, "-m", "mlxcel.tui.cli", "--socket", str(self.sock)]
        top += ["--interval", str(self.interval_ms)]
        if self.mode == "tmux":
            cmd = " ".join(top)
            subprocess.run(
                ["tmux", "new-session", "-d", "-s", self.session, "-x", "120", "-y", "40", cmd],
                check=True,
            )
            pane_pid = subprocess.run(
                ["tmux", "list-panes", "-t", self.session, "-F", "#{pane_pid}"],
                check=True, capture_output=True, text=True,
            ).stdout.split()[0]  # fmt: skip
            self.proc = psutil.Process(int(pane_pid))
        else:
            code = HEADLESS if self.mode == "headless" else SUBSCRIBER
            self._popen = subprocess.Popen(
                [sys.executable, "-c", code, str(self.sock), str(self.interval_ms)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            self.proc = psutil.Process(self._popen.pid)

    def wait_connected(self, timeout_s: float = 30.0) -> None:
        if self.mode != "tmux":
            time.sleep(3.0)  # headless has no screen to read: give it time to connect
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            screen = subprocess.run(
                ["tmux", "capture-pane", "-p", "-t", self.session], capture_output=True, text=True
            ).stdout
            if "● connected" in screen:
                return
            time.sleep(0.2)
        raise SystemExit("the console did not connect")

    def stop(self) -> None:
        if self.mode == "tmux":
            subprocess.run(["tmux", "kill-session", "-t", self.session], check=False)
        elif self._popen is not None:
            self._popen.send_signal(signal.SIGTERM)
            try:
                self._popen.wait(10)
            except subprocess.TimeoutExpired:
                self._popen.kill()
        self.proc = None


def cpu_seconds(proc: psutil.Process | None) -> float | None:
    if proc is None:
        return None
    with contextlib.suppress(psutil.Error):
        t = proc.cpu_times()
        return t.user + t.system + t.children_user + t.children_system
    return None


async def run_phase(
    name: str, sock: Path, seconds: float, daemon: psutil.Process, console: Console | None
) -> Phase:
    top = console.proc if console else None
    cpu0, dcpu0 = cpu_seconds(top), cpu_seconds(daemon)
    tokens0, t0 = await generated_tokens(sock)
    await asyncio.sleep(seconds)
    tokens1, t1 = await generated_tokens(sock)
    cpu1, dcpu1 = cpu_seconds(top), cpu_seconds(daemon)
    cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    dcpu = dcpu1 - dcpu0 if dcpu0 is not None and dcpu1 is not None else None
    phase = Phase(name, tokens1 - tokens0, t1 - t0, cpu, dcpu)
    text = f"  {name:<12} {phase.tok_s:8.1f} tok/s"
    if dcpu is not None:
        text += f"  daemon CPU {100 * dcpu / phase.seconds:5.0f}%"
    if cpu is not None:
        text += f"  console CPU {100 * cpu / phase.seconds:.1f}% of a core"
    print(text, flush=True)
    return phase


async def bench(args: argparse.Namespace, workdir: Path) -> list[Phase]:
    """off, on, off, on, ..., off: every console window sits between two plain ones."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sock = workdir / "d.sock"
    daemon = start_daemon(args, workdir, port)
    stop = asyncio.Event()
    load_task: asyncio.Task[int] | None = None
    try:
        await wait_healthy(url, daemon)
        dproc = psutil.Process(daemon.pid)
        load_task = asyncio.create_task(Load(url, args).run(stop))
        print(f"daemon ready ({args.model}); warming up", flush=True)
        await asyncio.sleep(args.settle_s * 2)
        phases = [await run_phase("off #0", sock, args.phase_s, dproc, None)]
        for rnd in range(1, args.rounds + 1):
            console = Console(args.console, sock, args.interval_ms, workdir)
            console.start()
            try:
                await asyncio.to_thread(console.wait_connected)
                await asyncio.sleep(args.settle_s)  # its start-up is not the steady cost
                phases.append(
                    await run_phase(f"console #{rnd}", sock, args.phase_s, dproc, console)
                )
            finally:
                console.stop()
            await asyncio.sleep(args.settle_s)
            phases.append(await run_phase(f"off #{rnd}", sock, args.phase_s, dproc, None))
        return phases
    finally:
        stop.set()
        if load_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(load_task, 120)
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()


def report(args: argparse.Namespace, phases: list[Phase]) -> None:
    off = [p for p in phases if p.name.startswith("off")]
    on = [p for p in phases if p.name.startswith("console")]
    # Paired: each console window against the mean of the plain windows either side of it,
    # which cancels slow drift; the median resists one disturbed window.
    paired = [
        1.0 - on[i].tok_s / statistics.mean([off[i].tok_s, off[i + 1].tok_s])
        for i in range(len(on))
    ]
    off_rates = [p.tok_s for p in off]
    noise = statistics.pstdev(off_rates) / statistics.mean(off_rates)
    console_cpu = sum(p.console_cpu_s or 0.0 for p in on)
    daemon_cpu = sum(p.daemon_cpu_s or 0.0 for p in on)
    print()
    print(f"model {args.model}, {args.clients} clients x {args.max_tokens} tokens, "
          f"console {args.console} at {args.interval_ms} ms, {len(on)} paired windows")  # fmt: skip
    print(f"without console: {statistics.mean(off_rates):.1f} tok/s   "
          f"with console: {statistics.mean(p.tok_s for p in on):.1f} tok/s")  # fmt: skip
    print(f"throughput cost (median of paired windows): {100 * statistics.median(paired):+.1f}%"
          f"   window-to-window noise of the plain runs: ±{100 * noise:.1f}%")  # fmt: skip
    if daemon_cpu:
        print(f"console CPU / daemon CPU while attached: {100 * console_cpu / daemon_cpu:.1f}%")
    if noise > 0.03:
        print("the noise is above the 3% target: rerun on a quiet machine for a verdict")
    else:
        verdict = "within" if statistics.median(paired) < 0.03 else "OVER"
        print(f"{verdict} the 3% target")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="mb-"))  # short: the socket path limit
    try:
        phases = asyncio.run(bench(args, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report(args, phases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
