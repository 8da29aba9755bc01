"""Prints whether this process sees the CUDA backend installed (`True` / `False`), from the
distributions' metadata alone (mlx is not imported)."""

from __future__ import annotations

from mlxcel.daemon.forward.blas import cuda_backend_installed


def main() -> None:
    print(cuda_backend_installed())


if __name__ == "__main__":
    main()
