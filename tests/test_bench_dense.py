"""bench/dense.py's correctness part on the CPU (Triton interpreter, tiny shapes): every row it checks before timing,
the decode-layer forms included, passes, and a form whose routing is wrong is caught."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton interpreter tests")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_quick_check_passes_every_row_and_covers_the_forms() -> None:
    import dense

    rows = dense.check("cpu", dense.QUICK_SHAPES, torch.Generator().manual_seed(0), quick=True)
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    forms = {(r["shape"], r["M"]) for r in rows if r["shape"] in dense.FORMS}
    assert forms == {(f, m) for f in dense.FORMS for m in dense.FORM_MS}


def test_a_form_whose_ids_come_back_reordered_fails_its_check(monkeypatch) -> None:
    import dense

    gen = torch.Generator().manual_seed(1)
    ns, k, _ = dense.QUICK_SHAPES["router"]
    form = dense.Form("router+add+norm+route", dense.Problem(ns, k, False, "cpu", gen), gen, quick=True)
    assert form.check(2, gen)["ok"]
    real = form.call

    def ids_reversed(backend, x, r, i=0):
        out = real(backend, x, r, i)
        return out[:-1] + [out[-1].flip(-1)] if backend == "gemv" else out

    monkeypatch.setattr(form, "call", ids_reversed)
    row = form.check(2, gen)
    assert not row["ok"] and not row["exact"]
