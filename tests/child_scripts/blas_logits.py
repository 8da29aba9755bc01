"""The tiny model's float32 logits for a two-row batch, saved to a .npy file; prints the BLAS in
use and the one the loaded model reports (`openblas openblas` or `reference reference`).

Usage: blas_logits.py MODEL_DIR OUT_NPY
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
from mlxcel.daemon.forward.blas import blas_name
from mlxcel.daemon.models import load_model


def main(model_dir: str, out_npy: str) -> None:
    loaded = load_model(model_dir, dtype="float32")
    ids = loaded.tokenizer.encode("What is the capital of France? " * 8)
    logits = loaded.model(mx.array([ids, ids[::-1]]))
    np.save(out_npy, np.array(logits))
    print(blas_name(), loaded.info.blas)


if __name__ == "__main__":
    main(*sys.argv[1:3])
