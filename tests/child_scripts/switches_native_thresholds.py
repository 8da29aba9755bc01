"""Prints the native-op thresholds `daemon/forward/native_ops.py` read from the environment when
it was imported: NATIVE_MIN_ROWS and NATIVE_ELEMENTWISE_MIN, space-separated."""

from __future__ import annotations

from mlxcel.daemon.forward import native_ops

if __name__ == "__main__":
    print(native_ops.NATIVE_MIN_ROWS, native_ops.NATIVE_ELEMENTWISE_MIN)
