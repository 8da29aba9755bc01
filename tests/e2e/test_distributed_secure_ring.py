"""The ring between a group's ranks on real processes (docs/distributed.md): forged messages
on a real ring to a real worker (dropped and logged, a pickle gadget never runs), a real group
whose worker holds neither API key, and a worker started without the group key. The codec and
the seal on their own are tests/unit/test_distributed_secure.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
from daemon_helpers import http_json, pid_running, wait_until
from mlxcel.daemon.distributed.wire import GroupKey
from repo_paths import TESTS
from ring_group import free_ports, kill_ranks, rank_pids, start_group

# -- forged messages on a real ring, to a real worker ---------------------------------

FORGER = TESTS / "child_scripts" / "distributed_secure_ring_forger.py"


def test_forged_ring_messages_are_dropped_logged_and_never_run(tmp_path: Path) -> None:
    ports = free_ports(2)
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    marker = tmp_path / "pwned"
    key = GroupKey.new()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_")}
    env.update(MLX_HOSTFILE=str(hostfile), MLXCEL_NO_FAST_FORWARD="1")
    log_path = tmp_path / "rank1.log"
    with open(log_path, "wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "mlxcel.daemon.distributed.worker"],
            env={**env, "MLX_RANK": "1"},
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    forger = subprocess.Popen(
        [sys.executable, str(FORGER), str(marker)],
        env={**env, "MLX_RANK": "0"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert worker.stdin is not None
        worker.stdin.write(key.line())
        worker.stdin.close()
        forged_out, _ = forger.communicate(key.line(), timeout=180)
        code = worker.wait(60)
    finally:
        for proc in (worker, forger):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log_path.read_text(errors="replace")
    assert not marker.exists(), "a pickle from the ring was run"
    assert b"forger done" in forged_out, forged_out.decode(errors="replace")
    assert code == 0, text  # the authentic stop still ended it: no crash on the way
    failed = "distributed: dropped a message that failed authentication from rank 0"
    assert text.count(f"{failed} (wrong MAC)") == 5, text  # pickles, other keys, flipped bit
    assert text.count(f"{failed} (sequence number 2 replayed or old, last 2)") == 1, text
    assert text.count("distributed: dropped a malformed message from rank 0: not JSON") == 1
    assert text.count("dropped a malformed message from rank 0: unknown kind 'exec'") == 1
    assert "ping before the setup, ignored" in text and "stop from rank 0" in text
    assert "Traceback" not in text


# -- a real group serves, and its worker holds no key ----------------------------------

FULL_KEY = "sk-full-6f1d2c"
READ_KEY = "sk-read-93ab07"


def test_group_serves_with_keys_that_its_worker_never_holds(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    home = tmp_path / "home"
    keys = {"MLXCEL_API_KEY": FULL_KEY, "MLXCEL_READONLY_API_KEY": READ_KEY}
    daemon = start_group(home, tiny_model_dir, 2, **keys)
    pids = rank_pids(daemon)
    try:
        body = {"prompt": "hello there", "max_tokens": 6, "temperature": 0}
        url = f"{daemon.http_url}/v1/completions"
        status, _, reply = http_json(url, body, {"Authorization": f"Bearer {FULL_KEY}"})
        refused, _, _ = http_json(url, body)
        # the largest seed the API takes (uint64) travels: the group stays in lockstep
        big = {**body, "temperature": 1.0, "seed": (1 << 64) - 1}
        headers = {"Authorization": f"Bearer {FULL_KEY}"}
        big_status, _, big_reply = http_json(url, big, headers)
        again, _, _ = http_json(url, body, headers)
        worker = psutil.Process(pids[0])
        worker_env_now, argv = worker.environ(), worker.cmdline()
        rank_log = (home / "logs" / "rank1.log").read_text(errors="replace")
        group = daemon.status()["group"]
    finally:
        daemon.stop()
        kill_ranks(pids)
    assert status == 200 and reply["usage"]["completion_tokens"] == 6, reply
    assert refused == 401  # rank 0 does enforce the key it keeps
    assert big_status == 200, big_reply
    assert again == 200
    assert group["status"] == "ok" and group["ranks"][1]["steps"] > 0
    assert worker_env_now.get("MLX_RANK") == "1"  # the right process
    for where in (json.dumps(worker_env_now), json.dumps(argv), rank_log):
        assert FULL_KEY not in where and READ_KEY not in where
    assert not [k for k in worker_env_now if "API_KEY" in k.upper()]
    assert argv[-1].endswith("distributed.worker") and len(argv) == 3  # no secret on argv
    wait_until(lambda: not any(pid_running(p) for p in pids), timeout=10)


def test_a_worker_without_the_group_key_does_not_join(tmp_path: Path) -> None:
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXCEL_")}
    done = subprocess.run(
        [sys.executable, "-m", "mlxcel.daemon.distributed.worker"],
        env={**env, "MLX_RANK": "1", "MLX_HOSTFILE": str(hostfile)},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert "FATAL no group key on stdin (a rank is started by its rank 0)" in done.stderr
    assert "Traceback" not in done.stderr
