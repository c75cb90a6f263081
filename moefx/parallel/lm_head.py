"""Vocab-parallel LM head: full logits by one all-gather, greedy tokens by one all-gather of 2 values per row.

Under tensor parallelism each rank holds rows [start, start + size) of the LM head weight (the vocabulary split
like `torch.chunk`, as transformers' `colwise_gather_output` and vLLM's `ParallelLMHead` split it).
`forward(hidden)` returns the full logits, gathering every rank's [rows, V / tp] slice; that is what sampling,
`output_scores` and any caller of `model(...).logits` get. `greedy(hidden)` never builds them: each rank takes
the (max, argmax) of its own slice, the ranks exchange those two values per row, and every rank picks the same
token. It is bit-identical to `forward(hidden).argmax(-1)`: both compute the same local logits, ties inside a
slice go to the first index (torch.argmax), ties across slices to the lowest rank, whose slice starts lower, and
a NaN wins as it does in torch.argmax.

The pair travels as one integer tensor [rows, 2] (the value's bits, and the global index): integers are copied
bit for bit by every backend, and 8 bytes per row per rank (16 for float64 logits) is all a greedy step sends.

Hook for a decode loop: `greedy_head(model)` is the model's head when it has `greedy`, and
`greedy_step(model, **forward_kwargs)` runs the decoder and `greedy` on the last position, returning token ids
[batch] (int64); both are traceable, collectives included, so the compiled or graph-captured step contains them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moefx.parallel.comm import all_gather, all_gather_uneven
from moefx.parallel.shard import chunk_bounds

_PAIR_DTYPES = {torch.float64: (torch.float64, torch.int64)}
_DEFAULT_PAIR = (torch.float32, torch.int32)


def pack_pairs(local_logits: torch.Tensor, offset: int) -> torch.Tensor:
    """[..., V_local] logits -> [rows, 2] integers: the bits of each row's max (as float32, or float64 for float64
    logits; exact for every float dtype) and its global index (first occurrence)."""
    fdtype, idtype = _PAIR_DTYPES.get(local_logits.dtype, _DEFAULT_PAIR)
    flat = local_logits.reshape(-1, local_logits.shape[-1])
    index = flat.argmax(-1, keepdim=True)
    value = flat.gather(-1, index).to(fdtype).view(idtype)
    return torch.cat([value, (index + offset).to(idtype)], dim=-1)


def pick_from_pairs(pairs: torch.Tensor, world: int, fdtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Every rank's pairs [world * rows, 2] (rank order) -> the argmax over the whole vocabulary [rows] (int64).

    A NaN wins (the lowest rank holding one), else the largest value, ties to the lowest rank."""
    pairs = pairs.view(world, -1, 2)
    values = pairs[..., 0].contiguous().view(fdtype)
    index = pairs[..., 1]
    nan = values.isnan()
    best = values.amax(0, keepdim=True)
    winner = torch.where(nan.any(0, keepdim=True), nan, values == best)
    rank = winner.to(torch.int32).argmax(0, keepdim=True)
    return index.gather(0, rank).squeeze(0).to(torch.int64)


def distributed_argmax(local_logits: torch.Tensor, offset: int, world: int, group: str) -> torch.Tensor:
    """argmax over the vocabulary of logits split by columns over `world` ranks; this rank's columns start at
    `offset`. Returns [...] int64 (the leading dims of `local_logits`), the same on every rank."""
    fdtype = _PAIR_DTYPES.get(local_logits.dtype, _DEFAULT_PAIR)[0]
    pairs = all_gather(pack_pairs(local_logits, offset), world, group)
    return pick_from_pairs(pairs, world, fdtype).view(local_logits.shape[:-1])


class VocabParallelLMHead(nn.Module):
    """This rank's rows of an LM head; see the module docstring. `weight` is [V_local, H] (V split like
    `torch.chunk(world)`), `vocab_size` the full vocabulary, `group` a process-group name."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, rank: int, world: int, group: str,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        start, size = chunk_bounds(vocab_size, world, rank)
        if weight.dim() != 2 or weight.shape[0] != size:
            raise ValueError(f"VocabParallelLMHead rank {rank} of {world} must hold {size} of {vocab_size} rows, "
                             f"got weight of shape {tuple(weight.shape)}")
        if any(chunk_bounds(vocab_size, world, r)[1] == 0 for r in range(world)):
            raise ValueError(f"vocab {vocab_size} over {world} ranks leaves a rank without rows")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.vocab_size, self.rank, self.world, self.group = vocab_size, rank, world, group
        self.start = start
        self.sizes = tuple(chunk_bounds(vocab_size, world, r)[1] for r in range(world))
        self.in_features, self.out_features = weight.shape[1], vocab_size

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight, self.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits [..., vocab_size] (one all-gather of every rank's slice)."""
        return all_gather_uneven(self.local_logits(hidden), self.sizes, self.group)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax of `forward(hidden)` over the vocabulary, [...] int64, from one all-gather of 2 values per row."""
        return distributed_argmax(self.local_logits(hidden), self.start, self.world, self.group)

    def extra_repr(self) -> str:
        return (f"rows {self.start}..{self.start + self.weight.shape[0]} of {self.vocab_size}, rank {self.rank} of "
                f"{self.world}, group {self.group}")


def greedy_head(model: nn.Module) -> VocabParallelLMHead | None:
    """The model's output embeddings when they are a vocab-parallel head with `greedy`, else None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(model, "lm_head", None)
    return head if isinstance(head, VocabParallelLMHead) else None


def greedy_step(model: nn.Module, last: torch.Tensor | None = None, **forward_kwargs: Any) -> torch.Tensor:
    """Next greedy token per sequence, [batch] int64: the decoder's last hidden state through `greedy`.

    `forward_kwargs` are the decoder's (input_ids, position_ids, past_key_values, cache_position, ...); only
    for causal LMs whose logits are `lm_head(last hidden state)`, which is where `optimize` installs the head.
    `last` (a one-element position tensor) reads that position instead of the last one (a right-padded prompt).
    """
    head = greedy_head(model)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no vocab-parallel LM head; greedy_step needs one "
                         f"(moefx.optimize installs it where the plan marks vocab_parallel_lm_head eligible)")
    decoder = getattr(model, getattr(model, "base_model_prefix", "model"))
    forward_kwargs.setdefault("use_cache", True)
    out = decoder(**forward_kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return head.greedy(hidden[:, -1, :] if last is None else hidden.index_select(1, last)[:, 0, :])
