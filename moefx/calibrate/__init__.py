"""Calibration: measure where moefx's kernels beat the upstream path on this device, for every row a plan reads
(MoE experts in `moe`, dense linears in `dense`), with one timing core (`sweep`). `moefx calibrate` drives it."""
