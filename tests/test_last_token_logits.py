"""FX-level tests of last_token_logits: selections after a linear move before it, numerics unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moefx.passes.last_token_logits import LastTokenLogits
from moefx.testing import decomposed_graph, run_passes

aten = torch.ops.aten
K, N = 48, 80


def post_grad(fn, *args, mode="symbolic"):
    return decomposed_graph(fn, *args, tracing_mode=mode)


def run_pass(gm):
    run = run_passes(gm, LastTokenLogits, config={"pass_config": {"last_token_logits": True}})
    return run.rewrites, run.skipped


def mm_rows(gm) -> list[int]:
    """Row count of every matmul in the graph (symbolic sizes shown as -1)."""
    rows = []
    for n in gm.graph.nodes:
        if n.target in (aten.mm.default, aten.addmm.default):
            size = n.meta["val"].shape[0]
            rows.append(size if isinstance(size, int) else -1)
    return rows


def last(h, w):
    return F.linear(h, w)[:, -1, :]


def tail_bias(h, w, b):
    return F.linear(h, w, b)[:, -3:, :]


def packed_index_select(h, w, idx):
    return torch.index_select(F.linear(h, w), 0, idx)


def packed_gather(h, w, idx):
    logits = F.linear(h, w)
    return torch.gather(logits, 0, idx[:, None].expand(-1, logits.shape[-1]))


def cast_then_select(h, w):
    return F.linear(h, w).float()[:, -1]


def fancy_index(h, w, idx):
    return F.linear(h, w)[:, idx]


def one_row(h, w):
    return F.linear(h, w)[5]


CASES = [
    (last, lambda: (torch.randn(3, 17, K), torch.randn(N, K)), [3]),
    (tail_bias, lambda: (torch.randn(2, 9, K), torch.randn(N, K), torch.randn(N)), [6]),
    (packed_index_select, lambda: (torch.randn(30, K), torch.randn(N, K), torch.tensor([4, 11, 29])), [3]),
    (packed_gather, lambda: (torch.randn(30, K), torch.randn(N, K), torch.tensor([0, 7, 7, 29])), [4]),
    (cast_then_select, lambda: (torch.randn(2, 12, K).bfloat16(), torch.randn(N, K).bfloat16()), [2]),
    (fancy_index, lambda: (torch.randn(2, 12, K), torch.randn(N, K), torch.tensor([3, 11])), [4]),
    (one_row, lambda: (torch.randn(12, K), torch.randn(N, K)), [1]),
]


@pytest.mark.parametrize("fn,make,rows", CASES, ids=[c[0].__name__ for c in CASES])
def test_selection_moves_before_the_linear(fn, make, rows):
    gm = post_grad(fn, *make(), mode="fake")
    full_rows = mm_rows(gm)
    n, skipped = run_pass(gm)
    assert n == 1 and not skipped
    assert mm_rows(gm) == rows and rows[0] < full_rows[0]
    for _ in range(2):
        args = make()
        got, ref = gm(*args), fn(*args)
        assert got.shape == ref.shape and got.dtype == ref.dtype
        # The same dot products; a GEMM may block its reduction differently for fewer rows, so compare
        # with a round-off bound (fp32: 1e-6 relative; bf16 outputs: 1 ulp flips, 8e-3 relative).
        bound = 1e-6 if ref.dtype == torch.float32 else 8e-3
        err = (got.float() - ref.float()).norm() / ref.float().norm()
        assert err < bound, err


def test_bit_identical_to_selecting_first():
    """The rewritten graph is exactly what `lm_head(h[:, -1])` (HF's logits_to_keep) computes."""
    gm = post_grad(last, torch.randn(3, 17, K), torch.randn(N, K), mode="fake")
    run_pass(gm)
    h, w = torch.randn(3, 17, K), torch.randn(N, K)
    assert torch.equal(gm(h, w), F.linear(h[:, -1, :], w))


def test_dynamic_sequence_length():
    gm = post_grad(last, torch.randn(2, 9, K), torch.randn(N, K))
    n, _ = run_pass(gm)
    assert n == 1
    for t in (5, 31):
        h, w = torch.randn(2, t, K), torch.randn(N, K)
        assert torch.equal(gm(h, w), F.linear(h[:, -1, :], w))


def feature_slice(h, w):
    return F.linear(h, w)[..., :10]


def also_full(h, w):
    logits = F.linear(h, w)
    return logits, logits[:, -1]


def masked_rows(h, w, keep):
    return F.linear(h, w)[keep]


@pytest.mark.parametrize(
    "fn,args,reason",
    [
        (feature_slice, (torch.randn(2, 5, K), torch.randn(N, K)), "output-feature dim"),
        (also_full, (torch.randn(2, 5, K), torch.randn(N, K)), "other consumers"),
        (masked_rows, (torch.randn(7, K), torch.randn(N, K), torch.rand(7) > 0.5), "boolean-mask"),
    ],
    ids=["feature_dim", "full_logits_used", "bool_mask"],
)
def test_unsupported_forms_are_reported_and_unchanged(fn, args, reason):
    gm = post_grad(fn, *args, mode="fake")
    before = str(gm.graph)
    n, skipped = run_pass(gm)
    assert n == 0 and str(gm.graph) == before
    assert any(reason in s for s in skipped), skipped


def expand_rows(h, w, idx):
    return F.linear(h, w)[idx]


def test_an_index_that_repeats_rows_is_not_moved():
    """Moving a top-k style expansion (more rows than the input) before the matmul would add work."""
    gm = post_grad(expand_rows, torch.randn(5, K), torch.randn(N, K), torch.randint(0, 5, (40,)), mode="fake")
    n, skipped = run_pass(gm)
    assert n == 0 and any("fewer rows" in s for s in skipped)
