"""The one configuration object used by all three ways in: decorator, `torch.compile` backend and vLLM.

Every key is declared once, as a dataclass field. Loading validates types and enum values and names
the bad key, the valid choices and a close match, so a typo never silently turns an optimization off.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import types
import typing
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

MOE_BACKENDS = ("auto", "reference", "grouped", "gemv", "torch_grouped", "cpu", "upstream")
# Other names a MoE backend is accepted under (config, env, calibration tables, rule pins, the op's arguments), each
# mapped to its name: `legacy` is the reference backend's former name, still part of the public contract.
MOE_BACKEND_ALIASES: dict[str, str] = {"legacy": "reference"}
DENSE_BACKENDS = ("auto", "upstream", "gemv")
MODES = ("eager", "compile", "capture")
LAYER_REGIONS = ("auto", "all", "prefill", "none", "frames")
OFFLOAD_DEVICES = ("gpu", "cpu", "auto")
# The decode engine's memory budget when neither config nor env sets it: this fraction of the free device memory
# (measured at its first allocation) leaves the rest to activations and the prefill.
DEFAULT_MEMORY_BUDGET = 0.7
# Prompt-length buckets of the engine's padded prefill, captured in a CUDA graph each (tokens per row): the one place
# to change them (moefx/engine/prefill.py pads to them). Config key `prefill_capture_tokens` caps rows × bucket.
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# The default cap on rows × bucket: bounds the activations one prefill graph holds.
PREFILL_CAPTURE_TOKENS = PREFILL_BUCKETS[-1]
MIN_BUDGET_BYTES = 4096  # below a 4 KiB page no KV cache row of any model fits: such a number meant a fraction
# The largest `max_batch_size`: 23 geometric capture sizes (moefx/signatures/serving.py), each a CUDA graph and a
# static cache slot; the plan's own memory-derived cap stops at 512. A larger number is a typo, not a serving size.
MAX_BATCH_SIZE = 8192
# The largest `prefill_token_budget` (tokens per prefill chunk): 2**20 holds a whole prompt at the longest
# max_position_embeddings of the catalog (163840, DeepSeek-V3) several times over.
MAX_PREFILL_TOKEN_BUDGET = 2**20
_BYTE_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def check_memory_budget(value: Any, what: str) -> float:
    """A memory budget as a number: 0 < x <= 1 is a fraction of free memory, x >= 4 KiB is bytes. A number between
    the two (`2.0`, `50`) is refused rather than read as a few bytes: it reads as a fraction or a percentage."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{what} must be a number > 0 (a fraction of free device memory when <= 1, else bytes), "
                         f"got {value!r}")
    if 1 < value < MIN_BUDGET_BYTES:
        raise ValueError(f"{what} is {value!r}: neither a fraction of free device memory (0 < x <= 1, e.g. 0.6) "
                         f"nor a byte amount (at least 4 KiB, e.g. 40GiB or 4e10); not read as {value:g} bytes")
    return float(value)


def parse_memory_budget(raw: str) -> float:
    """`0.6`, `8e9`, `40GiB`, `512MiB`, `80GB` -> the budget as `check_memory_budget` reads it."""
    text = raw.strip().lower().replace(" ", "")
    number = text.rstrip("kmgtib")
    unit = text[len(number):]
    if unit not in _BYTE_UNITS:
        raise ValueError(f"unknown unit {unit!r}; valid units: {sorted(u for u in _BYTE_UNITS if u)}")
    try:
        value = float(number) * _BYTE_UNITS[unit]
    except ValueError:
        value = None
    return check_memory_budget(value, "the memory budget (a fraction in (0, 1] or bytes, e.g. 0.6 or 40GiB)")


def prefill_buckets(max_tokens: Any) -> tuple[int, ...]:
    """The prefill buckets a rows × bucket cap (config key `prefill_capture_tokens`) allows; 0: none, the prefill is
    neither padded nor captured."""
    if max_tokens != 0 and max_tokens not in PREFILL_BUCKETS:
        raise ValueError(f"config key 'prefill_capture_tokens' must be 0 (off) or one of {list(PREFILL_BUCKETS)}, "
                         f"got {max_tokens!r}")
    return tuple(b for b in PREFILL_BUCKETS if b <= max_tokens)


def _choices(*values: str, aliases: dict[str, str] | None = None) -> dict[str, Any]:
    """A field's valid values and the other names (`aliases`) it accepts for them, mapped on load."""
    return {"choices": values, "aliases": aliases or {}}


@dataclass
class PassConfig:
    """Pass toggles. `None` lets the plan decide; `True`/`False` is the user's word and wins."""

    eliminate_noops: bool | None = None
    fuse_act_quant: bool | None = None
    fuse_norm_quant: bool | None = None
    rewrite_sampler_syncs: bool | None = None
    # Sub-toggle of rewrite_sampler_syncs: multinomial -> exponential race changes the random stream.
    sampler_exponential_race: bool | None = None
    last_token_logits: bool | None = None
    fuse_moe_routing: bool | None = None
    fuse_moe_residual: bool | None = None
    fuse_qk_norm_rope: bool | None = None
    fuse_sibling_linears: bool | None = None
    # Send the remaining single linears to moefx::dense_linear too, so the dense policy picks per call.
    dense_linears: bool | None = None
    # Fold the RMSNorm before a dense_linear call (a layer's input norm before q/k/v) into the GEMV's prologue.
    fuse_norm_linear: bool | None = None
    # Route the router's logits in its GEMV's last program (after fuse_norm_linear and fuse_moe_routing).
    fuse_router_topk: bool | None = None
    # At decode M (<= 4 rows) FP8 block linears read their float input (weight-only dequant, no activation quant);
    # None: on where the dense policy runs the GEMV (faster than the W8A8 form on the H100, docs/DENSE.md).
    fp8_weight_only: bool | None = None
    # Write each graph before/after the moefx passes into this folder (also MOEFX_DUMP_GRAPHS).
    dump_graph_dir: str | None = None


@dataclass
class OffloadConfig:
    # None: not set (MOEFX_OFFLOAD_EXPERTS, else "gpu": the experts stay with the model).
    experts: str | None = field(default=None, metadata=_choices(*OFFLOAD_DEVICES))


@dataclass
class CompilationConfig:
    pass_config: PassConfig = field(default_factory=PassConfig)
    moe_backend: str = field(default="auto", metadata=_choices(*MOE_BACKENDS, aliases=MOE_BACKEND_ALIASES))
    dense_backend: str = field(default="auto", metadata=_choices(*DENSE_BACKENDS))
    # capture: compiled, with CUDA graphs where the device has them (compile and eager opt out of those steps).
    mode: str = field(default="capture", metadata=_choices(*MODES))
    # Caps the decode engine's CUDA-graph batch buckets; None: a cap derived from free memory (docs/SIGNATURES.md,
    # "How a plan is resolved").
    max_batch_size: int | None = None
    # Memory all of the decode engine's slots (static caches, CUDA-graph pools) share: a fraction of the free
    # device memory when <= 1, else bytes; None: env MOEFX_MEMORY_BUDGET, else DEFAULT_MEMORY_BUDGET.
    memory_budget: float | None = None
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    calibration: list[str] = field(default_factory=list)
    rules: list[str] = field(default_factory=list)
    # Prefill token budget override; None lets the plan decide (docs/SIGNATURES.md, "How a plan is resolved").
    prefill_token_budget: int | None = None
    # Cap on rows × prompt bucket of the prefill captured in CUDA graphs (mode capture on CUDA); 0 turns it off.
    prefill_capture_tokens: int = PREFILL_CAPTURE_TOKENS
    # Turn "asked for but unsupported here" from a one-time warning into an error.
    strict: bool = False
    # Let torch.compile treat sequence lengths as dynamic from the first compile.
    dynamic: bool | None = None
    # Persistent compile artifacts of the generate() engine: true, false or a folder; None: MOEFX_COMPILE_CACHE,
    # else on (moefx/engine/compile_cache/file.py).
    compile_cache: bool | str | None = None
    # Compile identical decoder layers once (moefx/engine/layers/regions.py): as one nested compile region in the
    # prefill and the decode step ("all"), in the prefill only (the decode step keeps its cross-layer fusions),
    # nowhere, or ("frames") as compiled frames of their own, which trace once per kind of call on a torch without
    # region reuse. "auto": frames where this torch traces every region call again (< 2.12), else all.
    layer_regions: str = field(default="auto", metadata=_choices(*LAYER_REGIONS))

    def __post_init__(self) -> None:
        self.moe_backend = MOE_BACKEND_ALIASES.get(self.moe_backend, self.moe_backend)
        mbs = self.max_batch_size
        if mbs is not None and (isinstance(mbs, bool) or not isinstance(mbs, int) or not 1 <= mbs <= MAX_BATCH_SIZE):
            raise ValueError(f"config key 'max_batch_size' must be an integer >= 1 and <= {MAX_BATCH_SIZE} or null "
                             f"(null: a cap derived from free memory), got {mbs!r}")
        if self.memory_budget is not None:
            check_memory_budget(self.memory_budget, "config key 'memory_budget'")
        budget = self.prefill_token_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or not 1 <= budget <= MAX_PREFILL_TOKEN_BUDGET):
            raise ValueError(f"config key 'prefill_token_budget' must be an integer >= 1 and <= "
                             f"{MAX_PREFILL_TOKEN_BUDGET} (tokens per prefill chunk) or null, got {budget!r}")
        prefill_buckets(self.prefill_capture_tokens)
        if isinstance(self.compile_cache, str) and not self.compile_cache.strip():
            raise ValueError("config key 'compile_cache' must be true, false, null or a folder path, got ''")

    @classmethod
    def from_any(cls, x: Any = None) -> CompilationConfig:
        """Build from a dict, a JSON string, a .json/.yaml/.yml path, or return a CompilationConfig as is."""
        if x is None:
            return cls()
        if isinstance(x, CompilationConfig):
            return x
        if isinstance(x, os.PathLike):
            x = str(x)
        if isinstance(x, str):
            x = _load_text_or_path(x)
        if not isinstance(x, dict):
            raise ValueError(
                f"config must be a dict, a JSON string, a .json/.yaml path or a CompilationConfig, "
                f"got {type(x).__name__}"
            )
        return _build(cls, x, "")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def with_overrides(self, overrides: list[str]) -> CompilationConfig:
        """Apply vLLM-style dotted overrides such as ``pass_config.fuse_act_quant=true``."""
        data = self.to_dict()
        for item in overrides:
            key, sep, raw = item.partition("=")
            if not sep or not key:
                raise ValueError(f"override {item!r} must look like 'dotted.key=value'")
            parts = key.strip().split(".")
            node = data
            for depth, part in enumerate(parts[:-1]):
                if not isinstance(node.get(part), dict):
                    prefix = ".".join(parts[: depth + 1])
                    sections = sorted(k for k, v in node.items() if isinstance(v, dict))
                    where = ".".join(parts[:depth]) or "the config"
                    valid = (f"valid sections of {where}: {sections}{did_you_mean(part, sections)}" if sections
                             else f"{where} has no sections; its keys: {sorted(node)}")
                    raise ValueError(f"override {item!r}: {prefix!r} is not a config section; {valid}")
                node = node[part]
            node[parts[-1]] = _parse_yaml(raw, f"override {item!r}") if raw.strip() else None
        return _build(CompilationConfig, data, "")

    def compute_hash(self) -> str:
        """Stable across processes; covers every field and the content of referenced rule/table files."""
        payload = self.to_dict()
        del payload["compile_cache"]  # where compile artifacts are kept is no input to a compile
        payload["_files"] = {p: _file_digest(p) for p in [*self.calibration, *self.rules]}
        blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _file_digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "missing"


def _load_text_or_path(text: str) -> Any:
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            return _parse_json(stripped, "config JSON string")
        except json.JSONDecodeError as exc:
            raise ValueError(f"config JSON string is invalid: {exc}") from exc
    path = Path(text)
    if path.suffix.lower() not in (".json", ".yaml", ".yml"):
        raise ValueError(f"config path {text!r} must end in .json, .yaml or .yml (or pass a JSON object string)")
    if not path.is_file():
        raise ValueError(f"config file {text!r} does not exist")
    data = load_data_file(path, "config file")
    if data is None:
        raise ValueError(f"config file {text!r} is empty; valid: a mapping of config keys (e.g. 'mode: compile'), "
                         f"or no --config for the defaults")
    return data


def load_data_file(path: str | os.PathLike[str], what: str) -> Any:
    """The content of a JSON (`.json`) or YAML (any other suffix) file a user wrote; a file that cannot be read
    or parsed, or that repeats a key within one mapping, is a one-line ValueError naming `what`, the file and,
    for a syntax error or a repeated key, its line and column. An empty YAML file is None: the caller says
    whether that is valid."""
    p = Path(path)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} {str(p)!r} cannot be read ({type(exc).__name__}: {exc})") from None
    if p.suffix.lower() == ".json":
        try:
            return _parse_json(text, f"{what} {str(p)!r}")
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} {str(p)!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                             f"{exc.msg})") from None
    return _parse_yaml(text, f"{what} {str(p)!r}")


def _parse_json(text: str, what: str) -> Any:
    """json.loads, refusing a key repeated within one object (json keeps the last one silently)."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise ValueError(f"{what} repeats the key {key!r} in one object; valid: each key once")
            out[key] = value
        return out

    return json.loads(text, object_pairs_hook=pairs)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key repeated within one mapping (safe_load keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, Hashable) and key in seen:
                mark = key_node.start_mark
                raise _RepeatedKey(f"line {mark.line + 1}, column {mark.column + 1}: the key {key!r} is repeated "
                                   f"in one mapping; valid: each key once")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _RepeatedKey(yaml.YAMLError):
    pass


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _UniqueKeyLoader.construct_mapping)


def _parse_yaml(text: str, what: str) -> Any:
    """The YAML document in `text` (safe types only, each key once per mapping); a one-line ValueError naming
    `what` otherwise."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: safe types only
    except _RepeatedKey as exc:
        raise ValueError(f"{what} is not valid ({exc})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"{what} is not valid YAML ({where}{problem})") from None


def did_you_mean(name: str, valid: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise ValueError(
                f"unknown config key {dotted!r}; valid keys: {sorted(fields)}{did_you_mean(key, fields)}"
            )
        if isinstance(value, str):
            value = fields[key].metadata.get("aliases", {}).get(value, value)
        kwargs[key] = _coerce(hints[key], value, dotted, fields[key].metadata.get("choices"))
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str, choices: tuple[str, ...] | None) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if len(args) > 1:  # e.g. bool | str: the first type that takes the value
            for arg in args:
                try:
                    return _coerce(arg, value, key, choices)
                except ValueError:
                    continue
            names = " or ".join(getattr(a, "__name__", str(a)) for a in args)
            raise ValueError(f"config key {key!r} must be {names} (or null), got {value!r}")
        tp, origin = args[0], typing.get_origin(args[0])
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"config key {key!r} must be a mapping, got {type(value).__name__}")
        return _build(tp, value, key + ".")
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"config key {key!r} must be a list of strings, got {value!r}")
        return list(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config key {key!r} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config key {key!r} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"config key {key!r} must be a number, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            valid = f"; valid choices: {list(choices)}" if choices is not None else ""
            raise ValueError(f"config key {key!r} must be a string, got {value!r}{valid}")
        if choices is not None and value not in choices:
            raise ValueError(
                f"config key {key!r} has invalid value {value!r}; valid choices: {list(choices)}"
                f"{did_you_mean(value, choices)}"
            )
        return value
    raise TypeError(f"config key {key!r} has an unsupported declared type {tp!r}")
