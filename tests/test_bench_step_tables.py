"""The decode and prefill step tables of docs/PERFORMANCE.md (bench/sections/): one kernel classification for both,
the FP8 decode table's floors from FP8 weights, the H100 run's tables under its own heading, and the prefill
profile's timeline figures (bench/e2e.py's `kernel_timeline`). Plain Python except the last, which imports
bench/e2e.py (torch)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the bench package

from bench import report  # noqa: E402
from bench.sections import e2e as e2e_section  # noqa: E402
from bench.sections import forward as forward_section  # noqa: E402
from bench.sections import kernel_kinds as kinds  # noqa: E402

KEPT_E2E = ROOT / "bench" / "results" / "e2e_h200_2026-12-03.json"


@pytest.mark.parametrize(("kernel", "kind"), [
    ("_dense_kernel", "dense"), ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "dense"),
    ("_gemv_gate_up_kernel", "moe"), ("_gemm1_kernel", "moe"), ("_align_scatter_kernel", "moe"),
    ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6GroupProblemShape", "moe"),
    ("_decode_attn_kernel", "attention"), ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", "attention"),
    ("_fused_topk_kernel", "router"), ("_qk_norm_rope_cache_kernel", "rope"), ("_quant_kernel", "quant"),
    ("triton_per_fused__scaled_dot_product_cudnn_attention__to_copy_add_cat_mean", "inductor"),
    ("Memset (Unknown)", "other"), ("void at::native::elementwise_kernel<128, 4>", "other"),
])
def test_one_classification_for_both_tables(kernel, kind):
    assert kinds.classify(kernel) == kind


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _h100(e2e: dict) -> dict:
    """The kept H200 decode run dressed as an H100 run with an FP8 arm and its profile."""
    r = copy.deepcopy(e2e)
    r["device"] = "NVIDIA H100 80GB HBM3"
    r["ceilings"]["hbm_copy_TBps"] = 3.02
    bf16 = next(d for d in r["decode"] if (d["layers"], d["B"], d["arm"]) == (48, 1, "moefx"))
    r["decode"].append({**bf16, "arm": "moefx_fp8", "dtype": "fp8_block128", "tok_s": 450.0})
    fp8 = [dict(k) for k in r["extra"]["profile_B1_48"]]
    for k in fp8:
        if k["kernel"].startswith(("_dense_kernel", "_gemv")):
            k["us_per_step"] /= 2
    fp8.append({"kernel": "_quant_kernel", "us_per_step": 96.0, "calls_per_step": 96.0})
    r["extra"]["profile_fp8_B1_48"] = fp8
    return r


def test_fp8_step_table_has_fp8_floors_and_renders_under_the_h100_heading():
    kept = {**json.loads(KEPT_E2E.read_text()), "_file": "e2e_h200.json"}
    page = e2e_section.render_e2e(kept)
    assert "Where the 48-layer B=1 step goes" in page and "FP8 step" not in page  # the kept run: bf16 only

    h100 = {**_h100(kept), "_file": "e2e_h100.json"}
    full = report.render({"e2e": kept}, {"h100-80gb-hbm3": {"e2e": h100}})
    h100_part = full[full.index("## On the NVIDIA H100 80GB HBM3"):]
    assert "Where the 48-layer B=1 FP8 step goes (the same run's `moefx_fp8` row" in h100_part
    assert "Where the 48-layer B=1 FP8 step goes" not in full[:full.index("## On the NVIDIA H100")]

    fp8_table = h100_part[h100_part.index("FP8 step goes"):]
    rows = {cells[0]: cells for cells in map(_cells, fp8_table.split("\n\n")[1].splitlines()[2:])}
    hit = next(d for d in h100["decode"] if (d["layers"], d["B"], d["arm"]) == (48, 1, "moefx_fp8"))["experts_hit"]
    w = kinds.layer_weights()
    moe_floor = hit * w["expert"] * kinds.WEIGHT_BYTES["fp8_block128"] / 3.02e6
    assert rows[kinds.BY_KEY["moe"].label][3] == f"{moe_floor:.1f}"  # one byte a weight (and the block scales)
    dense_floor = (w["attn"] * kinds.WEIGHT_BYTES["fp8_block128"] + w["router"] * 2) / 3.02e6  # the router: bf16
    assert rows[kinds.BY_KEY["dense"].label][3] == f"{dense_floor:.1f}"
    assert rows[kinds.BY_KEY["quant"].label][1:3] == ["2.00", "2.0"]  # a kind beyond the usual six, where it ran
    bf16_rows = h100_part[h100_part.index("B=1 step goes"):h100_part.index("FP8 step goes")]
    assert kinds.BY_KEY["quant"].label not in bf16_rows


def _forward_result() -> dict:
    kernels = [["_gemm1_kernel", 14000.0, 48], ["_gemm2_kernel", 7600.0, 48],
               ["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", 1400.0, 48],
               ["nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", 1200.0, 96],
               ["nvjet_sm90_tst_384x8_64x4_2x1_v_bz_TNT", 210.0, 1], ["_fused_topk_kernel", 330.0, 48],
               ["triton_red_fused__to_copy__unsafe_view_add_mean_mul_pow_rsqrt_3", 500.0, 48],
               ["Memset (Unknown)", 5.0, 3]]
    prof = dict(host_us=30500.0, host_before_first_kernel_us=850.0, kernel_span_us=27000.0,
                kernel_busy_us=sum(k[1] for k in kernels), kernels=kernels, experts_hit=128.0, ms=30.37)
    ttft = dict(prof, host_before_first_kernel_us=2100.0, ms=33.7)
    row = dict(layers=48, B=1, tokens=1024, arm="moefx_forward", ms=30.37, flop_floor_ms=10.0, bytes_floor_ms=19.9,
               x_floor=1.53, kernel_ms=29.9, kernels=980, routing="balanced", experts_hit=128.0, first_call_s=12.0)
    return {"stage": "forward", "date": "2026-12-07", "device": "NVIDIA H100 80GB HBM3", "_file": "f.json",
            "versions": {"torch": "2.11", "triton": "3.6", "transformers": "5.17"}, "commit": "abc",
            "command": "python3 bench/e2e.py --layers 48 --forward 1024 --prefill-table",
            "ceilings": {"hbm_copy_TBps": 3.0, "bf16_matmul_TFLOPs": 775.0}, "forward": [row],
            "extra": {"prefill_profile_48": {"moefx_forward": {"1x1024": prof}, "moefx_ttft": {"1x1024": ttft}}}}


def test_prefill_table_kinds_floors_gaps_and_host_time():
    r = _forward_result()
    page = forward_section.render_forward(r)
    assert "Where the 48-layer prefill goes (`moefx_forward`" in page
    rows = {cells[1]: cells for cells in map(_cells, page.splitlines()) if cells[0] == "1 × 1024"}
    moe = rows[kinds.BY_KEY["moe"].short]
    assert moe[2:4] == ["21.60", "96"]
    nbytes, nflops = kinds.prefill_floors(1, 1024, 48, 128.0)["moe"]
    assert moe[4] == f"{1e3 * nbytes / 3e12:.2f}" and moe[5] == f"{1e3 * nflops / 775e12:.2f}"
    assert rows[forward_section.PREFILL_ONCE][2:4] == ["0.21", "1"]  # the LM head's one GEMM, apart from the dense
    assert rows[kinds.BY_KEY["dense"].short][2:4] == ["1.20", "96"]
    assert rows[forward_section.PREFILL_OTHER][2:4] == ["0.01", "3"]
    busy = sum(k[1] for k in r["extra"]["prefill_profile_48"]["moefx_forward"]["1x1024"]["kernels"])
    assert rows["gaps between kernels"][2] == f"{(27000.0 - busy) / 1e3:.2f}"
    assert rows["host before the first kernel"][2] == "0.85"
    assert "1x1024: the largest loss is MoE experts" in page
    assert "`moefx_ttft` 1x1024: 2100 µs from the call to the first kernel" in page


def test_kernel_timeline_gaps_are_the_span_less_the_union_of_kernels():
    pytest.importorskip("torch")
    from bench.e2e import kernel_timeline

    kernels = [("a", 110.0, 120.0), ("b", 115.0, 130.0), ("a", 140.0, 150.0), ("c", 150.0, 151.0)]
    t = kernel_timeline(kernels, call_start=100.0, call_end=160.0)
    assert t["host_before_first_kernel_us"] == 10.0 and t["kernel_span_us"] == 41.0
    assert t["kernel_busy_us"] == 31.0  # 110-130 (two overlapping), 140-151
    assert t["kernels"][0] == ["a", 20.0, 2] and t["host_us"] == 60.0
    none = kernel_timeline([], 0.0, 5.0)
    assert none["kernel_busy_us"] is None and none["kernels"] == [] and none["host_us"] == 5.0
