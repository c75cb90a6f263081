"""The engine's compiled functions and how they compile.

One model call, `Steps.forward` (last-position logits, or the greedy tokens through a vocab-parallel LM head), is
compiled as three functions: `prefill` (the prompt at its own length, dynamic), `prefill[padded]` (the prompt
padded to its bucket, `moefx/engine/prefill.py`) and `decode` (one token per row); the sampler step (`advance`) is
the fourth, and decoder layer bodies (`layer[prefill]`, `layer[decode]`, `moefx/engine/layers/frames.py`) are
compiled the same way when the model's layers run as compiled frames.

Each compiled function gets a code object of its own (`own_code`): dynamo keeps compiled entries per code object
and stops compiling one after `recompile_limit` entries, so two models must not share them, and the three uses of
the forward compile apart. Compiles are counted per function (`EngineStats.compiles`) with the seconds their backend
took. Batch rows and the cache length are dynamic from the first compile (`mark_slot_dynamic`; a batch of 1
compiles apart: dynamo specializes size 1; so does a left-padded request, whose step takes a mask); the sampler
compiles per params form (`SamplingParams.form`), its values (temperature, top-p, min-p, top-k) read from the slot's
state. So a long stream of mixed requests compiles each function a handful of times (tests/test_generate_engine.py
counts them). With `saved_traces` each function is compiled as traces a new process loads without tracing
(`moefx/engine/compile_cache/aot.py`).
"""

from __future__ import annotations

import inspect
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from moefx.engine.compile_cache.aot import AotFunction, AotSteps, why_no_aot
from moefx.engine.layers.layer_body import kv_buffers
from moefx.engine.layers.regions import layer_frames
from moefx.log import progress_logger, warn_once
from moefx.sampling.sampler import SamplingParams, sample

progress = progress_logger()


def cache_kwarg(forward: Callable[..., Any]) -> str:
    """The name this transformers version gives the cache argument (`past_key_values` became `cache`)."""
    try:
        names = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in names and "past_key_values" not in names else "past_key_values"


def own_code(fn: Callable) -> Callable:
    """`fn` with a code object of its own (see the module docstring)."""
    code = fn.__code__.replace()
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def advance(scores: torch.Tensor, state: dict[str, torch.Tensor], form: SamplingParams, by_head: bool) -> None:
    """Pick the next token of every row (`scores` are logits, or the tokens themselves when `by_head`) and move
    the static buffers one position on, in place. `form` is the params' form (`SamplingParams.form`); their
    values are read from `state["sampling"]`, so one compile and one graph serve every temperature."""
    nxt = scores if by_head else sample(scores, form, values=state["sampling"])
    finished = state["finished"]
    # Like transformers: finished rows emit the pad id only when EOS ids are set (`pad_finished`).
    nxt = torch.where(finished & state["pad_finished"], state["pad"], nxt)
    now = finished | torch.isin(nxt, state["eos"])
    state["tokens"].copy_(nxt[:, None])
    state["seq"].index_copy_(1, state["cache_position"] + 1, nxt[:, None])
    state["position_ids"].add_(1)
    state["cache_position"].add_(1)
    finished.copy_(now)
    state["done"].copy_(now.all())


def mark_slot_dynamic(slot: Any) -> None:
    """Batch rows and cache length dynamic in every compile that reads the slot, from its first compile: a new
    batch bucket or cache length then reuses the compiled steps (a size-1 batch still gets a compile of its own:
    dynamo specializes sizes 0 and 1). transformers' StaticLayer answers the mask size from its Python int
    `max_cache_len`, which dynamo would specialize the length back to; the slot's layers answer it from their
    keys' shape instead (a left-padded step's mask and the sampler's sequence share that length)."""
    st = slot.state
    for t in (st["tokens"], st["position_ids"], st["finished"], st["seq"], slot.mask):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    torch._dynamo.maybe_mark_dynamic(st["seq"], 1)
    static_layers = slot.uncapturable is None  # every layer a StaticLayer: keys [rows, heads, length, dim]
    if static_layers:
        torch._dynamo.maybe_mark_dynamic(slot.mask, 1)
    buffers = kv_buffers(slot.cache)
    for t in buffers[:2] if buffers is not None else ():  # [layers, rows, heads, length, dim]
        torch._dynamo.maybe_mark_dynamic(t, 1)
        torch._dynamo.maybe_mark_dynamic(t, 3)
    for layer in slot.cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(t, 0)
                if static_layers:
                    torch._dynamo.maybe_mark_dynamic(t, 2)
        if static_layers:
            layer.get_mask_sizes = types.MethodType(get_mask_sizes, layer)


def get_mask_sizes(layer: Any, *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """StaticLayer.get_mask_sizes (kv length, kv offset), the length read from the keys' (dynamic) shape. Only the
    size is read: dynamo then takes it as a symbolic input, not the keys, so a step that reads the cache's buffers
    (`stack_cache_layers`) does not also take this layer's view of them."""
    return layer.keys.shape[2], 0


class Steps:
    """The compiled functions of one engine over `model` (a transformers causal LM).

    `forward` is the model forward to call (default `model.forward`; the optimize transform passes the uncompiled
    one). `compile_kwargs` go to `torch.compile` (None: everything runs eagerly); `stats` (an EngineStats) counts
    the compiles. `saved_traces` compiles each function as saved traces (`aot`, None without them)."""

    def __init__(self, model: Any, forward: Callable[..., Any] | None, compile_kwargs: dict[str, Any] | None,
                 stats: Any, saved_traces: bool = False) -> None:
        from moefx.parallel.lm_head import greedy_head

        self.model = model
        self.model_forward = forward or model.forward
        self.cache_arg = cache_kwarg(self.model_forward)
        # A vocab-parallel LM head (tensor parallelism): greedy steps take the token from one all-gather of
        # (max, argmax) per row and rank instead of the full logits (moefx/parallel/lm_head.py).
        self.head = greedy_head(model)
        decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
        self.decoder_cache_arg = cache_kwarg(decoder.forward) if self.head is not None else "past_key_values"
        self.compiled = compile_kwargs is not None
        self.compile_kwargs = dict(compile_kwargs or {})
        self.stats = stats
        no_aot = why_no_aot() if saved_traces and self.compiled else None
        if no_aot:
            warn_once(f"moefx: saved traces are off ({no_aot}): each new process traces the engine's steps again "
                      "before it runs them (docs/SAMPLING.md, compile cache)")
        self.aot = AotSteps() if saved_traces and self.compiled and no_aot is None else None
        self.prefill = self.compile("prefill", self.forward)
        self.decode = self.compile("decode", self.forward)
        self.pick = self.compile("sampler", advance)
        frames = layer_frames(model)
        if frames is not None and self.compiled:
            frames.bind(self.compile)
        # The slots' caches as buffers (`stack_cache_layers`) only where the frames read the cache through them:
        # elsewhere the traced step reads the layers' own tensors (the nested region, transformers' attention), and
        # the buffers read beside them (`get_seq_length`) would be graph inputs aliasing mutated ones.
        self.cache_buffers = frames is not None and self.compiled

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache_position: torch.Tensor,
                attention_mask: torch.Tensor | None, cache: Any, by_head: bool = False,
                last: torch.Tensor | None = None) -> torch.Tensor:
        """Scores of one forward at the last position, or at position `last` (a one-element tensor: a right-padded
        prompt): logits [rows, V], or with `by_head` the greedy tokens [rows] through the vocab-parallel head."""
        if by_head:
            from moefx.parallel.lm_head import greedy_step

            return greedy_step(self.model, input_ids=input_ids, position_ids=position_ids,
                               cache_position=cache_position, attention_mask=attention_mask, last=last,
                               **{self.decoder_cache_arg: cache})
        out = self.model_forward(
            input_ids=input_ids, position_ids=position_ids, cache_position=cache_position,
            attention_mask=attention_mask, use_cache=True, logits_to_keep=1 if last is None else last,
            **{self.cache_arg: cache},
        )
        return out.logits[:, -1]

    def compile(self, name: str, fn: Callable) -> Callable:
        """`fn` (a function or a bound method) compiled with this engine's backend under `name`, its compiles counted;
        `fn` itself when the engine runs eagerly."""
        if not self.compiled:
            return fn
        kw = self.compile_kwargs
        bound = getattr(fn, "__self__", None)
        own = own_code(fn.__func__ if bound is not None else fn)
        target = types.MethodType(own, bound) if bound is not None else own
        backend = kw.get("backend", "inductor")
        stats = self.stats

        label = backend if isinstance(backend, str) else (
            "inductor + moefx passes" if hasattr(backend, "pass_manager") else getattr(backend, "__name__", "backend"))
        counters = torch._dynamo.utils.counters["inductor"]

        def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            count = stats.compiles[name] = stats.compiles.get(name, 0) + 1
            progress.info("compiling %s%s (%s)...", name, f" again (compile {count})" if count > 1 else "", label)
            start, hits = time.perf_counter(), counters["fxgraph_cache_hit"]
            if isinstance(backend, str):
                from torch._dynamo import lookup_backend

                compiled = lookup_backend(backend)(gm, example_inputs)
            else:
                compiled = backend(gm, example_inputs)
            took = time.perf_counter() - start
            stats.compile_s[name] = round(stats.compile_s.get(name, 0.0) + took, 2)
            cached = " (from the compile cache)" if counters["fxgraph_cache_hit"] > hits else ""
            progress.info("%s compiled in %.1f s%s", name, took, cached)
            return compiled

        from moefx.compile import with_exact_floats

        compiled = with_exact_floats(torch.compile(target, **{**kw, "backend": counting_backend}))
        if self.aot is None:
            return compiled
        return self.aot.add(AotFunction(name, own, bound, counting_backend, compiled))
