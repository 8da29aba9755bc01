"""Resolves both native libraries (`resolve_native`, which may build them into the per-user
cache); prints one JSON object: for `gemm` and `ops`, [path, origin, THIRD], THIRD being the
library's ABI version (`abi`, the default) or the reason it is not in use (`why`).

Usage: native_build_resolve.py [abi|why]
"""

from __future__ import annotations

import json
import sys

from mlxcel.daemon.forward.blas import library_abi, resolve_native


def main(third: str) -> None:
    out: dict[str, list[object]] = {}
    for kind in ("gemm", "ops"):
        found = resolve_native(kind)
        extra = found.why if third == "why" else library_abi(found.path, kind)
        out[kind] = [str(found.path), found.origin, extra]
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "abi")
