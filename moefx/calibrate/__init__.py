"""Calibration: measure where moefx's kernels beat the upstream path on this device, for every row a plan reads
(MoE experts in `moe`, dense linears in `dense`), with one timing core (`sweep`). `moefx calibrate` drives it."""

QUANTS = ("none", "fp8-block128")  # the weight formats a row is measured in (no torch: the CLI's --help reads it)
PARTS = ("moe", "dense")  # what a row is measured for
