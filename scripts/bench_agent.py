#!/usr/bin/env python
"""Agent-shaped benchmark: a long, slowly growing conversation resent whole every turn, across
a server restart (docs/tuning.md, "The prompt cache's disk tier").

One session: a system prompt of about --system-tokens tokens (instructions and the JSON schemas
of a dozen tools), a task, then --turns turns; each turn the client sends the whole history,
gets a short answer (--max-tokens), appends it and a tool output of about --tool-tokens tokens,
as coding agents do. Then the server is restarted (`mlxcel-daemon restart`; the others are
stopped and started again) and the session goes on for --after-restart turns. Last, the first
prompt after the restart is sent again on an empty cache: its cold prefill.

Per turn it prints TTFT, prompt and cached tokens, and the TTFT over the cost of prefilling
only the turn's new tokens (new tokens x the cold prefill's seconds per token); for the first
turn after the restart, the TTFT over the cold prefill of the same prompt. The targets on the
CPU this was written on: every turn after the first within 1.5x its new tokens' cost; the first
turn after a restart within 0.15x a cold prefill; the same with the RAM tier capped so small
that every hit comes from disk (server `mlxcel-disk`). Servers run one after another in one
run, with the same model and BLAS environment:

  bench_agent.py                                  # mlxcel, mlxcel-disk (RAM tier ~0), mlx_lm
  bench_agent.py --servers mlxcel --turns 8       # a quick look
  bench_agent.py --servers mlxcel,llama --llama-server ~/llama.cpp/build/bin/llama-server \\
      --gguf smollm2.gguf                         # llama.cpp's server with --cache-reuse

A model whose window is smaller than the session gets shorter tool outputs (said first).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib.servers import (
    Server,
    blas_env,
    daemon_command,
    free_port,
    launch,
    load_tokenizer,
    mlx_lm_model_dir,
    start_mlx_lm,
    stop_server,
)

HEALTH_TIMEOUT_S = 300.0
CHARS_PER_TOKEN = 3.6  # without the model's tokenizer: SmolLM2's on English/JSON text
_count = None  # the model's tokenizer as a token counter (main sets it), else the estimate


def count_tokens(text: str) -> int:
    return len(_count(text)) if _count is not None else int(len(text) / CHARS_PER_TOKEN)


@dataclass
class Turn:
    index: int
    phase: str  # "before" | "after" (the restart) | "cold" (the reference)
    prompt_tokens: int
    cached_tokens: int | None
    ttft_s: float
    new_tokens: int = 0
    ratio: float | None = None  # TTFT / (new tokens' cost); after restart: TTFT / cold


@dataclass
class Session:
    server: str
    turns: list[Turn] = field(default_factory=list)
    cold_s_per_token: float | None = None
    restart_ratio: float | None = None
    within: dict[str, bool] = field(default_factory=dict)


# -- the conversation -------------------------------------------------------------------------


def tool_schemas(n: int = 12) -> list[dict[str, Any]]:
    names = ["read_file", "write_file", "list_dir", "grep", "run_tests", "git_diff", "git_log",
             "apply_patch", "search_docs", "run_shell", "open_url", "ask_user"][:n]  # fmt: skip
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"{name.replace('_', ' ')}: use it when the task needs it; "
                "it returns plain text, truncated to 4000 characters, or an error line.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "a path under the repository"},
                        "pattern": {"type": "string", "description": "a regular expression"},
                        "limit": {"type": "integer", "minimum": 1, "maximum": 1000},
                        "recursive": {"type": "boolean"},
                    },
                    "required": ["path"],
                },
            },
        }
        for name in names
    ]


def system_prompt(tokens: int) -> str:
    head = (
        "You are a coding agent working in a Python repository. Follow the rules. Use the "
        "tools described below; answer briefly. Tools (JSON schemas):\n"
        + json.dumps(tool_schemas(), indent=1)
        + "\nRules:\n"
    )
    rules: list[str] = []
    while count_tokens(head + "".join(rules)) < tokens:
        i = len(rules)
        rules += [
            f"{i + k + 1}. Keep change {i + k} small, test it, say what you did.\n"
            for k in range(8)
        ]
    return head + "".join(rules)


def tool_output(turn: int, tokens: int) -> str:
    lines = [f"Tool output (turn {turn}):"]
    while count_tokens("\n".join(lines)) < tokens:
        k = len(lines)
        lines.append(f"src/mod_{turn}_{k}.py:{k}: def handler_{k}(request): return {k}")
    return "\n".join(lines)


def model_window(model: Path) -> int | None:
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


# -- one streamed chat turn -------------------------------------------------------------------


def stream_chat(
    url: str, messages: list[dict[str, str]], max_tokens: int, model: str | None = None
) -> tuple[Any, ...]:
    """(TTFT s, answer text, prompt tokens, cached tokens) of one streamed chat completion."""
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:  # mlx_lm.server: its --model's alias (another name loads that path)
        body["model"] = model
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    ttft, text, usage = None, [], {}
    with urllib.request.urlopen(req, timeout=900) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                text.append(piece)
    if ttft is None:
        ttft = time.perf_counter() - start
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", usage.get("cache_read_input_tokens"))
    if cached is None and "timings" in usage:
        cached = usage["timings"].get("cache_n")
    return ttft, "".join(text), int(usage.get("prompt_tokens") or 0), cached


# -- servers ----------------------------------------------------------------------------------


class Target:
    """One server kind: start, restart, reset its cache."""

    def __init__(self, kind: str, args: argparse.Namespace, workdir: Path) -> None:
        self.kind, self.args, self.workdir = kind, args, workdir / kind
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: Server | None = None
        self.model = "default_model" if kind == "mlx_lm" else None

    def start(self) -> None:
        a = self.args
        if self.kind.startswith("mlxcel"):
            flags = ["--model", str(a.model), "--port", str(self.port), "--parallel", "2"]
            if self.kind == "mlxcel-disk":
                flags += ["--prompt-cache-bytes", "1"]  # the RAM tier keeps nothing
            self._mlxcel("start", *flags)
        elif self.kind == "mlx_lm":
            # the weights in the dtype mlxcel serves (float32 on the CPU), as bench_serving does
            model = mlx_lm_model_dir(a.model, "auto", self.workdir)
            self.server = start_mlx_lm(a, model, self.port, self.workdir)
        elif self.kind == "llama":
            argv = [str(a.llama_server), "-m", str(a.gguf), "--port", str(self.port)]
            argv += ["--host", "127.0.0.1", "-c", str(a.ctx), "--cache-reuse", "256", "-np", "1"]
            self.server = launch("llama", argv, blas_env(), self.port, self.workdir)
        wait_healthy(self.url)

    def restart(self) -> None:
        if self.kind.startswith("mlxcel"):
            self._mlxcel("restart")
            wait_healthy(self.url)
        else:
            self.stop()
            self.start()

    def reset_cache(self) -> None:
        """An empty prompt cache (every tier), for the cold reference."""
        if self.kind.startswith("mlxcel"):
            post(self.url + "/v1/cache/reset", {})
        else:
            self.restart()  # their caches live in the process

    def stop(self) -> None:
        if self.kind.startswith("mlxcel"):
            self._mlxcel("stop")
        elif self.server is not None:
            stop_server(self.server)
            self.server = None

    def _mlxcel(self, *args: str) -> None:
        env = blas_env({"MLXCEL_HOME": str(self.workdir / "home")})
        done = subprocess.run(
            [*daemon_command(), *args], env=env, capture_output=True, text=True, check=False
        )
        if done.returncode != 0 and args[0] != "stop":
            raise RuntimeError(f"mlxcel-daemon {args[0]} failed: {done.stdout}{done.stderr}")


def wait_healthy(url: str) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {HEALTH_TIMEOUT_S:.0f} s")


def post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


# -- the session ------------------------------------------------------------------------------


def disk_stats(target: Target) -> dict[str, Any] | None:
    """mlxcel's disk tier counters (`/v1/cache/stats`), None for the other servers or with the
    tier off."""
    if not target.kind.startswith("mlxcel"):
        return None
    try:
        with urllib.request.urlopen(target.url + "/v1/cache/stats", timeout=30) as resp:
            disk = json.loads(resp.read())["prompt_cache"].get("disk")
    except (OSError, ValueError, KeyError):
        return None
    return disk if isinstance(disk, dict) else None


def disk_delta(before: dict[str, Any] | None, target: Target) -> str:
    """What the disk tier did during a turn: tokens served from it and the reads' seconds (the
    rest of `cached` came from RAM), and the bytes its writer wrote meanwhile ("" with no
    tier)."""
    after = disk_stats(target)
    if after is None:
        return ""
    # none before (a daemon just restarted publishes its tier a moment after /health): the
    # new process's counters started at zero
    base = before or {}
    tokens = after["hit_tokens"] - base.get("hit_tokens", 0)
    read_s = after["read_seconds"] - base.get("read_seconds", 0.0)
    written = (after["bytes_written"] - base.get("bytes_written", 0)) / 1e6
    return f" | from disk {tokens:5d} tok in {read_s:5.2f} s, {written:5.0f} MB written"


def run_session(target: Target, args: argparse.Namespace, tool_tokens: int) -> Session:
    session = Session(target.kind)
    messages = [
        {"role": "system", "content": system_prompt(args.system_tokens)},
        {"role": "user", "content": "Task: make the failing test in tests/test_api.py pass."},
    ]
    previous_prompt = 0
    first_after: list[dict[str, str]] | None = None
    total = args.turns + args.after_restart
    for i in range(1, total + 1):
        if i == args.turns + 1:
            print(f"  -- restart ({target.kind})", flush=True)
            target.restart()
            first_after = [dict(m) for m in messages]
        disk_before = disk_stats(target)
        try:
            ttft, answer, prompt_tokens, cached = stream_chat(
                target.url, messages, args.max_tokens, target.model
            )
        except urllib.error.HTTPError as exc:  # e.g. the context is full: the session ends
            print(f"  turn {i:2d}: HTTP {exc.code} {exc.read()[:200]!r}; the session ends")
            break
        phase = "before" if i <= args.turns else "after"
        turn = Turn(i, phase, prompt_tokens, cached, ttft, prompt_tokens - previous_prompt)
        session.turns.append(turn)
        print(
            f"  turn {i:2d} {phase:6s} prompt {prompt_tokens:6d} cached {cached!s:>6} "
            f"new {turn.new_tokens:5d} TTFT {ttft:7.3f} s{disk_delta(disk_before, target)}",
            flush=True,
        )
        previous_prompt = prompt_tokens
        messages.append({"role": "assistant", "content": answer or "(no answer)"})
        messages.append({"role": "user", "content": tool_output(i, tool_tokens)})
    if first_after is not None:
        target.reset_cache()
        ttft, _, prompt_tokens, cached = stream_chat(
            target.url, first_after, args.max_tokens, target.model
        )
        session.turns.append(Turn(0, "cold", prompt_tokens, cached, ttft))
        session.cold_s_per_token = ttft / max(prompt_tokens, 1)
        print(f"  cold   prompt {prompt_tokens:6d} TTFT {ttft:7.3f} s (first prompt after restart)")
    judge(session)
    return session


def judge(session: Session) -> None:
    cold = next((t for t in session.turns if t.phase == "cold"), None)
    if cold is None or session.cold_s_per_token is None:
        return
    per_token = session.cold_s_per_token
    turns = [t for t in session.turns if t.phase != "cold"]
    for t in turns[1:]:
        t.ratio = t.ttft_s / max(t.new_tokens * per_token, 1e-9)
    first_after = next((t for t in turns if t.phase == "after"), None)
    if first_after is not None:
        session.restart_ratio = first_after.ttft_s / cold.ttft_s
    steady = [t for t in turns[1:] if t is not first_after]
    session.within = {
        "turns <= 1.5x new tokens' prefill": all((t.ratio or 0) <= 1.5 for t in steady),
        "first after restart <= 0.15x cold": (session.restart_ratio or 9) <= 0.15,
    }


def report(sessions: list[Session]) -> None:
    print("\n| server | turns after the first: TTFT / new tokens' cost (median, max) | "
          "first after restart / cold | targets |")  # fmt: skip
    print("| --- | --- | --- | --- |")
    for s in sessions:
        ratios = sorted(t.ratio for t in s.turns if t.ratio is not None and t.phase == "before")
        med = f"{ratios[len(ratios) // 2]:.2f}x" if ratios else "n/a"
        top = f"{ratios[-1]:.2f}x" if ratios else "n/a"
        restart = f"{s.restart_ratio:.3f}x" if s.restart_ratio is not None else "n/a"
        met = ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in s.within.items()) or "n/a"
        print(f"| {s.server} | {med}, {top} | {restart} | {met} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="model dir (default: SmolLM2's)")
    p.add_argument("--servers", default="mlxcel,mlxcel-disk,mlx_lm")
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--after-restart", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--tool-tokens", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--llama-server", type=Path, default=None)
    p.add_argument("--gguf", type=Path, default=None, help="the model as GGUF, for llama")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()
    if args.model is None:
        from mlxcel.daemon.models.registry import DEFAULT_MODEL, local_model_dir

        args.model = local_model_dir(DEFAULT_MODEL)
        if args.model is None:
            p.error("the default model is not pulled: mlxcel-daemon models pull")
    args.parallel, args.max_batch_prefill = 2, 2  # for start_mlx_lm
    global _count
    tokenizer = load_tokenizer(args.model)
    if tokenizer is not None:
        _count = tokenizer.encode
    window = model_window(args.model) or 1 << 20
    budget = window - args.system_tokens - 1024  # the task, the chat template, a margin
    per_turn = args.tool_tokens + args.max_tokens + 40  # the template's turn markup
    tool_tokens = args.tool_tokens
    turns = args.turns + args.after_restart
    if turns * per_turn > budget:
        tool_tokens = max(budget // turns - args.max_tokens - 40, 32)
        print(
            f"# the model's window is {window} tokens: tool outputs of ~{tool_tokens} tokens "
            f"(--tool-tokens {args.tool_tokens} would not fit {turns} turns)",
            flush=True,
        )
    args.ctx = window
    kinds = [k.strip() for k in args.servers.split(",") if k.strip()]
    if "llama" in kinds and (args.llama_server is None or args.gguf is None):
        print("# llama skipped: give --llama-server and --gguf", flush=True)
        kinds.remove("llama")
    print(f"# model {args.model}; BLAS env {blas_env().get('LD_PRELOAD', '(none)')}", flush=True)
    sessions = []
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        for kind in kinds:
            target = Target(kind, args, Path(tmp))
            print(f"\n## {kind}", flush=True)
            try:
                target.start()
                sessions.append(run_session(target, args, tool_tokens))
            finally:
                target.stop()
    report(sessions)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(s) for s in sessions], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
