"""A sync-free, static-shape sampler: temperature, top-k, top-p and min-p, then the exponential race.

Everything runs on the device with shapes known at trace time, so it compiles into the decode graph
and can be captured in a CUDA graph. Filtering works on the top-k candidates only (k values instead of
the whole vocabulary); with `top_k=0` the candidates are the whole vocabulary, sorted.

Semantics (HF's warpers, written over the sorted candidates): a token is kept when it is among the
`top_k` largest logits; when the probability mass strictly before it (largest first) is below
`top_p`; and when its probability is at least `min_p` times the largest. The most likely token is
always kept. Ties at the top-k boundary keep the candidates `torch.topk` returned.
The draw is `argmax(p / q)` with `q ~ Exp(1)`: exactly a draw from the categorical `p`.

A compiled sampler depends on the params' form only (`SamplingParams.form`: greedy or not, `top_k`, which filters
are on, top-k rounded up); temperature, top-p, min-p and top-k can come as one device tensor (`values`), so a
stream of requests with different values shares one compile and one captured graph per form, not one per value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """`temperature=0` means greedy. `top_k=0`, `top_p=1`, `min_p=0` switch that filter off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"sampling 'temperature' must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"sampling 'top_k' must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling 'top_p' must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"sampling 'min_p' must be in [0, 1) (0 = off), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def form(self) -> SamplingParams:
        """What a sampler compiled over `values` (and a graph captured from it) depends on: greedy or not, which
        filters are on, and `top_k` rounded up to a power of two (at least `TOP_K_FORM_MIN`); every other value
        replaced by a representative one."""
        if self.greedy:
            return SamplingParams(temperature=0.0)
        top_k = max(TOP_K_FORM_MIN, 1 << (self.top_k - 1).bit_length()) if self.top_k else 0
        return SamplingParams(temperature=1.0, top_k=top_k, top_p=0.5 if self.top_p < 1 else 1.0,
                              min_p=0.5 if self.min_p > 0 else 0.0)

    def values(self) -> list[float]:
        """(temperature, top_p, min_p, top_k): the `values` argument of `sample`, as an fp32 tensor [4]."""
        return [self.temperature, self.top_p, self.min_p, float(self.top_k)]


TOP_K_FORM_MIN = 16  # top_k 1..16 share one form, 17..32 the next, ...


def candidate_probs(logits: torch.Tensor, params: SamplingParams,
                    values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, token ids) over the sorted candidates, filtered tokens at probability 0. Shapes [B, k]. With
    `values` ([4] fp32: temperature, top_p, min_p, top_k) the values come from the tensor and `params` is their
    form (`SamplingParams.form`): k is the form's top_k and the candidates past the value's top_k are dropped
    before the softmax, which gives the same probabilities as k = top_k."""
    if values is None:
        temperature, top_p, min_p, top_k = params.temperature, params.top_p, params.min_p, None
    else:
        temperature, top_p, min_p, top_k = values.unbind()
    scores = logits.float() / temperature
    k = params.top_k if 0 < params.top_k < scores.shape[-1] else scores.shape[-1]
    top, ids = torch.topk(scores, k, dim=-1, sorted=True)
    if top_k is not None and params.top_k:
        rank = torch.arange(k, device=top.device)
        top = torch.where(rank < top_k, top, torch.full((), float("-inf"), device=top.device))
    probs = torch.softmax(top, dim=-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if params.top_p < 1:
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep &= mass_before < top_p
    if params.min_p > 0:
        keep &= probs >= min_p * probs[..., :1]
    keep[..., 0] = True
    return torch.where(keep, probs, torch.zeros((), dtype=probs.dtype, device=probs.device)), ids


ARGMAX_CHUNK = 1024  # greedy over a vocabulary longer than 4x this reduces in chunks of this size first


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(x, -1)` for [B, V], in two reductions when V is long: compiled, one row of a 152k vocabulary
    is otherwise one program's serial reduction (H200, Qwen3 vocabulary, B=1: 32.5 us of an 894 us step;
    docs/FINDINGS.md).
    Same index: each chunk keeps its first maximum, and the first chunk holding the row's maximum wins (NaN
    counts as the maximum in both, as in torch.argmax)."""
    rows, v = x.shape
    if v <= 4 * ARGMAX_CHUNK:
        return torch.argmax(x, dim=-1)
    chunks = -(-v // ARGMAX_CHUNK)
    padded = torch.nn.functional.pad(x, (0, chunks * ARGMAX_CHUNK - v), value=float("-inf"))
    best, where = padded.view(rows, chunks, ARGMAX_CHUNK).max(dim=-1)
    chunk = torch.argmax(best, dim=-1, keepdim=True)
    return (chunk * ARGMAX_CHUNK + torch.gather(where, -1, chunk)).squeeze(-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           values: torch.Tensor | None = None) -> torch.Tensor:
    """Next token ids [B] for logits [B, V], with no host sync (`values` as in `candidate_probs`)."""
    if params.greedy:
        return argmax_rows(logits)
    probs, ids = candidate_probs(logits, params, values)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    choice = torch.argmax(probs / noise, dim=-1, keepdim=True)
    return torch.gather(ids, -1, choice).squeeze(-1)
