"""The fused native ops on the path this process picks (MLXCEL_GEMM_ISA, the library at
MLXCEL_OPS_LIB, MLXCEL_NO_NATIVE_OPS as the parent set them), against numpy
(tests/native_ops_checks.py); the choice logged at INFO on stderr. Prints one JSON object: the
path (null when the ops are not in use), and the largest relative error of the attention and
of SwiGLU.

Usage: native_ops_paths.py
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the numpy checks


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # before the ops load
    from mlxcel.daemon.forward import native_ops
    from native_ops_checks import ATTN_SHAPES, SWIGLU_SHAPES, check_attention, check_swiglu

    native_ops.log_choice()
    if native_ops.path() is None:
        print(json.dumps({"path": None}))
        return
    masks = ("causal", "left-padded")
    attn = max(check_attention(s, m) for s in ATTN_SHAPES for m in masks)
    swiglu = max(check_swiglu(r, h) for r, h in SWIGLU_SHAPES)
    print(json.dumps({"path": native_ops.path(), "attention": attn, "swiglu": swiglu}))


if __name__ == "__main__":
    main()
