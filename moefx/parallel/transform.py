"""The `vocab_parallel_lm_head` model transform: a vocab-sharded LM head becomes a `VocabParallelLMHead`.

Where the plan marks the head eligible (tp_size > 1, a known causal-LM profile) and the model's head is split
over the vocabulary — by transformers' `colwise_gather_output` (a DTensor sharded on dim 0 of a 1-D mesh) or by
`moefx.parallel.shard_model` — the head is replaced by one with the same full-logits forward and a `greedy()`
that sends 2 values per row. A head that is whole on every rank is left alone: splitting it would add a gather
to every sampling step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moefx.parallel.comm import group_name
from moefx.parallel.lm_head import VocabParallelLMHead
from moefx.parallel.shard import chunk_bounds

# Config keys that put something between the last hidden state and the logits (the head is then not a matmul).
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def vocab_shard(head: Any) -> tuple[dict[str, Any] | None, str]:
    """(arguments for VocabParallelLMHead, "") for a vocab-sharded Linear head, else (None, why not)."""
    if not isinstance(head, nn.Linear):
        return None, f"output embeddings are a {type(head).__name__}, not a Linear"
    weight, bias = head.weight, head.bias
    spec = getattr(head, "moefx_shard", {}).get("weight")
    if spec is not None:
        if spec.dim != 0:
            return None, f"LM head weight is split on dim {spec.dim}, not the vocabulary"
        return dict(weight=weight.detach(), vocab_size=spec.full, rank=spec.rank, world=spec.world,
                    group=spec.group, bias=None if bias is None else bias.detach()), ""
    placements = getattr(weight, "placements", None)
    if placements is None:
        return None, "LM head weight is whole on every rank (not split over the vocabulary)"
    mesh = weight.device_mesh
    if mesh.ndim != 1 or len(placements) != 1 or not placements[0].is_shard() or placements[0].dim != 0:
        return None, f"LM head DTensor placements {tuple(placements)} on a {mesh.ndim}-D mesh are not Shard(0)"
    rank, world = mesh.get_local_rank(), mesh.size()
    local = weight.to_local().detach()
    if local.shape[0] != chunk_bounds(weight.shape[0], world, rank)[1]:
        return None, f"LM head shard of {local.shape[0]} rows does not follow torch.chunk over {world} ranks"
    local_bias = None
    if bias is not None:
        local_bias = (bias.to_local() if hasattr(bias, "to_local") else bias).detach()
        if local_bias.shape[0] != local.shape[0]:
            return None, "LM head bias is not split like its weight"
    return dict(weight=local, vocab_size=int(weight.shape[0]), rank=rank, world=world, group=group_name(mesh),
                bias=local_bias), ""


def install_vocab_parallel_head(model: nn.Module, plan: Any, cfg: Any) -> list[str]:
    if not getattr(plan, "serving", {}).get("vocab_parallel_lm_head"):
        return []
    config = getattr(model, "config", None)
    extras = [k for k in _HEAD_EXTRAS if getattr(config, k, None) not in (None, 1, 1.0)]
    if extras:
        return [f"lm_head left as is: the logits are not a plain matmul ({extras})"]
    get, put = getattr(model, "get_output_embeddings", None), getattr(model, "set_output_embeddings", None)
    if not (callable(get) and callable(put)):
        return ["lm_head left as is: the model has no get/set_output_embeddings"]
    args, why = vocab_shard(get())
    if args is None:
        return [f"lm_head left as is: {why}"]
    with torch.no_grad():
        head = VocabParallelLMHead(**args)
    put(head)
    rows = ", ".join(str(s) for s in sorted(set(head.sizes)))
    pair = 16 if head.weight.dtype == torch.float64 else 8
    return [f"lm_head = vocab-parallel over tp {head.world} ({rows} of {head.vocab_size} rows per rank): greedy() "
            f"sends {pair} bytes per row (local max, argmax); forward() keeps full logits (one all-gather)"]
