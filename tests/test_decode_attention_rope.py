"""moefx::decode_attention_rope: the q/k norm, RoPE and cache write folded into the decode attention kernel, against
the two ops it replaces (moefx::qk_norm_rope_cache's reference, then the attention over the cache): the output and
both caches, in the Triton interpreter on CPU tensors (fp32 and bf16), one slice and several with the step's
position in the first, a middle and the last one; the op on CPU is that reference; on the GPU (marked gpu) in bf16."""

from __future__ import annotations

import os

import pytest
import torch

from moefx.ops.decode_attention import (
    decode_attention_reference,
    decode_attention_rope_reference,
    rope_unsupported_reason,
)
from moefx.ops.rope_cache import qk_norm_rope_cache_reference

CASES = [  # batch, q heads, kv heads, cache length, head dim, splits, the step's position, norm weights, mask
    (1, 8, 2, 40, 32, 1, 17, True, "causal"),
    (2, 8, 2, 200, 32, 4, 0, True, "causal"),  # the first slice writes
    (2, 16, 2, 300, 32, 4, 150, False, "causal"),  # a middle slice
    (1, 8, 1, 256, 64, 4, 255, True, None),  # the last position of the last slice, no mask
    (3, 6, 2, 130, 32, 3, 64, True, "holes"),  # groups of 3; a slice boundary; masked holes before the position
]


def _inputs(case, dtype, device="cpu"):
    batch, hq, hkv, length, d, _, pos, with_weight, mask_kind = case
    g = torch.Generator().manual_seed(length + pos)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    qkv = r(batch, 1, (hq + 2 * hkv) * d)  # q, k, v as views of one projection output, as in the graph
    q = qkv[..., : hq * d].view(batch, 1, hq, d)
    k = qkv[..., hq * d: (hq + hkv) * d].view(batch, 1, hkv, d)
    v = qkv[..., (hq + hkv) * d:].view(batch, 1, hkv, d)
    weights = (r(d), r(d)) if with_weight else (None, None)
    angles = torch.rand(1, 1, d, generator=g) * 6.3
    cos, sin = torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)
    keys, values = r(batch, hkv, length, d), r(batch, hkv, length, d)
    mask = None
    if mask_kind is not None:
        mask = (torch.arange(length)[None, :] <= pos).expand(batch, length).clone()
        if mask_kind == "holes":
            mask &= torch.rand(batch, length, generator=g) > 0.3
            mask[:, pos] = True
    args = [q, k, v, *weights, 1e-6, cos, sin, keys, values, torch.tensor([pos]), mask, d ** -0.5]
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def _both(args, launch):
    """(got, want): the output and the two caches of `launch` and of the reference, each on its own cache copies."""
    ref, mine = list(args), list(args)
    ref[8:10] = [t.clone() for t in args[8:10]]
    mine[8:10] = [t.clone() for t in args[8:10]]
    want = decode_attention_rope_reference(*ref)
    got = launch(mine)
    return (got, mine[8], mine[9]), (want, ref[8], ref[9])


def _check(got, want, dtype, output: bool = True) -> None:
    """`output`: compare the attention's output too (not in bf16 in the interpreter, whose bf16 attention gives
    garbage for moefx::decode_attention's kernel alike: the GPU test checks it)."""
    (out, keys, values), (w_out, w_keys, w_values) = got, want
    assert torch.equal(values, w_values)  # the value row is copied
    if dtype == torch.float32:
        torch.testing.assert_close(keys, w_keys, rtol=0, atol=4e-6 * float(w_keys.abs().max()))
        assert ((out - w_out).norm() / w_out.norm()).item() < 1e-5
        return
    # bf16: rounded as the eager code rounds, but where the norm's rstd differs in its last bit (few elements)
    diff = (keys.float() - w_keys.float()).abs()
    assert (diff > 0).float().mean().item() < 0.005 and float(diff.max()) <= 2 ** -6 * float(w_keys.abs().max())
    assert not output or ((out.float() - w_out.float()).norm() / w_out.float().norm()).item() < 1e-2


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the kernel on CPU tensors runs in the Triton interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}/{c[2]}x{c[3]}-pos{c[6]}-s{c[5]}" for c in CASES])
def test_kernel_matches_the_two_ops(dtype, case):
    from moefx.kernels.decode_attn import decode_attention_rope_triton

    args = _inputs(case, dtype)
    assert rope_unsupported_reason(*args[:5], *args[6:12]) is None

    def launch(a):
        out = torch.full((case[0], case[1], 1, case[4]), float("nan"), dtype=dtype)
        decode_attention_rope_triton(*a, out, case[5])
        return out

    _check(*_both(args, launch), dtype, output=dtype == torch.float32)


def test_the_op_on_cpu_is_the_two_ops_and_inputs_are_checked():
    case = CASES[2]
    args = _inputs(case, torch.float32)
    got, want = _both(args, lambda a: torch.ops.moefx.decode_attention_rope(*a))
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    keys, values = args[8].clone(), args[9].clone()
    q_out = qk_norm_rope_cache_reference(*args[:8], keys, values, args[10])
    assert torch.equal(want[0], decode_attention_reference(q_out, keys, values, args[11], args[12]))
    assert "one query position" in rope_unsupported_reason(torch.randn(2, 3, 16, 32), *args[1:5], *args[6:12])
    assert "mask" in rope_unsupported_reason(*args[:5], *args[6:11], torch.ones(2, 5, dtype=torch.bool))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch,length,pos", [(1, 256, 130), (16, 512, 300), (1, 4096, 4000)])
def test_the_op_on_cuda_matches_the_two_ops_in_bf16(batch, length, pos):
    """Qwen3-30B-A3B's attention (32 query heads, 4 KV heads, head_dim 128), the op's own slice count."""
    case = (batch, 32, 4, length, 128, 0, pos, True, "causal")
    args = _inputs(case, torch.bfloat16, "cuda")
    args[11] = args[11].cuda()
    assert rope_unsupported_reason(*args[:5], *args[6:12]) is None
    _check(*_both(args, lambda a: torch.ops.moefx.decode_attention_rope(*a)), torch.bfloat16)
