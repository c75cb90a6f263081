"""Random weights that route like a trained MoE: `build_model(..., routing="balanced")`.

Seeded random weights as transformers draws them (every weight N(0, 0.02)) make a deep MoE route most tokens of a
prompt to a few experts: the embeddings are ~50x smaller than one attention output at Qwen3-30B-A3B widths, and
with near-uniform attention every layer adds the same context mean to each token of a sequence, so after a few
layers the tokens of one prompt are near copies of each other and no choice of router weights alone can spread
them (measured: 30B-A3B widths, 4 layers, router rows re-drawn in the directions in which the tokens of a prompt
differ most, whitened: the last 16 tokens of a 256-token prompt hit 11 experts in layer 4, uniform: 82). A balanced
build keeps every shape, dtype and tensor layout (what a kernel's cost depends on) and draws three scales differently:
  * embedding rows of unit standard deviation, so each token's identity is in the residual stream;
  * the residual branches' output projections (`o_proj`, every `down_proj`) scaled by 1/sqrt(8 * layers), so the
    sum of the branches stays below the embedding at any depth (half GPT-2's 1/sqrt(2 * layers): with that, 48
    layers at 30B-A3B widths hit 90% of uniform in their deepest layers at 16 tokens, with this one >= 96%);
  * each router's rows made orthogonal to the mean of that layer's router input over a calibration prompt (one
    forward pass; a forward pre-hook on each MoE block rewrites the router just before the block runs, so later
    layers see the balanced routing of earlier ones), which removes the fixed per-expert bias the mean direction
    would give.
Everything is drawn from generators seeded by the build seed, so a balanced build is deterministic for a seed on a
device (the calibration forward runs in the model's dtype on its device).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moefx.integrations.transformers import is_experts_module

CALIBRATION_SEQUENCES = 16
CALIBRATION_TOKENS = 64  # per sequence
BRANCH_OUTPUTS = ("o_proj", "down_proj")  # the last projection of an attention / MLP / experts residual branch


def find_routers(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(MoE block, router) pairs: the block is the parent of a transformers experts module, its router the child
    module whose 2-D `weight` has one row per expert over the hidden size. Raises ValueError naming the block when a
    model has no experts module or a block has no such router."""
    hidden = model.config.hidden_size
    pairs = []
    for name, block in model.named_modules():
        experts = [m for m in block.children() if is_experts_module(m)]
        if not experts:
            continue
        n = int(getattr(experts[0], "num_experts", experts[0].down_proj.shape[0]))
        routers = [m for m in block.children() if m is not experts[0] and isinstance(getattr(m, "weight", None),
                   torch.Tensor) and tuple(m.weight.shape) == (n, hidden)]
        if len(routers) != 1:
            raise ValueError(f"routing='balanced' cannot balance {type(model).__name__}: its MoE block {name} "
                             f"({type(block).__name__}) has {len(routers)} child modules with a ({n}, {hidden}) "
                             "router weight (expected exactly one)")
        pairs.append((block, routers[0]))
    if not pairs:
        raise ValueError(f"routing='balanced' cannot balance {type(model).__name__}: it has no transformers experts "
                         "module (a MoE block with an experts child and a router)")
    return pairs


@torch.no_grad()
def balance_routing(model: nn.Module, seed: int) -> nn.Module:
    """Rescale `model`'s embeddings and residual branches and re-draw its routers in place (see the module
    docstring); returns the model."""
    pairs = find_routers(model)
    layers = int(model.config.num_hidden_layers)
    emb = model.get_input_embeddings().weight
    emb.mul_(1.0 / emb.float().std().clamp_min(1e-12))
    scale = 1.0 / math.sqrt(8 * layers)
    scaled = 0
    for name, p in model.named_parameters():
        if any(part in BRANCH_OUTPUTS for part in name.split(".")):
            p.mul_(scale)
            scaled += 1
    if not scaled:
        raise ValueError(f"routing='balanced' cannot balance {type(model).__name__}: no residual-branch output "
                         f"projection named {' or '.join(BRANCH_OUTPUTS)}")

    def rewrite(router: nn.Module):
        def pre(_block: nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs["hidden_states"]
            mean = x.reshape(-1, x.shape[-1]).float().mean(0)
            u = mean / mean.norm().clamp_min(1e-12)
            w = router.weight.float()
            router.weight.copy_(w - torch.outer(w @ u, u))

        return pre

    handles = [block.register_forward_pre_hook(rewrite(router), with_kwargs=True) for block, router in pairs]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, model.config.vocab_size, (CALIBRATION_SEQUENCES, CALIBRATION_TOKENS), generator=gen)
    try:
        model.base_model(input_ids=ids.to(emb.device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return model
