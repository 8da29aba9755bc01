"""`ensure_fast_blas()` as the daemon's start calls it (it may re-exec this script with the
preload), a few-row matmul, then the BLAS choice logged to stderr; prints the LD_PRELOAD this
process ended up with (space-separated paths, or an empty line)."""

from __future__ import annotations

import logging
import os
import sys

from mlxcel.daemon.forward.blas import ensure_fast_blas, log_blas_choice


def main() -> None:
    ensure_fast_blas()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    import mlx.core as mx

    mx.eval(mx.ones((4, 64)) @ mx.ones((64, 64)))  # a few-row product: plain OpenBLAS
    log_blas_choice()
    print(os.environ.get("LD_PRELOAD", ""))


if __name__ == "__main__":
    main()
