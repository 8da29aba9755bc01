"""Loads the engine for a model as the daemon does (`load_engine`, a disk tier on CACHE_DIR)
and prints its disk tier's fingerprint (64 hex digits).

Usage: prompt_cache_disk_review_fingerprint.py MODEL_DIR CACHE_DIR
"""

from __future__ import annotations

import sys

from mlxcel.daemon.process.daemon import load_engine
from mlxcel.shared.config import ServingConfig


def main(model_dir: str, cache_dir: str) -> None:
    cfg = ServingConfig(prompt_cache_dir=cache_dir, prompt_cache_disk_bytes=1 << 30)
    _, engine, _ = load_engine(cfg, model_dir)
    print(engine.disk.fingerprint)
    engine.disk.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
