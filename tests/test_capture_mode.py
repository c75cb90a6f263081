"""`moefx.backends.capture_mode`: which calibration rows a backend decision reads (the CUDA side runs in
tests/test_generate_gpu.py, where direct steps and capture warm-ups must run the kernels a capture runs)."""

from __future__ import annotations

import pytest
import torch

from moefx.backends import capture_mode
from moefx.backends.capture_mode import as_captured, decides_as_captured


def test_as_captured_nests_restores_and_never_applies_to_cpu_tensors():
    x = torch.zeros(2)
    with as_captured():
        assert capture_mode._AS_CAPTURED.get() and not decides_as_captured(x)  # CPU rows have no capture mode
        with as_captured(False):
            assert capture_mode._AS_CAPTURED.get()  # an inner no-op does not end the outer one
    assert not capture_mode._AS_CAPTURED.get()
    with pytest.raises(RuntimeError), as_captured():
        raise RuntimeError("a failed step")
    assert not capture_mode._AS_CAPTURED.get()
