"""The native quantized matmul on every format and row count (tests/native_quant_checks.py:
check_kernel), on the path this process picks (MLXCEL_GEMM_ISA, MLXCEL_QUANT_STRIP,
MLXCEL_QUANT_BIG and a BLAS preload as the parent set them). Prints one JSON object: the path,
the largest difference and the largest relative error, and whether float16 and bfloat16 scales
give the float32 scales' results bit for bit.

Usage: native_quant_kernels.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the kernel checks

from mlxcel.daemon.forward import native_ops
from native_quant_checks import FORMATS, ROWS, check_kernel, narrow_kernel_same


def main() -> None:
    worst = [0.0, 0.0]
    narrow_same = True
    for bits, group in FORMATS:
        for rows in ROWS:
            diff, ratio = check_kernel(bits, group, rows)
            worst = [max(worst[0], diff), max(worst[1], ratio)]
            narrow_same = narrow_same and narrow_kernel_same(bits, group, rows)
    out = {
        "available": True,
        "path": native_ops.quant_path(),
        "diff": worst[0],
        "ratio": worst[1],
        "narrow_same": narrow_same,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
