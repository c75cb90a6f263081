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


def test_every_slice_count_runs_both_forms_of_the_k_v_loads(monkeypatch) -> None:
    """Each slice count as the op runs it (speculate None) and forced into the other form: with the loads behind the
    mask by default every twin is "speculative loads on"; with SPECULATE_DEFAULT on, short slices speculate and their
    twin is "off", long ones do not and theirs is "on"."""
    import attention

    from moefx.kernels import decode_attn

    short = attention.arms(1, 4, 256)  # the op's 4 slices of 64 positions
    assert short["moefx (4 slices, the op's choice)"] == (4, None)
    assert short["moefx, speculative loads on"] == (4, True)
    assert short["moefx, 1 slices"] == (1, None) and short["moefx, 1 slices, speculative loads on"] == (1, True)
    forms = sorted((a.splits, a.speculate is None) for a in short.values() if a is not None)
    assert forms == sorted((s, as_op) for s in attention.SPLITS for as_op in (True, False)), short
    monkeypatch.setattr(decode_attn, "SPECULATE_DEFAULT", True)
    short = attention.arms(1, 4, 256)
    assert short["moefx, speculative loads off"] == (4, False)
    assert short["moefx, 1 slices, speculative loads on"] == (1, True)  # one slice of 4 blocks: too long to speculate
    assert attention.arms(64, 4, 4352)["moefx, speculative loads on"] == (2, True)  # the op's 2 slices of 2176


def test_an_arm_that_drops_the_mask_fails_its_check(monkeypatch) -> None:
    import attention

    real = attention.call

    def unmasked(arm, q, k, v, mask, scale, out):
        return real(arm, q, k, v, None if arm == (1, None) else mask, scale, out)

    monkeypatch.setattr(attention, "call", unmasked)
    row = attention.run_shape(*attention.QUICK_SHAPES[0], "cpu", True, None, 0.0)
    assert not row["checks"]["moefx, 1 slices"]["ok"]
    assert row["checks"]["sdpa (peer)"]["ok"]
