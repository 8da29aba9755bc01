"""`ensure_fast_blas()` as a daemon's start calls it, then a matmul; prints the BLAS in use and
the re-exec marker (`-` when the process was not re-executed), e.g. `openblas 1`."""

from __future__ import annotations

import os

from mlxcel.daemon.forward.blas import blas_name, ensure_fast_blas


def main() -> None:
    ensure_fast_blas()  # may re-exec this script with the preload, before mlx is imported
    import mlx.core as mx

    mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))
    print(blas_name(), os.environ.get("MLXCEL_BLAS_REEXEC", "-"))


if __name__ == "__main__":
    main()
