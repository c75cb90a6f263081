"""bench/e2e.py's CPU smoke path: the tiny model, balanced routing, decode and TTFT rows, JSON that bench/report.py
renders (hf_compiled is left out: an inductor compile of the forward is minutes on a small CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_e2e_tiny_cpu_writes_decode_and_ttft_rows(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "bench" / "e2e.py"), "--tiny", "--device", "cpu", "--layers", "2",
           "--batches", "2", "--arms", "hf_eager,moefx", "--mode", "eager", "--prompt", "8", "--n1", "2", "--n2", "4",
           "--eager-n", "2,4", "--runs", "1", "--ttft", "8", "--ttft-batch", "2x8", "--ttft-arms", "hf_eager,moefx",
           "--ttft-batch-arms", "moefx", "--fp8", "--score-batches", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "e2e_2l.json").read_text())
    assert r["routing"] == "balanced" and not (r["extra"].get("errors"))
    assert {x["arm"] for x in r["decode"]} == {"hf_eager", "moefx", "moefx_fp8"}
    for row in r["decode"]:
        assert row["routing"] == "balanced" and 1 <= row["experts_hit"] <= 8  # the tiny model: 8 experts, top-2
        # every arm scored by the fp32 forward of its own weights (fp32 on the CPU: the same math, up to rounding)
        assert row["scored_steps"] == 2 * 4 and row["argmax_share"] >= 0.85 and row["max_gap_std"] < 0.1, row
    ttft = {(t["arm"], t["B"], t["tokens"]): t for t in r["ttft"]}
    assert set(ttft) == {("hf_eager", 1, 8), ("moefx", 1, 8), ("moefx", 2, 8)}  # 2x8 only in --ttft-batch-arms
    for t in ttft.values():
        assert t["ms"] > 0 and t["prof_wall_ms"] > 0 and t["floor_ms"] == max(t["flop_floor_ms"], t["bytes_floor_ms"])
        assert t["kernels"] == 0 and t["top_kernels"] == []  # no GPU here: the profiler sees no kernels
        assert t["routing"] == "balanced" and 1 <= t["experts_hit"] <= 8

    sys.path.insert(0, str(ROOT))  # the bench package
    from bench.sections import e2e as e2e_section

    page = e2e_section.render_e2e({**r, "_file": "e2e.json"})
    assert "### Time to first token" in page and "experts hit / layer" in page and "(balanced)" in page
    assert "fp32 argmax %" in page and "`moefx_fp8`: +" in page and "within the bound" in page


def test_e2e_tiny_cpu_writes_forward_and_training_rows(tmp_path):
    """The forward section's smoke path: moefx's forward and TTFT rows at two shapes, a training step, the page's
    table (mode eager and no torch.compile arm: an inductor compile is minutes on a small CPU)."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "bench" / "e2e.py"), "--tiny", "--device", "cpu", "--layers", "2",
           "--batches", "", "--arms", "moefx", "--mode", "eager", "--runs", "1", "--forward", "16",
           "--forward-batch", "2x8", "--forward-arms", "moefx_forward,moefx_ttft,moefx_ttft_copies", "--train",
           "--train-shape", "2x8", "--train-arms", "moefx", "--prefill-table", "--tag", "_forward"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "e2e_2l_forward.json").read_text())
    assert not r["extra"].get("errors")
    assert {(t["arm"], t["B"], t["tokens"]) for t in r["forward"]} == {
        (arm, b, t) for arm in ("moefx_forward", "moefx_ttft") for b, t in ((1, 16), (2, 8))}
    # the eager CPU engine has no padded prefill: the arms that set its KV write say so instead of a row
    assert "no padded prefill on this engine: moefx_ttft_copies not run" in proc.stdout
    (step,) = r["train"]
    assert step["arm"] == "moefx" and step["ms"] > 0 and step["loss"] > 0 and (step["B"], step["tokens"]) == (2, 8)

    sys.path.insert(0, str(ROOT))  # the bench package
    from bench.sections import forward as forward_section

    page = forward_section.render_forward({**r, "_file": "forward.json"})
    assert "### Forward" in page and "Training step" in page and "`moefx_forward`" in page
    # the prefill table's profiled calls (no GPU here: no kernels, only the host time)
    table = r["extra"]["prefill_profile_2"]
    assert set(table) == {"moefx_forward", "moefx_ttft"} and set(table["moefx_forward"]) == {"1x16", "2x8"}
    assert all(p["host_us"] > 0 and p["kernels"] == [] for shapes in table.values() for p in shapes.values())
    assert "Where the 2-layer prefill goes (`moefx_forward`" in page


def test_step_variants_change_their_setting_and_their_undo_restores_it():
    """Each before/after variant of bench/e2e.py's decode step changes what the kernels' launchers read, and its undo
    leaves the defaults (a later arm of the same process must not run under an earlier arm's variant)."""
    sys.path.insert(0, str(ROOT))
    from bench.e2e import STEP_VARIANTS
    from moefx.kernels import decode_attn, pdl

    def state():
        return dict(pdl._STEP), decode_attn.SPECULATE_DEFAULT, decode_attn.speculates(256, 4)

    default = state()
    # 4 slices of a 256-long cache: one block each
    changed = {"pdl_off": lambda s: s[0] == {"chain": False}, "pdl_chain": lambda s: s[0] == {"chain": True},
               "attn_loads_after_mask": lambda s: s[2] is False, "attn_loads_with_mask": lambda s: s[2] is True}
    assert set(changed) == set(STEP_VARIANTS)
    for name, (what, apply) in STEP_VARIANTS.items():
        assert what
        undo = apply()
        assert changed[name](state()), name
        undo()
        assert state() == default, name
