"""Prints the BLAS label the console and `status` show, with mlx imported first (e.g.
`openblas Haswell + sgemm avx2`, or `reference`)."""

from __future__ import annotations

import mlx.core  # noqa: F401  # loaded first, as in the daemon: the label reads what it loaded
from mlxcel.daemon.forward.blas import blas_label


def main() -> None:
    print(blas_label())


if __name__ == "__main__":
    main()
