"""transformers' `generate()` with moefx: requests the engine reproduces run on it, the rest in transformers' loop
with its stop flag read one step late. `model.generate` is wrapped once, by `install_generate` (or, for a model
without the engine, by `enable_deferred_stop`).

The engine front. `install_generate(model, engine)` wraps `model.generate`. Each call form is read with transformers'
own helpers (`_prepare_generation_config`, `_prepare_special_tokens`, `_get_logits_processor`), so defaults and the
model's generation config apply as in the stock loop; what they answered is kept for repeated calls of that form
while the model's configs stay unchanged (`SettingsMemo`: the read costs more host time than the rest of the first
token's path). A request runs on the engine when everything it asks
for is something the engine does: greedy, or sampling with temperature / top-k / top-p / min-p; EOS and pad
ids; `max_new_tokens` / `max_length`; user stopping criteria (called each step with the tokens so far and
the step's raw logits); a left-padded attention mask. Anything else — beam search, other logits
processors, streamers, returned scores or dicts, a cache passed in, assisted decoding — runs transformers'
own loop, and the reason is logged once and kept in `model.moefx_generate.fallbacks`.

The deferred stop check. Stock `_sample` evaluates `unfinished_sequences.max() == 0` on the host after every token,
which waits for the GPU each step. transformers 5.x ships the fix (`DeferredStopCheck`: copy the flag to pinned
memory asynchronously, read it on the next step, undo the one extra step at the end) but turns it on only for MPS.
moefx turns it on, per model and only inside that model's `generate()`, for the devices it is asked for (CUDA from
`optimize`). Outputs are identical to the stock loop: the extra step's token is trimmed and a returned cache is
cropped back, by transformers' own code. Without a fork: the module-level `DeferredStopCheck` that `_sample` looks
up is replaced once by a subclass that behaves exactly like the original unless a moefx-enabled `generate()` is
running.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from moefx.engine.request import Request, check_input_ids
from moefx.log import get_logger
from moefx.sampling.sampler import SamplingParams

if TYPE_CHECKING:
    from moefx.engine.engine import DecodeLoop

log = get_logger("moefx.engine")

# -- the deferred stop check ---------------------------------------------------------------------------------------

# Device types for which the running generate() defers its stop check (empty: stock behaviour).
_DEFER_ON: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("moefx_defer_stop", default=())
_INSTALLED: dict[str, Any] = {}


class _HostEvent:
    """Stands in for `torch.Event` on devices without events (CPU): copies there are already synchronous."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _patched_class() -> type | None:
    """transformers' DeferredStopCheck, subclassed to honour `_DEFER_ON`; None when this transformers lacks it."""
    if "cls" in _INSTALLED:
        return _INSTALLED["cls"]
    try:
        from transformers.generation import utils as gen_utils
    except ImportError:
        return None
    base = getattr(gen_utils, "DeferredStopCheck", None)
    if base is None or not hasattr(base, "is_supported"):
        return None

    class MoefxDeferredStopCheck(base):  # type: ignore[misc, valid-type]
        """transformers' DeferredStopCheck, enabled on more devices while a moefx generate() runs."""

        instances = 0

        def __init__(
            self, input_ids: torch.Tensor, max_length: int, cache: Any, cache_is_returned: bool, streamer: Any = None
        ) -> None:
            MoefxDeferredStopCheck.instances += 1
            if input_ids.device.type != "cpu":
                super().__init__(input_ids, max_length, cache, cache_is_returned, streamer)
                return
            # torch has no CPU events; the same state as the base class, with synchronous stand-ins.
            gen_utils.StopCheck.__init__(self, streamer)
            self.max_length = max_length
            self.cache = cache if cache_is_returned else None
            if self.cache is not None:
                self.cache.activate_past_recording()
            batch = input_ids.shape[0]
            self.slots = collections.deque(
                (torch.zeros((), dtype=torch.bool), torch.zeros(batch, dtype=torch.long), _HostEvent())
                for _ in range(2)
            )
            self.is_first_step = True
            self.stop_reported = False

        @staticmethod
        def is_supported(device: torch.device, cache: Any, cache_is_returned: bool, is_assistant: bool) -> bool:
            if device.type not in _DEFER_ON.get():
                return base.is_supported(device, cache, cache_is_returned, is_assistant)
            if is_assistant:
                return False
            return cache is None or bool(getattr(cache, "is_croppable", False)) or not cache_is_returned

    gen_utils.DeferredStopCheck = MoefxDeferredStopCheck
    _INSTALLED["cls"] = MoefxDeferredStopCheck
    return MoefxDeferredStopCheck


def no_transformers_generate(model: Any) -> str | None:
    """Why `model` has no transformers `generate()` loop to hook, or None when it has one."""
    if not callable(getattr(model, "generate", None)) or not hasattr(model, "_sample"):
        return "the model has no transformers generate()"
    return None


def enable_deferred_stop(model: Any, devices: tuple[str, ...] = ("cuda",)) -> str | None:
    """Make `model.generate()` defer its stop check on `devices`. Returns None when applied, else why not. A model
    whose generate() has the engine front (`install_generate`) gets no second wrapper: the front defers the stop
    check of the requests it hands to transformers' loop."""
    if why := no_transformers_generate(model):
        return why
    if getattr(model, "_moefx_deferred_stop", None) is not None:
        return None
    if _patched_class() is None:
        return "this transformers version has no DeferredStopCheck"
    model._moefx_deferred_stop = tuple(devices)
    log.debug("deferred stop check enabled for %s on %s", type(model).__name__, devices)
    if getattr(model, "moefx_generate", None) is not None:
        return None
    original = model.generate

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        with _deferred_stop(model):
            return original(*args, **kwargs)

    model.generate = generate
    return None


@contextlib.contextmanager
def _deferred_stop(model: Any) -> Iterator[None]:
    """transformers' loop inside the block defers its stop check on the devices enabled for `model`."""
    devices = getattr(model, "_moefx_deferred_stop", None)
    if devices is None:
        yield
        return
    token = _DEFER_ON.set(devices)
    try:
        yield
    finally:
        _DEFER_ON.reset(token)


def deferred_stop_instances() -> int:
    """How many deferred stop checks moefx-enabled generate() calls have created (tests, benchmarks)."""
    cls = _patched_class()
    return cls.instances if cls is not None else 0


# -- the engine front ----------------------------------------------------------------------------------------

# Processors transformers builds that the engine's sampler reproduces (moefx/sampling/sampler.py).
ENGINE_PROCESSORS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper")
# generate() arguments that the engine takes when unset / falsy.
_UNSUPPORTED_ARGS = (
    "logits_processor", "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model", "streamer",
    "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate", "inputs_embeds", "past_key_values",
    "cache", "assistant_tokenizer", "tokenizer",
)
# GenerationConfig fields, with the value the engine needs (None: unset or falsy).
_CONFIG_NEEDS: dict[str, Any] = {
    "num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1, "return_dict_in_generate": None,
    "output_scores": None, "output_logits": None, "output_attentions": None, "output_hidden_states": None,
    "penalty_alpha": None, "dola_layers": None, "prompt_lookup_num_tokens": None, "assistant_early_exit": None,
    "max_time": None, "stop_strings": None, "watermarking_config": None,
}
_MODEL_KWARGS_OK = {"attention_mask", "use_cache", "output_attentions", "output_hidden_states"}


@dataclass(frozen=True)
class Settings:
    """What a generate() call asks of the engine apart from its prompt and mask: read from the call's arguments and
    the model's generation config by transformers' helpers, so it depends on nothing else (`SettingsMemo`)."""

    params: SamplingParams
    max_new_tokens: int | None
    max_length: int | None
    eos: tuple[int, ...]
    pad: int
    pad_set: bool  # a pad id was set: transformers infers the mask from pad tokens in the prompt


def read_settings(model: Any, gen_config: Any, kwargs: dict[str, Any],
                  inputs: torch.Tensor) -> tuple[Settings | None, str]:
    """The call's `Settings` by transformers' own helpers, or (None, why the engine cannot run it). `kwargs` are
    generate()'s keyword arguments less the prompt, the stopping criteria and the generation config."""
    try:
        gc, model_kwargs = model._prepare_generation_config(gen_config, **kwargs)
    except (AttributeError, TypeError) as exc:
        return None, f"this transformers' generate() could not be read ({exc})"
    extra = sorted(k for k, v in model_kwargs.items() if k not in _MODEL_KWARGS_OK and v is not None)
    if extra:
        return None, f"model arguments {extra}"
    if model_kwargs.get("use_cache") is False or gc.use_cache is False:
        return None, "use_cache=False"
    for name, want in _CONFIG_NEEDS.items():
        value = getattr(gc, name, None)
        if value not in (None, False, want):
            return None, f"generation config {name}={value!r}"
    if getattr(gc, "cache_implementation", None) not in (None, "static", "dynamic"):
        return None, f"cache_implementation={gc.cache_implementation!r}"
    try:
        model._prepare_special_tokens(gc, model_kwargs.get("attention_mask") is not None, device=inputs.device)
        processors = model._get_logits_processor(
            generation_config=gc, input_ids_seq_length=inputs.shape[1], encoder_input_ids=inputs,
            logits_processor=None, device=inputs.device, model_kwargs=model_kwargs,
        )
    except (AttributeError, TypeError) as exc:
        return None, f"this transformers' generate() could not be read ({exc})"
    other = sorted({type(p).__name__ for p in processors} - set(ENGINE_PROCESSORS))
    if other:
        return None, f"logits processors {other}"
    if gc.max_new_tokens is None and gc.max_length is None:
        return None, "no max_new_tokens or max_length"
    if gc.do_sample:
        params = SamplingParams(
            temperature=float(gc.temperature if gc.temperature is not None else 1.0),
            top_k=int(gc.top_k or 0), top_p=float(gc.top_p if gc.top_p is not None else 1.0),
            min_p=float(gc.min_p or 0.0),
        )
        if params.greedy:
            return None, "do_sample with temperature 0"
    else:
        params = SamplingParams(temperature=0.0)
    eos_t, pad_t = gc._eos_token_tensor, gc._pad_token_tensor
    eos = () if eos_t is None else tuple(int(t) for t in eos_t.reshape(-1).tolist())
    pad = int(pad_t) if pad_t is not None else (eos[0] if eos else 0)
    return Settings(params, None if gc.max_new_tokens is None else int(gc.max_new_tokens),
                    None if gc.max_length is None else int(gc.max_length), eos, pad, pad_t is not None), ""


class SettingsMemo:
    """`read_settings`' answers kept per call form, so a repeated call reads no generation config: transformers'
    helpers deep-copy and merge the model's generation config, build the logits processors and put the special
    tokens on the device (host syncs on CUDA), ~0.4-0.8 ms of host time before the prefill can launch
    (docs/FINDINGS.md). An answer depends only on the call's arguments (kept as its key: names, types and values;
    a tensor argument only as whether it is set), the device, and the model's `config` and `generation_config`,
    whose attributes are compared with a copy taken when the answers were read: any change drops them all. Calls
    with a `generation_config` object or an argument of another kind are read each time; so are the calls the
    engine cannot run (they run transformers' loop, far slower than a read)."""

    MAX_FORMS = 64  # distinct call forms kept; more drops them all

    def __init__(self) -> None:
        self.answers: dict[tuple, Settings] = {}
        self.reads = 0  # calls read by transformers' helpers (tests)
        self._seen: tuple[dict[str, Any], dict[str, Any]] | None = None

    def settings(self, model: Any, gen_config: Any, kwargs: dict[str, Any],
                 inputs: torch.Tensor) -> tuple[Settings | None, str]:
        key = None if gen_config is not None else _call_form(kwargs, inputs.device)
        if key is not None and self._unchanged(model):
            hit = self.answers.get(key)
            if hit is not None:
                return hit, ""
        self.reads += 1
        settings, why = read_settings(model, gen_config, kwargs, inputs)
        if settings is not None and key is not None:
            if len(self.answers) >= self.MAX_FORMS:
                self.answers.clear()
            self.answers[key] = settings
        return settings, why

    def _unchanged(self, model: Any) -> bool:
        """Whether the model's configs are as when the answers were read; if not, the answers are dropped and a
        copy of the configs' attributes is taken for the next ones."""
        generation_config = getattr(model, "generation_config", None)
        config, gen = vars(model.config), vars(generation_config) if generation_config is not None else {}
        try:
            if self._seen is not None and self._seen[0] == config and self._seen[1] == gen:
                return True
        except Exception:  # an attribute whose comparison raises (a tensor of several values): a change
            pass
        self.answers.clear()
        try:
            self._seen = (dict(config), copy.deepcopy(gen))
        except Exception:  # an attribute that cannot be copied: nothing is kept
            self._seen = None
        return False


def _call_form(kwargs: dict[str, Any], device: torch.device) -> tuple | None:
    """The key of a call's arguments (None: an argument of a kind not kept)."""
    items: list[tuple] = [("", device)]
    for name in sorted(kwargs):
        value = kwargs[name]
        if isinstance(value, torch.Tensor):
            items.append((name, torch.Tensor))
        elif value is None or isinstance(value, (bool, int, float, str)):
            items.append((name, type(value), value))
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
            items.append((name, type(value), tuple((type(v), v) for v in value)))
        else:
            return None
    return tuple(items)


def _read_flags(*flags: torch.Tensor) -> list[bool]:
    return [bool(v) for v in torch.stack(flags).tolist()] if flags else []


def read_request(model: Any, args: tuple, kwargs: dict[str, Any], memo: SettingsMemo | None = None,
                 read: Callable[..., list[bool]] = _read_flags) -> tuple[Request | None, str]:
    """The engine request for this generate() call, or (None, why the engine cannot run it). `memo` keeps the
    settings read for repeated call forms (`SettingsMemo`). `read(*flags)` reads the device bools of the prompt's
    checks (pad tokens in it, the mask's form) on the host, called once when the settings are read: the front
    passes its id check, so one host read serves both."""
    kwargs = dict(kwargs)
    if len(args) > 2:
        return None, "positional arguments after generation_config"
    inputs = args[0] if args else kwargs.pop("inputs", None)
    if inputs is None:
        inputs = kwargs.pop("input_ids", None)
    if len(args) > 1:
        kwargs["generation_config"] = args[1]
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2 or inputs.dtype != torch.long:
        return None, "input ids are not one [batch, length] LongTensor"
    for name in _UNSUPPORTED_ARGS:
        value = kwargs.pop(name, None)
        if value is not None and value is not False and not (hasattr(value, "__len__") and len(value) == 0):
            return None, f"argument {name!r}"
    criteria = list(kwargs.pop("stopping_criteria", None) or [])
    gen_config = kwargs.pop("generation_config", None)
    settings, why = (memo.settings if memo is not None else read_settings)(model, gen_config, kwargs, inputs)
    if settings is None:
        return None, why
    new = settings.max_new_tokens
    if new is None:
        new = settings.max_length - inputs.shape[1]
    if new < 1:
        return None, f"max_new_tokens={new}"
    eos, pad = list(settings.eos), settings.pad
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(inputs.shape):
        return None, f"attention_mask of shape {tuple(attention_mask.shape)} for inputs {tuple(inputs.shape)}"
    if attention_mask is None and settings.pad_set and pad not in eos:
        # pad tokens in the prompt (transformers then infers a mask from them), and none in its last column
        padded, last = read((inputs == pad).any(), (inputs[:, -1:] != pad).all())
        every = not padded
        if padded:
            attention_mask = inputs.ne(pad).long()
    elif attention_mask is not None:
        every, last = read(attention_mask.all(), attention_mask[:, -1:].all())
    else:
        read()
    if attention_mask is not None:
        if every:
            attention_mask = None
        elif not last:
            return None, "a right-padded attention_mask (the engine takes left padding)"
    return Request(inputs, attention_mask, new, settings.params, eos, pad, criteria), ""


@dataclass
class GenerateFront:
    """What `optimize` puts on `model.moefx_generate`: the engine, and why requests went elsewhere."""

    engine: DecodeLoop
    # Why requests ran transformers' loop (one line per request), and once each, "engine: ..." lines for steps
    # the engine ran without a CUDA graph (a batch above the largest capture size, a step that cannot be captured).
    fallbacks: list[str] = field(default_factory=list)
    loop_requests: int = 0
    # The settings read per call form (`SettingsMemo`): a repeated call reads no generation config.
    memo: SettingsMemo = field(default_factory=SettingsMemo)
    _engine_notes: int = 0

    def describe(self) -> str:
        s = self.engine.stats
        above = f" ({s.above_cap} above the largest capture size, without graphs)" if s.above_cap else ""
        return (f"{s.requests} requests on the engine{above}, {self.loop_requests} in transformers' loop; "
                f"compiles {s.compiles or 'none'} (backend seconds {s.compile_s or 'none'}); {s.captures} CUDA graphs "
                f"captured; prefill buckets {list(s.prefill_buckets) or 'off'}, {s.prefill_captures} prefill graphs "
                f"({s.prefill_graph_bytes / 2**20:.0f} MiB reserved); {s.describe_slots()}")

    def note_engine(self) -> None:
        """Copy the engine's new "decoded without a CUDA graph" lines into `fallbacks`."""
        lines = self.engine.stats.uncaptured
        self.fallbacks.extend(f"engine: {line}" for line in lines[self._engine_notes:])
        self._engine_notes = len(lines)


def _fallback(front: GenerateFront, why: str) -> None:
    if why not in front.fallbacks:
        log.warning("generate() runs transformers' own loop: %s", why)
    front.fallbacks.append(why)
    front.loop_requests += 1


def install_generate(model: Any, engine: DecodeLoop) -> GenerateFront:
    """Wrap `model.generate` so the requests the engine reproduces run on it; the rest run as before, their stop
    check deferred where `enable_deferred_stop` turned it on."""
    original = model.generate
    front = GenerateFront(engine)

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        prompt = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
        checked = []

        def read(*flags: torch.Tensor) -> list[bool]:  # the id check and the request's own checks: one host read
            checked.append(True)
            return check_input_ids(model.config, prompt, *flags)

        request, why = read_request(model, args, kwargs, front.memo, read)
        if not checked:
            check_input_ids(model.config, prompt)  # either loop: a bad id is one clear line before anything runs
        if request is None:
            _fallback(front, why)
            if len(args) < 2 and "generation_config" not in kwargs:
                kwargs.setdefault("disable_compile", True)  # the forward is compiled already
            forward = getattr(model, "moefx_forward", None)  # its fallbacks are this request's, said above
            with _deferred_stop(model), (forward.said_by_caller() if forward is not None else contextlib.nullcontext()):
                return original(*args, **kwargs)
        try:
            return engine.run(request)  # its ids checked above
        finally:
            front.note_engine()

    model.generate = generate
    model.moefx_generate = front
    return front
