"""The CPU forward: how a loaded model's forward runs on this machine.

`forward_plan.py` picks, per model, what runs (the plan the log and `status` show);
`fast_forward.py` fuses mlx-lm's decoder layers for the CPU backend, `packed_forward.py` runs
several cohorts' rows in one forward, `native_decode.py` the decode and chunk steps in C;
`native_ops.py` loads the fused C ops, `blas.py` builds the native libraries and sets up
OpenBLAS with the few-row sgemm kernel in front of it (`native/`: the C sources, compiled by
setup.py's build step or at first start). docs/cpu-kernels.md has the kernels' detail.
"""
