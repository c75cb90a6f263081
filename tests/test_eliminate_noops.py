import torch
from torch.fx.experimental.proxy_tensor import make_fx

from moefx.testing import count_ops, run_passes

aten = torch.ops.aten
prims = torch.ops.prims


def _run(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    before = len(gm.graph.nodes)
    n = run_passes(gm, "eliminate_noops").rewrites
    return gm, n, before


def test_reshape_chain_and_round_trip_cast_are_removed():
    def f(x, w):
        g = x.view(-1, 4).view(8, 8)  # no-op together
        h = prims.convert_element_type(prims.convert_element_type(g * 2, torch.float32), torch.bfloat16)
        s = h[:, 0:8].expand(8, 8)
        return (s * w).reshape(4, 16).reshape(64)

    x, w = torch.randn(8, 8, dtype=torch.bfloat16), torch.randn(8, 8, dtype=torch.bfloat16)
    gm, n, before = _run(f, x, w)
    assert n >= 4
    assert count_ops(gm, aten.view.default) == 0
    assert count_ops(gm, prims.convert_element_type.default) == 0
    assert count_ops(gm, aten.reshape.default) == 1  # the chain at the end collapsed to one reshape
    assert len(gm.graph.nodes) < before
    for _ in range(3):
        x, w = torch.randn(8, 8, dtype=torch.bfloat16), torch.randn(8, 8, dtype=torch.bfloat16)
        assert torch.equal(gm(x, w), f(x, w))


def test_lossy_round_trip_and_real_reshapes_are_kept():
    def f(x):
        lossy = prims.convert_element_type(prims.convert_element_type(x, torch.bfloat16), torch.float32)
        return lossy.view(4, 16) + 1

    x = torch.randn(8, 8)
    gm, n, _ = _run(f, x)
    assert n == 0
    assert count_ops(gm, prims.convert_element_type.default) == 2
    assert count_ops(gm, aten.view.default) == 1
    assert torch.equal(gm(x), f(x))


def test_strided_slice_is_kept():
    def f(x):
        return x[:, 0:8:2] * 1.5

    x = torch.randn(4, 8)
    gm, n, _ = _run(f, x)
    assert n == 0 and count_ops(gm, aten.slice.Tensor) == 1
    assert torch.equal(gm(x), f(x))
