"""torch_grouped backend (torch._grouped_mm) vs the reference oracle; its refusals."""

from __future__ import annotations

import pytest
import torch
from backends_util import BS, E, H, I, make_inputs, reference_ref, relerr, unsupported

from moefx.backends import BACKENDS

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,case", [(1, "random"), (5, "random"), (9, "zero_experts"), (7, "one_expert")])
def test_matches_reference(m: int, case: str, dtype: torch.dtype) -> None:
    dev = "cuda" if torch.cuda.is_available() and dtype == torch.bfloat16 else "cpu"
    inp = make_inputs(m, dtype, case, device=dev)
    be = BACKENDS["torch_grouped"]
    assert unsupported(be, inp["hidden"], inp["w13"], inp["w2"]) is None
    out = be(inp["hidden"], inp["topk_ids"], inp["topk_weights"], inp["w13"], inp["w2"])
    assert out.shape == (m, H) and out.dtype == dtype
    assert relerr(out, reference_ref(inp)) < BOUNDS[dtype]


def test_refuses_fp8_and_fp16() -> None:
    be = BACKENDS["torch_grouped"]
    inp = make_inputs(2, torch.float32, fp8=True)
    assert "FP8" in unsupported(be, inp["hidden"], inp["w13"], inp["w2"], inp["kw"]["w13_scale"], BS)
    with pytest.raises(ValueError, match="FP8"):
        be(inp["hidden"], inp["topk_ids"], inp["topk_weights"], inp["w13"], inp["w2"], **inp["kw"])
    x = torch.randn(2, H, dtype=torch.float16)
    w13, w2 = torch.randn(E, 2 * I, H, dtype=torch.float16), torch.randn(E, H, I, dtype=torch.float16)
    assert "fp32" in unsupported(be, x, w13, w2)
