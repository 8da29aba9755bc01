"""Imports one module of mlxcel.daemon.engine in this fresh interpreter; prints the sorted list
of the top-level packages among mlx and mlx_lm that it loaded (`[]` for a plain-Python one).

Usage: engine_boundaries_mlx_imports.py MODULE   (a name under mlxcel.daemon.engine)
"""

from __future__ import annotations

import importlib
import sys


def main(name: str) -> None:
    importlib.import_module(f"mlxcel.daemon.engine.{name}")
    print(sorted({m.split(".")[0] for m in sys.modules} & {"mlx", "mlx_lm"}))


if __name__ == "__main__":
    main(sys.argv[1])
