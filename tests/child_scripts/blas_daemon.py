"""An embedded daemon on the tiny model: prints, as one JSON object, the `blas` field of its
/v1/models entry and of its status snapshot (`{"models": ..., "status": ...}`).

Usage: blas_daemon.py MODEL_DIR HOME_DIR
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the daemon harness

from embedded import EmbeddedDaemon, paths_under
from mlxcel.shared.config import ServingConfig


def main(model_dir: str, home: str) -> None:
    cfg = ServingConfig(model=model_dir, port=0, parallel=2)
    paths = paths_under(Path(home))
    with EmbeddedDaemon(cfg, paths, paths.socket_path) as d:
        with urllib.request.urlopen(d.http_url + "/v1/models", timeout=30) as r:
            models = json.load(r)
        status = d.daemon.state.model.runtime.snapshot_dict()["daemon"]
    print(json.dumps({"models": models["data"][0]["blas"], "status": status["blas"]}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
