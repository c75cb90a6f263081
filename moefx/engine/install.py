"""The `engine` transform of `optimize`: `generate()` on moefx's decode engine, stop flag read late.

On every device a transformers causal LM's `generate()` runs on the engine (`moefx/engine/engine.py`) for
the requests it reproduces (`moefx/engine/hf_generate.py`): static KV cache, prefill and decode step compiled
with the moefx backend (mode compile or capture), and in mode capture on CUDA each decode step replayed from a
CUDA graph per capture bucket. Other requests run transformers' loop, which on CUDA reads its stop flag one
step late (`enable_deferred_stop`, same file). The engine's compile artifacts persist across processes
(`moefx/engine/compile_cache/`). The model's own forward gets a front too (`moefx/engine/forward.py`,
`model.moefx_forward`): calls that fit the padded prefill run it, the rest the compiled forward.

It runs after the `layer_regions` transform and before `optimize()` compiles `model.forward` (both in the
order of `moefx.optimize.model_transforms()`, whose `after` fields a test holds): the engine binds the
compiled-frame hook `layer_regions` leaves on the model (`layer_frames`), and takes the uncompiled `model.forward`,
since given the compiled one its steps would trace into a second compiled frame. `optimize()` then compiles the
model's own forward without CUDA graphs, since `model.moefx_generate` says the engine captures its own, and puts
`model.moefx_forward` in front. What this transform wraps, in order, is `INSTALL_STEPS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moefx.engine.hf_generate import enable_deferred_stop, no_transformers_generate


@dataclass
class _Installed:
    """What the steps hand on: the engine once built, whether its steps replay CUDA graphs, and why the forward
    front stays off."""

    engine: Any = None
    graphs: bool = False
    forward_off: str | None = None


def _engine_lines(model: Any, plan: Any, config: Any, done: _Installed) -> list[str]:
    from moefx.compile import backend
    from moefx.engine.compile_cache.aot import why_no_aot
    from moefx.engine.compile_cache.file import engine_cache
    from moefx.engine.engine import DecodeLoop
    from moefx.engine.hf_generate import install_generate
    from moefx.engine.layers.regions import layer_frames

    mode = getattr(config, "mode", "compile")
    device = getattr(getattr(plan, "execution", None), "device_type", None)
    sizes = list(getattr(plan, "serving", {}).get("capture_sizes") or [])
    graphs = mode == "capture" and device == "cuda" and bool(sizes)
    compile_kwargs = None if mode == "eager" else {"backend": backend(config, plan, cudagraphs=False)}
    # Offloaded experts calls above the stream host's rows cannot be captured: their prefill stays unpadded.
    offloaded = any(hasattr(module, "moefx_offload") for module in model.modules())
    prefill_tokens = getattr(config, "prefill_capture_tokens", 0) if graphs and not offloaded else 0
    frames = layer_frames(model)
    cache = None if compile_kwargs is None else engine_cache(plan, config, compile_kwargs["backend"],
                                                             frames.handle if frames is not None else None)
    engine = DecodeLoop(model, compile_kwargs=compile_kwargs, cuda_graphs=graphs, capture_sizes=sizes or None,
                        forward=model.forward, prefill_capture_tokens=prefill_tokens,
                        memory_budget=getattr(config, "memory_budget", None), saved_traces=cache is not None)
    if cache is not None:
        cache.attach(engine)
    install_generate(model, engine)
    done.engine, done.graphs = engine, graphs
    done.forward_off = "mode eager" if compile_kwargs is None else "offloaded experts" if offloaded else None
    steps = "eager steps (mode eager)" if compile_kwargs is None else "compiled prefill and decode step"
    prefill = (f"; prefill padded to prompt buckets {list(engine.stats.prefill_buckets)} (rows × bucket <= "
               f"{prefill_tokens}) and captured" if prefill_tokens else "")
    where = (f"decode steps replayed from CUDA graphs for batches {sizes}, each captured on first use (padded to "
             f"the bucket; larger batches without graphs, said once in fallbacks){prefill}" if graphs
             else f"no CUDA graphs (mode {mode} on {device})")
    traces = ("and traces (a new process runs the steps without tracing them) " if engine.aot_steps is not None
              else f"(no traces: {why_no_aot() or 'not kept'}) ")
    kept = "" if compile_kwargs is None else (f"; compile artifacts {traces}kept in {cache.path}" if cache is not None
                                             else "; compile cache off")
    slots = engine.slots
    budget = f"{slots.setting:g} of free memory" if slots.setting <= 1 else f"{slots.setting / 2**20:.0f} MiB"
    return [f"generate() on moefx's engine: static KV cache, {steps}, {where}; other requests run transformers' "
            f"loop (model.moefx_generate.fallbacks says why){kept}",
            f"decode engine memory: cache lengths {slots.min_len}, {slots.min_len * 3 // 2}, {slots.min_len * 2}, "
            f"... (x1.5 / x4/3 steps); all slots and graph pools within a budget of {budget} ({slots.source}), "
            f"least-recently-used slots freed first; a request that cannot fit raises MemoryBudgetError"]


def _forward_lines(model: Any, plan: Any, config: Any, done: _Installed) -> list[str]:
    """`model.moefx_forward` (`moefx/engine/forward.py`) on the engine's steps and graphs, which `optimize` puts in
    front of the compiled forward, unless `done.forward_off` says why not. Offloaded experts calls above the stream
    host's rows cannot be captured, as for the engine's padded prefill."""
    from moefx.config import PREFILL_CAPTURE_TOKENS, prefill_buckets
    from moefx.engine.forward import ForwardFront

    if done.engine is None:
        return []  # no engine: the model keeps its forward (the engine line says why)
    engine, graphs = done.engine, done.graphs
    max_tokens = getattr(config, "prefill_capture_tokens", PREFILL_CAPTURE_TOKENS)
    buckets = prefill_buckets(max_tokens)
    off = done.forward_off or (None if buckets else "config key prefill_capture_tokens 0")
    if off:
        return [f"forward: the plain forward ({off})"]
    model.moefx_forward = ForwardFront(model, engine.steps, engine.graphs, engine.bucket, buckets, max_tokens,
                                       capture=graphs, compile_cache=engine.compile_cache)
    where = "replayed from a CUDA graph per bucket key" if graphs else "compiled, without CUDA graphs"
    return [f"forward: calls without gradients and without a cache passed in run the prompt padded to its bucket "
            f"{list(buckets)} (rows × bucket <= {max_tokens}), {where}; other calls run the compiled forward "
            f"(model.moefx_forward.fallbacks says why)"]


def _generate_lines(model: Any, plan: Any, config: Any, done: _Installed) -> list[str]:
    why_not = _engine_reason(model)
    return [f"generate() engine off: {why_not}"] if why_not else _engine_lines(model, plan, config, done)


def _deferred_stop_lines(model: Any, plan: Any, config: Any, done: _Installed) -> list[str]:
    device = getattr(getattr(plan, "execution", None), "device_type", None)
    if device != "cuda":
        return [f"deferred stop check off: device {device or 'unknown'} (on for cuda only)"]
    why = enable_deferred_stop(model, devices=("cuda",))
    return [f"deferred stop check off: {why}" if why is not None
            else "deferred stop check on for transformers' generate() (stop flag read one step late)"]


@dataclass(frozen=True)
class InstallStep:
    wraps: str  # what it puts a front on: "generate" or "forward"
    install: Callable[[Any, Any, Any, _Installed], list[str]]  # (model, plan, config, done) -> provenance lines


# What `install_engine` wraps, in this order.
INSTALL_STEPS: tuple[InstallStep, ...] = (
    # model.generate -> the engine for the requests it reproduces, transformers' loop for the rest
    InstallStep("generate", _generate_lines),
    # model.moefx_forward on the engine's steps and graphs: after the engine, which it needs
    InstallStep("forward", _forward_lines),
    # transformers' loop reads its stop flag a step late: after the engine's front, which it then finds and defers
    # the stop check inside, so that model.generate is wrapped once
    InstallStep("generate", _deferred_stop_lines),
)


def install_engine(model: Any, plan: Any, config: Any) -> list[str]:
    """The `engine` model transform: every step of INSTALL_STEPS, in order; their provenance lines."""
    done = _Installed()
    return [line for step in INSTALL_STEPS for line in step.install(model, plan, config, done)]


def _engine_reason(model: Any) -> str | None:
    if why := no_transformers_generate(model):
        return why
    if getattr(model.config, "is_encoder_decoder", False):
        return "encoder-decoder models keep transformers' loop"
    return None
