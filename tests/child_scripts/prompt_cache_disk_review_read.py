"""Reads a cached chain of N tokens (fingerprint "e" * 64, tokens `(i % 250) + 1`) back from a
disk tier and prints by how many bytes the process's peak resident size grew during the read
(Linux: /proc/self/clear_refs resets the peak, VmHWM reads it).

Usage: prompt_cache_disk_review_read.py CACHE_DIR N
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: daemon_helpers

from daemon_helpers import wait_until
from mlxcel.daemon.engine.disk_cache import DiskTier


def status_kb(field: str) -> int:
    """A line of /proc/self/status, in kB (`VmRSS:`, `VmHWM:`)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def main(directory: str, n: int) -> None:
    t = DiskTier(directory, "e" * 64, 1 << 34)
    t.flush()
    prompt = [(i % 250) + 1 for i in range(n)] + [0]
    num, keys = t.match(prompt)
    assert num == n, num
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident size starts again from now
    base = status_kb("VmRSS:")
    t.start_read("r", prompt, keys)
    wait_until(lambda: t.has_reads, 60, 0.005, "the read done")
    (read,) = t.take_reads()
    assert read.num_tokens == n
    print((status_kb("VmHWM:") - base) * 1024)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
