"""Run with a plain install of the wheel first on PYTHONPATH: `ensure_fast_blas()` as
`mlxcel-daemon start` calls it (it may re-exec this script with the gemm preload), then prints
one JSON object: where mlxcel.daemon was imported from, the native ops path, where each native
library came from, the library `cblas_sgemm` resolves to, and the few-row kernel's path."""

from __future__ import annotations

import json

from mlxcel.daemon.forward.blas import ensure_fast_blas


def main() -> None:
    ensure_fast_blas()  # may re-exec with the gemm preload, before anything native is loaded
    import mlxcel.daemon
    from mlxcel.daemon.forward import native_ops
    from mlxcel.daemon.forward.blas import (
        global_sgemm_library,
        native_gemm_path,
        native_libraries,
    )

    result = {
        "package": mlxcel.daemon.__file__,
        "ops": native_ops.path(),
        "libs": native_libraries(),
        "sgemm": global_sgemm_library(),
        "gemm": native_gemm_path(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
