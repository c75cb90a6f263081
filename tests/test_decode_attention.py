"""moefx::decode_attention: the Triton kernel (interpreter, fp32) against torch SDPA over the expanded heads; its
slices' combine (the last program of each (sequence, KV head)) independent of the arrival order, its counters left at
zero; its two forms of the K/V loads (with the mask or after it) bit-equal, NaN and inf in the positions the mask
drops reaching neither; on the GPU (marked gpu) in bf16, in one launch, deterministic and replayed from a CUDA
graph."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moefx.ops.decode_attention import decode_attention_reference, splits_for, unsupported_reason

CASES = [  # batch, q heads, kv heads, positions (none a multiple of the 64-position block), head dim, splits
    (1, 8, 1, 7, 16, 1),
    (2, 8, 2, 130, 32, 1),
    (3, 4, 4, 200, 16, 3),  # one head per group
    (1, 16, 2, 300, 64, 4),
    (2, 6, 2, 150, 16, 64),  # groups of 3 (padded to 4 rows in the combine); 64 asked, 3 slices of one block
    (2, 16, 2, 1000, 32, 16),
]


def _inputs(batch, hq, hkv, length, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, 1, d, generator=g)
    k, v = (torch.randn(batch, hkv, length, d, generator=g) for _ in range(2))
    return q, k, v


def _case_inputs(case, mask_kind):
    batch, hq, hkv, length, d, _ = case
    q, k, v = _inputs(batch, hq, hkv, length, d, seed=length)
    g = torch.Generator().manual_seed(1)
    if mask_kind == "none":
        mask = None
    elif mask_kind == "bool":  # a causal tail per row (a static cache's unwritten positions) and random holes
        valid = torch.randint(1, length + 1, (batch,), generator=g)
        mask = (torch.arange(length)[None, :] < valid[:, None]) & (torch.rand(batch, length, generator=g) > 0.2)
        mask[:, 0] = True
    else:
        mask = torch.where(torch.rand(batch, length, generator=g) > 0.3, 0.0, float("-inf"))
        mask[:, 0] = 0.0
        mask = mask + torch.randn(batch, length, generator=g) * (mask == 0)
    return q, k, v, mask


def _kernel(case, q, k, v, mask, speculate=None):
    """The kernel's output (`speculate` None: the launch plan's choice), its counters checked back at zero."""
    from moefx.kernels import decode_attn as K

    out = torch.full_like(q, float("nan"))
    K.decode_attention_triton(q, k, v, mask, q.shape[-1] ** -0.5, out, case[-1], speculate)
    counters = K._COUNTERS.get(("cpu", None))
    assert counters is None or int(counters.count_nonzero()) == 0, case
    return out


def _run(case, mask_kind):
    q, k, v, mask = _case_inputs(case, mask_kind)
    out = _kernel(case, q, k, v, mask)
    return out, decode_attention_reference(q, k, v, mask, q.shape[-1] ** -0.5)


def _check_cases() -> None:
    for case in CASES:
        for mask_kind in ("none", "bool", "float"):
            out, want = _run(case, mask_kind)
            err = ((out - want).norm() / want.norm()).item()
            assert err < 1e-5, (case, mask_kind, err)


def _poisoned(t: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """t [B, Hkv, L, D] with NaN, inf and -inf (in turn, by position) where `dropped` [B, L] is True: what an
    unwritten cache row may hold."""
    garbage = torch.tensor([float("nan"), float("inf"), float("-inf")])[torch.arange(t.shape[2]) % 3]
    return torch.where(dropped[:, None, :, None], garbage[None, None, :, None], t)


def _check_speculation() -> None:
    """K and V loaded with the mask (SPECULATE) or after it give the same bits at every case and mask, and NaN or inf
    at the positions the mask drops reach neither form's output (the reference sees finite values there); "tail"
    keeps only the first 40 positions, so whole blocks and slices hold nothing else."""
    for case in CASES:
        for mask_kind in ("none", "bool", "float", "tail"):
            if mask_kind == "tail":
                q, k, v, _ = _case_inputs(case, "none")
                mask = (torch.arange(case[3]) < 40)[None, :].expand(case[0], -1).contiguous()
            else:
                q, k, v, mask = _case_inputs(case, mask_kind)
            off = _kernel(case, q, k, v, mask, speculate=False)
            assert torch.equal(_kernel(case, q, k, v, mask, speculate=True), off), (case, mask_kind)
            if mask is None:
                continue
            dropped = ~mask if mask.dtype == torch.bool else mask == float("-inf")
            if not dropped.any():
                continue
            k_bad, v_bad = _poisoned(k, dropped), _poisoned(v, dropped)
            want = decode_attention_reference(q, k, v, mask, q.shape[-1] ** -0.5)
            for speculate in (False, True):
                out = _kernel(case, q, k_bad, v_bad, mask, speculate)
                err = ((out - want).norm() / want.norm()).item()
                assert torch.equal(out, off) and err < 1e-5, (case, mask_kind, speculate, err)


def _check_arrival_order() -> None:
    """The interpreter runs a grid's programs in order, so the last slice arrives last; with the slice index
    reversed, slice 0 arrives last and combines: the output is the same bit for bit."""
    from triton.runtime.interpreter import interpreter_builder as builder

    from moefx.kernels.decode_attn import _COUNTERS

    in_order = {(case, kind): _run(case, kind)[0] for case in CASES if case[-1] > 1 for kind in ("bool", "float")}
    assert _COUNTERS, "no call took the several-slice path"
    forward = builder.set_grid_idx
    builder.set_grid_idx = lambda x, y, z: forward(x, builder.grid_dim[1] - 1 - y, z)
    try:
        for (case, kind), first in in_order.items():
            assert torch.equal(_run(case, kind)[0], first), (case, kind)
    finally:
        del builder.set_grid_idx


def _interpreted(calls: str) -> None:
    """`calls` (functions of this module) in one subprocess with TRITON_INTERPRET=1, set before triton is imported."""
    code = f"import tests.test_decode_attention as t; {calls}; print('ok')"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr


needs_triton = pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="needs triton")


@needs_triton
def test_kernels_match_sdpa_under_the_interpreter():
    """Every case, then the slices' combine with the programs in reverse order."""
    _interpreted("t._check_cases(); t._check_arrival_order()")


@needs_triton
def test_speculative_loads_give_the_same_bits_under_the_interpreter():
    """Both forms of the K/V loads bit-equal, NaN and inf in the dropped positions reaching neither
    (_check_speculation)."""
    _interpreted("t._check_speculation()")


def test_op_on_cpu_is_sdpa_and_shapes_are_checked():
    q, k, v = _inputs(2, 8, 2, 40, 32, seed=0)
    out = torch.ops.moefx.decode_attention(q, k, v, None, 0.2)
    assert torch.allclose(out, decode_attention_reference(q, k, v, None, 0.2))
    assert unsupported_reason(q, k, v, None) is None
    assert "one query position" in unsupported_reason(torch.randn(2, 8, 3, 32), k, v, None)
    assert "head_dim" in unsupported_reason(torch.randn(2, 8, 1, 24), torch.randn(2, 2, 4, 24),
                                            torch.randn(2, 2, 4, 24), None)
    assert "mask" in unsupported_reason(q, k, v, torch.ones(2, 39, dtype=torch.bool))
    assert splits_for(1, 4, 64) == 1 and splits_for(1, 4, 256) == 4 and splits_for(64, 4, 4352) == 2
    assert splits_for(1, 4, 1024) == 16 and splits_for(1, 4, 4096) == 32  # MAX_SPLITS (the H100's 4096-long cache)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU_SHAPES = ((1, 32, 4, 256, 128), (1, 32, 4, 290, 128), (16, 32, 4, 4352, 128), (3, 8, 8, 77, 64))


def _gpu_inputs(batch, hq, hkv, length, d, dtype):
    q, k, v = (t.to("cuda", dtype) for t in _inputs(batch, hq, hkv, length, d, seed=batch))
    valid = torch.randint(1, length + 1, (batch,), device="cuda")
    return q, k, v, torch.arange(length, device="cuda")[None, :] < valid[:, None]


def _gpu_counters_at_zero() -> bool:
    from moefx.kernels.decode_attn import _COUNTERS

    torch.cuda.synchronize()
    return all(int(c.count_nonzero()) == 0 for c in _COUNTERS.values())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_the_gpu(dtype):
    """Against SDPA in fp32 (bf16: one rounding of the output and bf16 probabilities), the same bits on every call
    whichever slice arrives last, the same bits from both forms of the K/V loads with NaN in the positions the mask
    drops, and the counters left at zero."""
    from moefx.kernels.decode_attn import decode_attention_triton
    from moefx.ops.decode_attention import splits_for

    for batch, hq, hkv, length, d in GPU_SHAPES:
        q, k, v, mask = _gpu_inputs(batch, hq, hkv, length, d, dtype)
        out = torch.ops.moefx.decode_attention(q, k, v, mask, d ** -0.5)
        want = decode_attention_reference(q.float(), k.float(), v.float(), mask, d ** -0.5)
        err = ((out.float() - want).norm() / want.norm()).item()
        assert err < (1e-5 if dtype == torch.float32 else 1e-2), (batch, length, dtype, err)
        for _ in range(20):
            assert torch.equal(torch.ops.moefx.decode_attention(q, k, v, mask, d ** -0.5), out), (batch, length)
        splits = splits_for(batch, hkv, length)
        k_bad, v_bad = (t.masked_fill(~mask[:, None, :, None], float("nan")) for t in (k, v))
        for speculate in (False, True):
            got = torch.empty_like(q)
            decode_attention_triton(q, k_bad, v_bad, mask, d ** -0.5, got, splits, speculate)
            assert torch.equal(got, out), (batch, length, speculate)
        assert _gpu_counters_at_zero()


@pytest.mark.gpu
@gpu
def test_gpu_one_launch_per_call():
    """At the batch-1 decode shape (4 slices of 64 positions) a call is one kernel: no combine launch."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v, mask = _gpu_inputs(1, 32, 4, 256, 128, torch.bfloat16)
    torch.ops.moefx.decode_attention(q, k, v, mask, 128 ** -0.5)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.ops.moefx.decode_attention(q, k, v, mask, 128 ** -0.5)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels == ["_decode_attn_kernel"], kernels


@pytest.mark.gpu
@gpu
def test_gpu_replays_from_a_cuda_graph(monkeypatch):
    """Captured after an eager call (the counters exist): the replay of new inputs gives the eager call's bits and
    leaves the counters at zero. Captured before any call on a device without counters: one slice per (sequence,
    KV head), one warning, still within the bound."""
    from moefx.kernels import decode_attn as K

    q, k, v, mask = _gpu_inputs(1, 32, 4, 256, 128, torch.bfloat16)
    scale = 128 ** -0.5
    torch.ops.moefx.decode_attention(q, k, v, mask, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.moefx.decode_attention(q, k, v, mask, scale)
    for seed in range(3):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q))
        graph.replay()
        assert torch.equal(out, torch.ops.moefx.decode_attention(q, k, v, mask, scale)), seed
    assert _gpu_counters_at_zero()

    K.decode_attention_triton(q, k, v, mask, scale, torch.empty_like(q), 1)  # the one-slice kernel compiled eagerly
    monkeypatch.setattr(K, "_COUNTERS", {})
    graph = torch.cuda.CUDAGraph()
    with pytest.warns(UserWarning, match="captured before its slice counters"):
        with torch.cuda.graph(graph):
            out = torch.ops.moefx.decode_attention(q, k, v, mask, scale)
    graph.replay()
    want = decode_attention_reference(q.float(), k.float(), v.float(), mask, scale)
    assert ((out.float() - want).norm() / want.norm()).item() < 1e-2 and not K._COUNTERS


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """The kernels, both forms of the K/V loads (and moefx::qk_norm_rope_cache's), compile for sm_90a (the H200) at
    Qwen3-30B-A3B's attention shape, within shared memory and without spills (tests/compile_sm90.py; the interpreter
    never compiles)."""
    from backends_util import compile_sm90  # here: the interpreter checks import this module as tests.<name>

    rows = compile_sm90("attention")
    kernels = [r[g] for r in rows for g in ("gemm1", "gemm2")]
    assert len(kernels) == 10 and all(0 <= k["smem"] <= 227 * 1024 and k["spill"] == 0 for k in kernels), rows


def test_attention_function_feeds_the_op_what_sdpa_sees(monkeypatch):
    """Through a transformers model with a static cache (the decode mask [B, 1, 1, L]), left padding and GQA: the
    moefx attention function, forced onto the op (its reference on the CPU), gives SDPA's tokens; on the CPU it
    otherwise hands every call to SDPA and says why."""
    import copy

    import moefx.integrations.attention as attention
    from moefx.models import build_model, tiny_qwen3_moe_config

    stock = build_model(tiny_qwen3_moe_config(), seed=0)
    model = copy.deepcopy(stock)
    attention.register()
    model.set_attn_implementation(attention.NAME)
    q, k, v = _inputs(1, 4, 2, 5, 16, seed=0)
    assert "device cpu" in attention.call_reason(None, q, k, v, None, 0.0, {})
    calls = []

    def on_cpu_too(module, query, key, value, attention_mask, dropout, kwargs):
        if query.shape[2] != 1:
            return "prefill"
        calls.append(tuple(attention_mask.shape) if attention_mask is not None else None)
        return None

    monkeypatch.setattr(attention, "call_reason", on_cpu_too)
    ids = torch.randint(1, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kwargs = dict(max_new_tokens=5, do_sample=False, attention_mask=mask, pad_token_id=0,
                  cache_implementation="static")
    assert torch.equal(model.generate(ids, **kwargs), stock.generate(ids, **kwargs))
    assert calls and all(c is not None and c[:3] == (2, 1, 1) for c in calls), calls
