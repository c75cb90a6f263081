"""The fp32 scorer of generated sequences: how a fast path that changes rounding is judged on a bf16 model.

Each generated sequence is scored with an fp32 eager transformers forward (eager attention, eager experts) of the
weights the arm ran: the bf16 weights, or for an FP8 arm its FP8 weights dequantized (weight x block scale). Per
arm: the share of steps where the chosen token is the scorer's argmax, and the largest gap (the scorer's best logit
minus its logit of the chosen token, in units of the std of the scorer's logits at that step). Raw token agreement
with another bf16 loop is no correctness measure on a random-weight model: near-tied logits flip either way.

The scorer runs a copy of the model's module tree whose parameters live on the meta device; one decoder layer at a
time gets its weights in fp32 (copied from the live model when the layer starts, dropped when it ends), the rest
(embedding, final norm, LM head) for the whole forward. So it costs one layer's fp32 weights over the model the
arm already holds (48 layers at Qwen3-30B-A3B widths: ~2.5 GiB for the experts of one layer, ~2.5 GiB for the
embedding and LM head), never an fp32 copy of the model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

Fetch = Callable[[str], torch.Tensor]
# dequantization slice: experts at a time whose fp32 copy is about this many bytes
DEQUANT_CHUNK_BYTES = 256 << 20


@dataclass(frozen=True)
class Score:
    """One arm's scored steps: `argmax_share` of them chose the scorer's argmax; `max_gap_std` is the largest
    (best - chosen logit) / std(logits) over them (0 where every step chose the argmax)."""

    steps: int
    argmax_share: float
    max_gap_std: float


def score_logits(logits: torch.Tensor, chosen: torch.Tensor) -> Score:
    """Score `chosen` tokens [B, n] against the scorer's `logits` [B, n, V] at the same steps."""
    if logits.shape[:-1] != chosen.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and chosen tokens {tuple(chosen.shape)} differ in [B, n]")
    logits = logits.float()
    best = logits.amax(dim=-1)
    pick = logits.gather(-1, chosen.long().unsqueeze(-1)).squeeze(-1)
    gap = (best - pick) / logits.std(dim=-1)
    return Score(steps=gap.numel(), argmax_share=float((gap <= 0).float().mean()), max_gap_std=float(gap.max()))


def float_weights(model: nn.Module) -> Fetch:
    """Every parameter of `model` by name (as it stands now, the tensors themselves: later rewrites of the module
    tree that keep the tensors do not change what the scorer reads), in fp32 on demand."""
    live = dict(model.named_parameters(remove_duplicate=False))
    return lambda name: live[name].detach().float()


def fp8_block_weights(model: nn.Module, block_shape: tuple[int, int]) -> Fetch:
    """The weights of a model quantized with `moefx.quantize(model, "fp8_block128")`, dequantized to fp32 on demand
    (an FP8 tensor `x` with its block scales `x_scale_inv`: `p.weight_scale_inv`, `experts.gate_up_proj_scale_inv`);
    the rest as is."""
    from moefx.backends.registry import dequant_block

    live = dict(model.state_dict(keep_vars=True))

    def fetch(name: str) -> torch.Tensor:
        t = live[name].detach()
        if t.dtype != torch.float8_e4m3fn:
            return t.float()
        scale = live[f"{name}_scale_inv"].detach()
        if t.dim() == 2:
            return dequant_block(t, scale, block_shape)
        out = torch.empty(t.shape, dtype=torch.float32, device=t.device)
        step = max(1, DEQUANT_CHUNK_BYTES // (t[0].numel() * 4))
        for e in range(0, t.shape[0], step):
            out[e:e + step] = dequant_block(t[e:e + step], scale[e:e + step], block_shape)
        return out

    return fetch


def _meta_copy(model: nn.Module) -> nn.Module:
    """`model`'s module tree with every parameter on the meta device (buffers and config copied)."""
    memo: dict[int, object] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                               for p in model.parameters()}
    skeleton = copy.deepcopy(model, memo)
    for name, setter in (("attn", "set_attn_implementation"), ("experts", "set_experts_implementation")):
        if hasattr(skeleton, setter):
            getattr(skeleton, setter)("eager")
        else:  # older transformers: the config attribute the setter writes
            setattr(skeleton.config, f"_{name}_implementation", "eager")
    return skeleton


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = [m for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, nn.ModuleList)]
    if len(layers) != 1:
        raise ValueError(f"the scorer needs one `layers` ModuleList of decoder layers, found {len(layers)}")
    return layers[0]


class Fp32Scorer:
    """An fp32 eager forward of the weights `fetch` gives, one decoder layer in fp32 at a time.

    `model` gives the module tree (the plain transformers model, before any rewrite: for an FP8 arm the bf16 model
    before `moefx.quantize`, whose parameter names the quantized model keeps) and, unless `fetch` is given, the
    weights (`float_weights(model)`)."""

    def __init__(self, model: nn.Module, fetch: Fetch | None = None) -> None:
        # replaceable: None drops the references to the weights; another model of the same tree (the FP8 copy
        # of the same weights) is scored through its own fetch
        self.fetch: Fetch | None = fetch or float_weights(model)
        self.model = _meta_copy(model).eval()
        self.layers = _decoder_layers(self.model)
        slots = [(prefix, m, name) for prefix, m in self.model.named_modules(remove_duplicate=False)
                 for name, _ in m.named_parameters(recurse=False)]
        layer_ids = {id(m): i for i, layer in enumerate(self.layers) for m in layer.modules()}
        self._per_layer: list[list[tuple[str, nn.Module, str]]] = [[] for _ in self.layers]
        self._rest: list[tuple[str, nn.Module, str]] = []
        for prefix, m, name in slots:
            full = f"{prefix}.{name}" if prefix else name
            (self._per_layer[layer_ids[id(m)]] if id(m) in layer_ids else self._rest).append((full, m, name))
        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(lambda mod, args, i=i: self._load(self._per_layer[i]))
            layer.register_forward_hook(lambda mod, args, out, i=i: self._drop(self._per_layer[i]))

    def _load(self, slots: list[tuple[str, nn.Module, str]]) -> None:
        if self.fetch is None:
            raise ValueError("the scorer has no weights (fetch is None): set Fp32Scorer.fetch to the arm's weights")
        for full, m, name in slots:
            m._parameters[name] = nn.Parameter(self.fetch(full), requires_grad=False)

    @staticmethod
    def _drop(slots: list[tuple[str, nn.Module, str]]) -> None:
        for _, m, name in slots:
            p = m._parameters[name]
            m._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)

    def logits(self, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """fp32 logits [B, n, V] of the steps that chose `sequences[:, prompt_len:]` (n tokens): the forward over
        every token but the last, logits at the last n positions."""
        n = sequences.shape[1] - prompt_len
        if n < 1:
            raise ValueError(f"sequences of {sequences.shape[1]} tokens have none after the {prompt_len}-token prompt")
        self._load(self._rest)
        try:
            with torch.no_grad():
                out = self.model(input_ids=sequences[:, :-1], logits_to_keep=n, use_cache=False)
        finally:
            self._drop(self._rest)
            for slots in self._per_layer:  # a forward that raised inside a layer leaves its weights loaded
                if any(not m._parameters[name].is_meta for _, m, name in slots):
                    self._drop(slots)
        return out.logits.float()

    def score(self, sequences: torch.Tensor, prompt_len: int) -> Score:
        """Score every token of `sequences` after the prompt (greedy steps of one arm, one prompt per row)."""
        return score_logits(self.logits(sequences, prompt_len), sequences[:, prompt_len:])
