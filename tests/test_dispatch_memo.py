"""The per-key memos of the ops' dispatch (kernels/memo.py): a memoized decision equals the one made afresh for
every key, a key never answers for another, and env overrides and new calibration tables are honoured at once."""

from __future__ import annotations

import itertools

import pytest
import torch

from moefx.backends import dense as D
from moefx.backends import dense_policy as P
from moefx.backends import op
from moefx.backends.calibration import CalibrationRow, key_for_tensors, parse_ranges, write_row
from moefx.kernels.memo import ShapeMemo

pytestmark = pytest.mark.usefixtures("isolated_moe_tables")
E, H, I, TOPK = 8, 64, 32, 2


def _moe(m: int, dtype=torch.float32, transposed: bool = False):
    g = torch.Generator().manual_seed(m)
    hidden = torch.randn(m, H, generator=g).to(dtype)
    ids = torch.randint(0, E, (m, TOPK), generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g).to(dtype)
    if transposed:  # the same shape, not contiguous in its last dim: the Triton backends refuse it
        w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
    return hidden, ids, w13, torch.randn(E, H, I, generator=g).to(dtype)


def _moe_table(tmp_path, ranges: str = "gemv@1-4,grouped@5-16,reference@17-") -> None:
    hidden, ids, w13, _ = _moe(1)
    path = tmp_path / "xdg" / "moefx" / "calibration" / "cpu.yaml"
    for mode in ("eager", "capture"):
        key = key_for_tensors(hidden, ids, w13, None, mode)
        write_row(path, CalibrationRow(key, parse_ranges(ranges, "test"), {"date": "2026-12-01"}, ""))


def _moe_choice(m, dtype, transposed, backend, upstream, capturing, activation):
    hidden, ids, w13, w2 = _moe(m, dtype, transposed)
    try:
        return op.select_backend(hidden, ids, w13, w2, backend=backend, upstream=upstream, capturing=capturing,
                                 activation=activation)
    except RuntimeError as exc:  # a host-syncing backend inside capture: raised on every call
        return f"error: {exc}"


MOE_CASES = list(itertools.product(
    (1, 4, 5, 16, 17, 300), (torch.float32, torch.bfloat16), (False, True),
    ("auto", "gemv", "grouped", "reference", "eager=gemv@1-8,grouped@9-;capture=grouped@1-"),
    ("reference", "transformers"), (False, True), ("silu", "gelu"),
))


def test_moe_memo_equals_a_fresh_decision_for_every_key(tmp_path):
    _moe_table(tmp_path)
    op._DECISIONS.clear()
    memoized = [_moe_choice(*case) for case in MOE_CASES]  # each key decided once, then looked up
    assert len(op._DECISIONS) > 100
    again = [_moe_choice(*case) for case in MOE_CASES]
    fresh = []
    for case in MOE_CASES:
        op._DECISIONS.clear()
        fresh.append(_moe_choice(*case))
    assert memoized == again == fresh
    # the table's ranges, the fallback for refused inputs and capture's refusal all show up among the answers
    assert {"gemv", "grouped", "reference", "transformers"} <= set(memoized)
    assert any(a.startswith("error: ") for a in memoized)


def test_moe_env_override_and_new_tables_are_honoured_at_once(tmp_path, monkeypatch):
    hidden, ids, w13, w2 = _moe(2)

    def choose() -> str:
        return op.select_backend(hidden, ids, w13, w2, upstream="transformers", capturing=False)

    assert choose() == "transformers"  # no row
    _moe_table(tmp_path)  # write_row invalidates the table cache: a new generation, a new key
    assert choose() == "gemv"
    monkeypatch.setenv("MOEFX_MOE_BACKEND", "reference")
    assert choose() == "reference"
    monkeypatch.setenv("MOEFX_MOE_BACKEND", "grouped")
    assert choose() == "grouped"
    monkeypatch.delenv("MOEFX_MOE_BACKEND")
    assert choose() == "gemv"
    monkeypatch.setenv("MOEFX_USE_GEMV", "0")  # the on/off gemv switch turns gemv's range upstream
    with pytest.warns(UserWarning, match="older spelling of MOEFX_MOE_BACKEND"):
        assert choose() == "transformers"
    monkeypatch.setenv("MOEFX_MOE_BACKEND", "fastest")
    for _ in range(2):  # a bad value is never memoized: every call says so
        with pytest.raises(ValueError, match="MOEFX_MOE_BACKEND"):
            choose()


def test_moe_fallback_warns_again_for_a_memoized_key(monkeypatch):
    import moefx.log

    hidden, ids, w13, w2 = _moe(2, transposed=True)
    args = (hidden, ids, w13, w2)
    with pytest.warns(UserWarning, match="cannot run these inputs"):
        assert op.select_backend(*args, backend="gemv", capturing=False) == "reference"
    monkeypatch.setattr(moefx.log, "_warned", set())  # a fresh process's one-time warnings
    with pytest.warns(UserWarning, match="cannot run these inputs"):
        assert op.select_backend(*args, backend="gemv", capturing=False) == "reference"


def _dense_table(tmp_path, x, ws) -> None:
    timings = {"gemv": {1: 1.0, 8: 1.0}, "upstream": {1: 2.0, 8: 2.0}}
    path = tmp_path / "xdg" / "moefx" / "calibration" / "dense.yaml"
    for mode in ("eager", "capture"):
        key = P.dense_key(x.device, [w.shape[0] for w in ws], x.shape[-1], x.dtype, None, mode)
        P.write_dense_row(path, P.DenseRow(key, parse_ranges("gemv@1-4,upstream@5-", "test"), {"date": "x"}, "",
                                           timings))


def _dense_choice(rows, ns, dtype, strided, backend, capturing):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 16, generator=g).to(dtype)
    ws = [torch.randn(n, 32 if strided else 16, generator=g).to(dtype)[:, :16] for n in ns]
    return D.select_backend(x, ws, [], None, None, backend=backend, capturing=capturing)


DENSE_CASES = list(itertools.product(
    (1, 4, 5, 8, 9), ((12, 8), (12,), (8, 12)), (torch.float32, torch.bfloat16), (False, True), ("auto", "gemv"),
    (False, True),
))


def test_dense_memo_equals_a_fresh_decision_for_every_key(tmp_path, monkeypatch):
    monkeypatch.delenv(P.ENV, raising=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, generator=g)
    _dense_table(tmp_path, x, [torch.randn(12, 16), torch.randn(8, 16)])
    D._DECISIONS.clear()
    memoized = [_dense_choice(*case) for case in DENSE_CASES]
    fresh = []
    for case in DENSE_CASES:
        D._DECISIONS.clear()
        fresh.append(_dense_choice(*case))
    assert memoized == fresh
    assert {"gemv", "upstream"} <= set(memoized)
    monkeypatch.setenv(P.ENV, "upstream")
    assert _dense_choice(1, (12, 8), torch.float32, False, "auto", False) == "upstream"
    monkeypatch.setenv(P.ENV, "gemv")
    assert _dense_choice(9, (12, 8), torch.float32, False, "auto", False) == "gemv"
    monkeypatch.delenv(P.ENV)
    assert _dense_choice(9, (12, 8), torch.float32, False, "auto", False) == "upstream"


def test_shape_memo_is_bounded():
    memo = ShapeMemo(maxsize=3)
    for i in range(5):
        memo.put(i, str(i))
    assert len(memo) == 3 and memo.get(0) is None and memo.get(4) == "4"


def test_routing_checks_raise_on_every_call_and_valid_keys_run():
    from moefx.backends.routing import fused_topk_torch

    logits = torch.randn(5, 8)
    for _ in range(2):  # a bad key is never memoized
        with pytest.raises(ValueError, match="top_k=9"):
            torch.ops.moefx.fused_topk(logits, 9, "softmax", True, None, 1, 1, 1.0)
    for _ in range(2):
        w, ids = torch.ops.moefx.fused_topk(logits, 2, "softmax", True, None, 1, 1, 1.0)
        want_w, want_ids = fused_topk_torch(logits, 2)
        assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
