"""bench/attention.py's correctness part on the CPU (Triton interpreter, small shapes): every arm it times is
checked against the fp32 reference first, and a wrong arm is caught."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter tests")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_quick_rows_check_every_arm_and_pass() -> None:
    import attention

    row = attention.run_shape(*attention.QUICK_SHAPES[0], "cpu", True, None, 0.0)
    assert set(row["checks"]) == set(attention.arms(1, 2, attention.QUICK_SHAPES[0][1]))
    assert "sdpa (peer)" in row["checks"] and all(c["ok"] for c in row["checks"].values()), row["checks"]


def test_an_arm_that_drops_the_mask_fails_its_check(monkeypatch) -> None:
    import attention

    real = attention.call

    def unmasked(splits, q, k, v, mask, scale, out):
        return real(splits, q, k, v, None if splits == 1 else mask, scale, out)

    monkeypatch.setattr(attention, "call", unmasked)
    row = attention.run_shape(*attention.QUICK_SHAPES[0], "cpu", True, None, 0.0)
    assert not row["checks"]["moefx, 1 slices"]["ok"]
    assert row["checks"]["sdpa (peer)"]["ok"]
