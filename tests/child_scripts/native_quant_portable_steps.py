"""Greedy decode steps of tiny llamas, float32 and 4-bit, through the native steps of the ops
library at MLXCEL_OPS_LIB (the parent points it at a build without x86 code: what an aarch64
machine runs), against stock mlx-lm's forward on the same weights (tests/native_quant_checks.py:
`greedy_both` checks every greedy token equal). Prints one JSON object: the float ops' and the
quantized kernels' paths, and per model the native decode steps run and the largest logit
difference.

Usage: native_quant_portable_steps.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the model pairs

from mlxcel.daemon.forward import native_decode, native_ops
from native_quant_checks import counted_calls, float_pair, greedy_both, quantized_pair

ROWS = [list(range(1, 41)), [5, 6, 7], [9] * 17]
STEPS = 12


def main() -> None:
    out: dict[str, object] = {"path": native_ops.path(), "quant_path": native_ops.quant_path()}
    for name, pair in (("float32", float_pair(seed=7)), ("4-bit", quantized_pair(4, 32, seed=7))):
        native = pair[1]
        if not native_decode.is_installed(native):
            out[name] = {"installed": False}
            continue
        steps = counted_calls(native.model._mlxcel_native, "_step")
        worst = greedy_both(pair, ROWS, steps=STEPS)
        out[name] = {"installed": True, "steps": steps[0], "diff": worst}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
