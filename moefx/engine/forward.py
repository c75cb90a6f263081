"""The forward of an optimized causal LM on the engine's padded prefill: `model(...)` as fast as its first token.

`optimize` compiles `model.forward` (the plain compiled forward) and, for a model whose `generate()` runs on the
engine, routes each call through `ForwardFront.route` first. Read top-down:
- `read_call`: the call is read, and either fits the fast path (a `Call`) or gets the reason it does not;
- `ForwardFront.run`: a call that fits runs the model over its inputs right-padded to a prompt bucket
  (`PREFILL_BUCKETS`, rows × bucket within the config's `prefill_capture_tokens`), from static buffers kept per
  bucket key; on CUDA in mode capture that run is captured once per key in a CUDA graph (`moefx/engine/graphs.py`,
  the engine's pool and memory budget) and replayed, elsewhere the compiled function runs directly;
- the caller's view is rebuilt: logits of the real rows and positions asked for, the loss (`labels`) by the
  model's own `loss_function` on those logits, and with `use_cache` a DynamicCache of the real positions' keys and
  values (copies: the graph's own buffers are overwritten by the next call).

What fits: no gradient can flow (`torch.is_grad_enabled()` is off, or no parameter and no `inputs_embeds`
requires grad: the outputs then carry no autograd history in the plain forward either), the model in eval mode,
`input_ids` [B, T] or `inputs_embeds` [B, T, H], an `attention_mask` [B, T] (left padding, or any 0/1 mask) or
none, `position_ids` [B or 1, T] or none, `logits_to_keep` (an int, 0 = every position, or a 1-D index tensor),
`labels`, `use_cache`, `return_dict` True or unset, and no cache passed in (a fresh request). Everything else runs
the plain compiled forward and says why once per reason (a warning, and `model.moefx_forward.fallbacks`): a
training step (gradients), a cache passed in (a continuation), B × T above the buckets, other arguments.

Why padding leaves the outputs unchanged: attention is causal, so a real position never sees the padded tail after
it, whatever the mask over the real positions (the tail's mask is ones); the tail's positions continue after the
last real one; its logits and keys are cut off before anything is returned. Batch rows are padded (copies of row 0)
to the engine's capture sizes only where graphs are captured, so the graphs stay few.

Bucket key: (rows, bucket, masked, inputs kind, keep), keep = "last" (a one-element index of the last real position:
`logits_to_keep=1`, the common scoring call) or "all" (every position; other `logits_to_keep` forms select from
them). One compiled function per form (`forward[padded, ...]`: masked or not, ids or embeddings, last or all)
serves every bucket and batch of that form: its rows and length are dynamic from the first compile, so compiles are
bounded by the forms used and batch 1 vs more (dynamo specializes size 1), not by lengths or buckets; captures by
the keys used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moefx.engine.prefill import pick_bucket
from moefx.log import get_logger, warn_once

log = get_logger("moefx.engine")

# Arguments the fast path takes, and those it takes only when unset or falsy.
_TAKEN = frozenset({"input_ids", "inputs_embeds", "attention_mask", "position_ids", "logits_to_keep", "labels",
                    "use_cache", "return_dict"})
_UNSET_ONLY = frozenset({"past_key_values", "cache", "cache_position", "output_attentions", "output_hidden_states",
                         "output_router_logits"})


@dataclass
class Call:
    """One forward call the fast path takes, its arguments checked."""

    inputs: torch.Tensor  # input_ids [B, T] or inputs_embeds [B, T, H]
    mask: torch.Tensor | None  # [B, T]
    positions: torch.Tensor | None  # [B or 1, T]
    keep: int | torch.Tensor  # logits_to_keep as given
    labels: torch.Tensor | None
    use_cache: bool

    @property
    def shape(self) -> tuple[int, int]:
        return self.inputs.shape[0], self.inputs.shape[1]


def read_call(model: Any, kwargs: dict[str, Any], device: torch.device | None,
              params: Sequence[torch.Tensor]) -> tuple[Call | None, str]:
    """The fast-path call for these forward arguments, or (None, why the plain forward runs it). The reasons are
    fixed texts (no shapes), so each is said once."""
    for name, value in kwargs.items():
        if name in _TAKEN:
            continue
        if name in _UNSET_ONLY:
            if value is not None and value is not False:
                return None, ("a cache passed in (a continuation, not a fresh request)"
                              if name in ("past_key_values", "cache") else f"argument {name!r}")
            continue
        if value is not None:
            return None, f"argument {name!r}"
    if kwargs.get("return_dict") is False:
        return None, "return_dict=False"
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    if (ids is None) == (embeds is None):
        return None, "not exactly one of input_ids and inputs_embeds"
    if ids is not None and not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point()):
        return None, "input_ids are not one [batch, length] integer tensor"
    if embeds is not None and not (isinstance(embeds, torch.Tensor) and embeds.dim() == 3
                                   and embeds.is_floating_point()):
        return None, "inputs_embeds are not one [batch, length, hidden] float tensor"
    inputs = ids if ids is not None else embeds
    if device is not None and inputs.device != device:
        return None, "inputs on another device than the model's"
    if model.training:
        return None, "the model is in training mode (model.eval() for the fast path)"
    if torch.is_grad_enabled() and ((embeds is not None and embeds.requires_grad)
                                    or any(p.requires_grad for p in params)):
        return None, ("gradients enabled (a training step; under torch.no_grad(), or with no parameter requiring "
                      "grad, the fast path runs)")
    if getattr(model.config, "output_router_logits", False):
        return None, "config.output_router_logits (the router's auxiliary loss)"
    batch, length = inputs.shape[0], inputs.shape[1]
    mask = kwargs.get("attention_mask")
    if mask is not None and not (isinstance(mask, torch.Tensor) and tuple(mask.shape) == (batch, length)):
        return None, "an attention_mask that is not [batch, length]"
    positions = kwargs.get("position_ids")
    if positions is not None and not (isinstance(positions, torch.Tensor) and positions.dim() == 2
                                      and positions.shape[0] in (1, batch) and positions.shape[1] == length):
        return None, "position_ids that are not [batch or 1, length]"
    keep = kwargs.get("logits_to_keep", 0)
    if isinstance(keep, torch.Tensor):
        if keep.dim() != 1 or keep.is_floating_point():
            return None, "a logits_to_keep tensor that is not a 1-D index"
    elif not isinstance(keep, int) or keep < 0:
        return None, "logits_to_keep that is not an int >= 0 or a 1-D index tensor"
    labels = kwargs.get("labels")
    if labels is not None and not isinstance(labels, torch.Tensor):
        return None, "labels that are not a tensor"
    use_cache = kwargs.get("use_cache")
    use_cache = bool(getattr(model.config, "use_cache", True)) if use_cache is None else bool(use_cache)
    return Call(inputs, mask, positions, keep, labels, use_cache), ""


@dataclass
class _Run:
    """One bucket key's static inputs, and its graph once captured (with the output and cache it writes)."""

    inputs: torch.Tensor  # [rows, bucket] ids or [rows, bucket, H] embeddings
    positions: torch.Tensor  # [rows, bucket]
    cache_position: torch.Tensor  # [bucket]
    mask: torch.Tensor | None  # [rows, bucket]
    keep: int | torch.Tensor  # the last real position ([1] index) or 0 (every position)
    graph: Any = None
    captured: tuple[Any, Any] | None = None  # (the model output, its DynamicCache) the graph writes
    tried: bool = False  # capture attempted (a graph, or the reason it has none)


@dataclass(eq=False)
class ForwardFront:
    """What `optimize` puts on `model.moefx_forward`: the fast path's state, and why calls went elsewhere.

    `steps` and `graphs` are the engine's (`DecodeLoop.steps`, `.graphs`); `rows_for(batch)` the engine's batch
    bucket (rows, within the capture sizes); `buckets` and `max_tokens` the prompt buckets and their rows × bucket
    cap; `capture` whether calls replay CUDA graphs (mode capture on CUDA)."""

    model: Any
    steps: Any
    graphs: Any
    rows_for: Callable[[int], tuple[int, bool]]
    buckets: tuple[int, ...]
    max_tokens: int
    capture: bool
    compile_cache: Any = None
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> calls the plain forward ran for it
    calls: int = 0  # calls on the fast path
    captures: int = 0
    _runs: dict[tuple, _Run] = field(default_factory=dict)
    _said: set[str] = field(default_factory=set)  # the fallback reasons warned about
    _quiet: int = 0  # > 0 inside `said_by_caller()`

    def __post_init__(self) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        self._fns: dict[tuple[bool, bool, str], Callable[..., Any]] = {}  # per form, see `_fn`
        self._params = [p for p in self.model.parameters()]
        first = next(iter(self._params), None)
        self._device = first.device if first is not None else None
        self._signature = inspect.signature(self.steps.model_forward)
        kinds = {type(layer) for layer in DynamicCache(config=self.model.config).layers}
        # The cache handed back is rebuilt from DynamicLayers; other layers (sliding windows) keep what the plain
        # forward's would, so those calls asking for a cache run it.
        self._no_cache = (None if kinds == {DynamicLayer} else
                          f"cache layers {sorted(k.__name__ for k in kinds)} (the fast path rebuilds DynamicLayers)")

    def compiles(self) -> int:
        """Compiles of the padded forward, all forms together."""
        return sum(n for name, n in self.steps.stats.compiles.items() if name.startswith("forward[padded"))

    def describe(self) -> str:
        compiles = self.compiles()
        return (f"{self.calls} forward calls on the padded prefill ({len(self._runs)} bucket keys, {compiles} "
                f"compiles, {self.captures} CUDA graphs); plain compiled forward for {self.fallbacks or 'none'}")

    # -- routing ----------------------------------------------------------------------------------------------

    def route(self, plain: Callable[..., Any]) -> Callable[..., Any]:
        """`model.forward`: calls that fit run `run`, the rest `plain` (the compiled forward)."""

        @functools.wraps(plain)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if args:
                try:
                    kwargs = dict(self._signature.bind_partial(*args, **kwargs).arguments)
                except TypeError:
                    return plain(*args, **kwargs)  # the plain forward raises the caller's error
                kwargs.update(kwargs.pop("kwargs", None) or {})
            call, why = read_call(self.model, kwargs, self._device, self._params)
            if call is not None and call.use_cache and self._no_cache:
                call, why = None, self._no_cache
            if call is not None:
                batch, length = call.shape
                rows, within = self.rows_for(batch) if self.capture else (batch, True)
                bucket = pick_bucket(rows, length, self.buckets, self.max_tokens) if within else None
                if bucket is not None:
                    return self.run(call, rows, bucket)
                why = (f"batch × length above the prompt buckets (largest {self.buckets[-1]}, rows × bucket <= "
                       f"{self.max_tokens}, config key 'prefill_capture_tokens')" if within else
                       "a batch above the largest capture size (config key 'max_batch_size')")
            self._fallback(why)
            return plain(**kwargs)

        return forward

    @contextlib.contextmanager
    def said_by_caller(self) -> Iterator[None]:
        """Forward calls made inside it whose caller has said already why they run the plain path (transformers' own
        `generate()` loop for a request the engine does not take: hf_generate.py warns once why): their fallbacks
        are counted, not said again."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def _fallback(self, why: str) -> None:
        if why not in self._said and not self._quiet:
            self._said.add(why)
            warn_once(f"moefx forward: the plain compiled forward runs this call and those like it: {why}")
        self.fallbacks[why] = self.fallbacks.get(why, 0) + 1

    # -- a call on the padded prefill -------------------------------------------------------------------------

    def run(self, call: Call, rows: int, bucket: int) -> Any:
        """The model output for `call`, from the padded forward of its bucket key (a graph replay where captured)."""
        if self.compile_cache is not None:
            self.compile_cache.load()  # once: before the first compile, so it is a cache hit
        compiles = sum(self.steps.stats.compiles.values())
        batch, length = call.shape
        keep = "last" if isinstance(call.keep, int) and call.keep == 1 else "all"
        key = (rows, bucket, call.mask is not None, call.inputs.dim(), keep)
        run = self._runs.get(key)
        if run is None:
            run = self._runs[key] = _buffers(call, rows, bucket, keep == "last")
        _fill(run, call, rows)
        if self.capture and not run.tried:
            run.tried = True
            self._capture(run, key)
        if run.graph is not None:
            run.graph.replay()
            out, cache = run.captured
        else:
            out, cache = self._call(run)
        self.calls += 1
        logits = _select(out.logits[:batch], call.keep, length, keep == "last")
        loss = None
        if call.labels is not None:
            loss = self.model.loss_function(logits, call.labels, self.model.config.vocab_size)
        fields = {f.name for f in dataclasses.fields(type(out))}
        cache_field = "cache" if "cache" in fields else "past_key_values"
        result = type(out)(loss=loss, logits=logits,
                           **{cache_field: _real_cache(self.model.config, cache, batch, length)
                              if call.use_cache else None})
        if self.compile_cache is not None and sum(self.steps.stats.compiles.values()) != compiles:
            self.compile_cache.save()
        return result

    def _call(self, run: _Run) -> tuple[Any, Any]:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        out = self._fn(run)(run.inputs, run.positions, run.cache_position, run.mask, cache, run.keep)
        return out, cache

    def _fn(self, run: _Run) -> Callable[..., Any]:
        """The compiled padded forward of this run's form (masked or not, ids or embeddings, last position or all):
        a function of its own per form, so that each form's batch-1 and batch-N compiles stay far inside dynamo's
        recompile limit per function; its compiles are counted under its name."""
        form = (run.mask is not None, run.inputs.is_floating_point(), "all" if isinstance(run.keep, int) else "last")
        fn = self._fns.get(form)
        if fn is None:
            name = f"forward[padded{', masked' if form[0] else ''}{', embeds' if form[1] else ''}, {form[2]}]"
            fn = self._fns[form] = self.steps.compile(name, self.padded_forward)
        return fn

    def padded_forward(self, inputs: torch.Tensor, positions: torch.Tensor, cache_position: torch.Tensor,
                       mask: torch.Tensor | None, cache: Any, keep: int | torch.Tensor) -> Any:
        """The model over the padded inputs into `cache`: the function each `forward[padded, ...]` compiles."""
        kind = "inputs_embeds" if inputs.is_floating_point() else "input_ids"
        return self.steps.model_forward(**{kind: inputs, self.steps.cache_arg: cache}, position_ids=positions,
                                        cache_position=cache_position, attention_mask=mask, use_cache=True,
                                        logits_to_keep=keep)

    def _capture(self, run: _Run, key: tuple) -> None:
        rows, bucket = key[0], key[1]
        captured = self.graphs.capture("forward", run.inputs.device, lambda: self._call(run))
        if captured.graph is None:
            self.graphs.uncaptured(f"forward bucket {bucket} for batch {rows} runs without a CUDA graph: it "
                                   f"{captured.why}")
            return
        run.graph, run.captured = captured.graph, captured.out
        self.captures += 1
        log.info("forward captured for bucket %d, batch %d", bucket, rows)


def _buffers(call: Call, rows: int, bucket: int, last: bool) -> _Run:
    """A key's static inputs: normal tensors even when the first call runs under `torch.inference_mode()`, so a
    later call outside it may write them."""
    inputs = call.inputs
    long = {"dtype": torch.long, "device": inputs.device}
    with torch.inference_mode(False):
        run = _Run(
            inputs=torch.zeros((rows, bucket, *inputs.shape[2:]), dtype=inputs.dtype, device=inputs.device),
            positions=torch.zeros(rows, bucket, **long),
            cache_position=torch.arange(bucket, **long),
            mask=torch.ones(rows, bucket, **long) if call.mask is not None else None,
            keep=torch.zeros(1, **long) if last else 0,
        )
    # Dynamic rows and length from the first call: every bucket and batch shares one compile.
    for t in (run.inputs, run.positions, run.mask):
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 1)
    torch._dynamo.maybe_mark_dynamic(run.cache_position, 0)
    return run


def _fill(run: _Run, call: Call, rows: int) -> None:
    """The call into the static inputs: rows past the batch copy row 0, the padded tail gets token 0 (zero
    embeddings), the positions after the last real one and mask ones."""
    batch, length = call.shape
    bucket = run.positions.shape[1]
    run.inputs[:batch, :length].copy_(call.inputs)
    if rows > batch:
        run.inputs[batch:, :length].copy_(call.inputs[:1].expand(rows - batch, *call.inputs.shape[1:]))
    run.inputs[:, length:].zero_()
    if call.positions is None:
        run.positions[:, :length].copy_(run.cache_position[:length])
    else:
        run.positions[:batch, :length].copy_(call.positions)
        if rows > batch:
            run.positions[batch:, :length].copy_(call.positions[:1])
    run.positions[:, length:].copy_(run.positions[:, length - 1: length] + run.cache_position[1: bucket - length + 1])
    if run.mask is not None:
        run.mask[:batch, :length].copy_(call.mask)
        if rows > batch:
            run.mask[batch:, :length].copy_(call.mask[:1])
        run.mask[:, length:].fill_(1)
    if isinstance(run.keep, torch.Tensor):
        run.keep.fill_(length - 1)


def _select(logits: torch.Tensor, keep: int | torch.Tensor, length: int, last: bool) -> torch.Tensor:
    """The caller's logits from the padded run's (its own copy: a graph's output is overwritten by the next call).
    `last`: the run kept only the last real position; else every padded position, of which the real ones are
    `[:length]` and `keep` picks as transformers' `logits_to_keep` does (0: all, k: the last k, a tensor: those)."""
    if last:
        return logits.clone()
    real = logits[:, :length]
    if isinstance(keep, torch.Tensor):
        return real[:, keep]
    return real[:, max(0, length - keep):].clone() if keep else real.clone()


def _real_cache(config: Any, cache: Any, batch: int, length: int) -> Any:
    """A DynamicCache of the real rows and positions' keys and values, copied in one foreach call (x * 1 is exact)."""
    from transformers import DynamicCache

    layers = cache.layers
    views = [t[:batch, :, :length] for layer in layers for t in (layer.keys, layer.values)]
    copies = torch._foreach_mul(views, 1)
    out = DynamicCache(config=config)
    for i, layer in enumerate(out.layers):
        keys, values = copies[2 * i], copies[2 * i + 1]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return out
