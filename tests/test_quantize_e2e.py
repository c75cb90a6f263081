"""A tiny Qwen3-MoE quantized fp8_block128 generates the same greedy tokens with fuse_act_quant and
fuse_norm_quant on as with them off (two compiles, dynamic sequence length). The graphs go through inductor's
post-grad passes, moefx's included, and run as PyTorch ops (moefx.testing.without_codegen): the passes' work on a
real model graph is checked without a C++ compile of each arm."""

from __future__ import annotations

import torch

import moefx
from moefx.models import build_model, tiny_qwen3_moe_config
from moefx.testing import without_codegen

NEW_TOKENS = 6


def _greedy(step, prompt: torch.Tensor) -> list[int]:
    ids = prompt
    for _ in range(NEW_TOKENS):
        nxt = step(ids).argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=-1)
    return ids[0, prompt.shape[1]:].tolist()


def test_fp8_model_generates_identical_tokens_with_fusions_on_and_off():
    # Layer 0 is dense (transformers MLP: SiLU-mul -> quantized down_proj), layer 1 is MoE.
    cfg = tiny_qwen3_moe_config(hidden_size=128, moe_intermediate_size=128, intermediate_size=256, head_dim=32,
                                mlp_only_layers=[0])
    model = moefx.quantize(build_model(cfg, seed=0, dtype=torch.bfloat16), "fp8_block128")
    prompt = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))

    def last_logits(ids):
        return model(ids, use_cache=False).logits[:, -1]

    tokens = {}
    # Inductor's caches would skip the post-grad passes (and so the compile reports) on a hit.
    no_cache = (torch._inductor.config.patch(fx_graph_cache=False),
                torch._functorch.config.patch(enable_autograd_cache=False))
    for on in (True, False):
        moefx.clear_compile_reports()
        torch._dynamo.reset()
        backend = moefx.backend({"pass_config": {"fuse_act_quant": on, "fuse_norm_quant": on}})
        step = torch.compile(last_logits, backend=backend)
        torch._dynamo.mark_dynamic(prompt, 1)  # one graph for every length (eps etc. stay constants)
        with torch.no_grad(), no_cache[0], no_cache[1], without_codegen():
            tokens[on] = _greedy(step, prompt)
        reports = moefx.compile_reports()
        assert len(reports) == 1  # one dynamic-length graph per arm: two compiles in all
        matches = {}
        for report in reports:
            for name, n in report.matches.items():
                matches[name] = matches.get(name, 0) + n
        if on:
            # input norms of both layers (q/k/v share one fused op), the dense layer's post-attention norm,
            # and its SiLU-mul before down_proj
            assert matches.get("fuse_norm_quant", 0) >= 3 and matches.get("fuse_act_quant", 0) >= 1, matches
        else:
            assert "fuse_norm_quant" not in matches and "fuse_act_quant" not in matches
    print("fused arm tokens", tokens[True], "unfused arm tokens", tokens[False])
    assert tokens[True] == tokens[False]
