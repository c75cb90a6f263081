"""bench/coldstart.py's Triton timing (plain Python against the installed Triton's hooks; no GPU, no compile)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_triton_times_sums_moefx_compiles_apart_from_cache_loads_and_counts_c_builds_since_the_mark(monkeypatch):
    pytest.importorskip("triton")
    import coldstart
    from triton import knobs
    from triton.runtime import build

    if not hasattr(getattr(knobs, "compilation", None), "listener"):
        pytest.skip("this Triton has no compilation listener (the bench then records no times)")
    monkeypatch.setattr(knobs.compilation, "listener", None)
    monkeypatch.setattr(build, "_build", lambda *a, **k: "built")
    record = coldstart._TritonTimes.install()
    assert record is not None

    def compiled(name: str, micros: int, hit: bool) -> None:
        times = knobs.CompileTimes(ir_initialization=micros, lowering_stages=[("ttir", micros)], store_results=0)
        knobs.compilation.listener(src=SimpleNamespace(fn=SimpleNamespace(__name__=name)), metadata={},
                                   metadata_group={}, times=times, cache_hit=hit)

    build._build()  # before the mark: transformers' compile in the saving process
    record.mark()
    compiled("_gemv_kernel", 500_000, False)
    compiled("_gemv_kernel", 100_000, True)
    compiled("triton_poi_fused_add_0", 900_000, False)  # inductor's: not moefx's
    assert build._build() == "built"
    got = record.of({"_gemv_kernel"})
    assert got["moefx_triton_compile_s"] == 1.0 and got["moefx_triton_load_s"] == 0.2
    assert got["moefx_triton_slowest"] == [("_gemv_kernel", 1.0)]
    assert got["triton_c_builds"] == 1 and got["triton_c_build_s"] >= 0
