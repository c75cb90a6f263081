"""Way of use 2: moefx's passes in plain `torch.compile`, switched on by `pass_config` toggles.

    python examples/torch_compile_pass_config.py [--rows 64]

The function is ordinary user code: a SwiGLU activation (vLLM's `SiluAndMul`) followed by dynamic FP8 quantization
in groups of 128 (DeepSeek-style). `fuse_act_quant` rewrites the pair into one `moefx::silu_mul_quant` op that
computes exactly what the eager code computes; the compile report says what it rewrote. The same toggles go into
vLLM's compilation config (examples/vllm_serve.md).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import moefx

FP8 = torch.float8_e4m3fn


def silu_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up, then e4m3 codes and one fp32 scale per 128 values."""
    d = x.shape[-1] // 2
    y = F.silu(x[..., :d]) * x[..., d:]
    g = y.reshape(-1, 128).float()
    scale = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4) / 448.0
    q = (g / scale).clamp(-448.0, 448.0).to(FP8)
    return q.reshape(y.shape), scale.reshape(*y.shape[:-1], -1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    x = torch.randn(args.rows, 2 * 512, device=args.device, dtype=dtype)
    moefx.clear_compile_reports()  # count only this script's graphs

    # [readme:pass_config]
    cfg = moefx.CompilationConfig.from_any({"pass_config": {"fuse_act_quant": True}})
    compiled = torch.compile(silu_mul_fp8, backend=moefx.backend(cfg))
    q, scale = compiled(x)
    for report in moefx.compile_reports():  # one per compiled graph: rewrites per pass, and what was left alone
        print(report.summary(), report.skipped or "")
    # [/readme]

    # The fused op rounds where eager rounds; only a last-bit difference of the division may flip a code (< 0.1%).
    q_ref, scale_ref = silu_mul_fp8(x)
    rewrites = sum(r.matches.get("fuse_act_quant", 0) for r in moefx.compile_reports())
    codes_off = (q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean().item()
    scale_off = ((scale - scale_ref).abs().max() / scale_ref.abs().max()).item()
    print(f"fuse_act_quant rewrites: {rewrites}; codes differing from eager: {codes_off:.1e}; scales: {scale_off:.1e}")
    if rewrites != 1 or codes_off > 1e-3 or scale_off > 1e-6:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
