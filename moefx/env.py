"""The one declarative table of moefx's environment knobs: every `MOEFX_*` variable moefx reads, its parser,
default, meaning and aliases (names it is also read under), and the one list of on/off words. Every reader goes
through `get_setting`.

`get_setting(name)` reads the environment every call (so tests and launchers can change it), maps an
alias to its canonical name with a one-time warning, and raises `ValueError` naming the variable
for a bad value. Canonical and alias both set to different values is an error, never a silent choice.

`settings()` (`moefx.offload.settings()`) resolves the rows of docs/OFFLOAD.md's knob table (offload, the MoE and dense
backends, the decode engine's memory budget); the plan validates them all at once. The other rows are read where
they are used: logging, graph dumps, the compile cache's folder, the vLLM config, pass switches and the on/off
gemv switch.

Importing this module imports neither torch nor another moefx package but `moefx.config` (the CLI checks
`MOEFX_LOG` before anything heavy loads).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moefx.config import (
    DEFAULT_MEMORY_BUDGET,
    DENSE_BACKENDS,
    MOE_BACKEND_ALIASES,
    MOE_BACKENDS,
    OFFLOAD_DEVICES,
    parse_memory_budget,
)

ON_WORDS = ("1", "true", "on", "yes")
OFF_WORDS = ("0", "false", "off", "no")
ON_OFF_WORDS = ON_WORDS + OFF_WORDS
LOG_LEVELS = ("debug", "info", "warning", "error")


class NotOneOf(ValueError):
    """A value outside a list of valid ones: "... is invalid; valid values: [...]", the project's wording for a
    choice (a description of what is expected follows a colon instead)."""


def parse_on_off(raw: str) -> bool:
    """True for an on word, False for an off word (any case); a ValueError listing both otherwise."""
    low = raw.strip().lower()
    if low in ON_WORDS:
        return True
    if low in OFF_WORDS:
        return False
    raise ValueError(f"expected one of {list(ON_OFF_WORDS)}")


def _int_parser(minimum: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(f"expected an integer >= {minimum}") from None
        if value < minimum:
            raise ValueError(f"expected an integer >= {minimum}")
        return value

    return parse


def _choice_parser(
    choices: tuple[str, ...], synonyms: Mapping[str, str] | None = None, noun: str = "choices"
) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        low = raw.strip().lower()
        low = (synonyms or {}).get(low, low)
        if low not in choices:
            raise NotOneOf(f"valid {noun}: {list(choices)}")
        return low

    return parse


def _cache_folder(raw: str) -> bool | str:
    """On/off words, or a folder path (it contains '/' or starts with '.' or '~')."""
    text = raw.strip()
    low = text.lower()
    if low in ON_OFF_WORDS:
        return low in ON_WORDS
    if "/" in text or text.startswith((".", "~")):
        return text
    raise NotOneOf(f"valid values: {list(ON_OFF_WORDS)} or a folder path (containing '/')")


@dataclass(frozen=True)
class EnvSetting:
    """One knob: canonical name, parser (its type), default (None = decided elsewhere, see `meaning`), aliases;
    `in_settings`: one of the values `settings()` resolves (docs/OFFLOAD.md, "Environment knobs")."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    meaning: str
    aliases: tuple[str, ...] = field(default=())
    in_settings: bool = True


TABLE: tuple[EnvSetting, ...] = (
    EnvSetting(
        "MOEFX_OFFLOAD_EXPERTS",
        _choice_parser(OFFLOAD_DEVICES, {"cuda": "gpu"}),
        "gpu",
        "where expert weights live: gpu | cpu | auto (the plan decides from model size and free GPU memory)",
        ("VLLM_EXPERTS_LOAD_DEVICE",),
    ),
    EnvSetting(
        "MOEFX_OFFLOAD_INT8",
        parse_on_off,
        None,
        "INT8 activation path for CPU experts on/off; unset = from the weight format (on for int8 weights)",
        ("XIAOTU_MOE_INT8", "XIAOTU_MOE_W4A8"),
    ),
    EnvSetting(
        "MOEFX_OFFLOAD_INT8_ALIGN",
        parse_on_off,
        True,
        "ALIGN tile implementation: pad token rows to the int8 GEMM's alignment so every M takes the int8 kernel",
        ("XIAOTU_MOE_INT8_ALIGN",),
    ),
    EnvSetting(
        "MOEFX_OFFLOAD_INT8_VNNI",
        parse_on_off,
        False,
        "older VNNI tile implementation: one int8 GEMM per expert and projection instead of the ALIGN tiles",
        ("XIAOTU_MOE_INT8_VNNI",),
    ),
    EnvSetting(
        "MOEFX_OFFLOAD_INT8_VNNI_MIN_TOKENS",
        _int_parser(1),
        160,
        "token rows (M) from which the INT8 activation path is used when MOEFX_OFFLOAD_INT8 is on",
        ("XIAOTU_MOE_INT8_VNNI_MIN_TOKENS", "XIAOTU_MOE_I8_MIN_M"),
    ),
    EnvSetting(
        "MOEFX_OFFLOAD_STAGE_TILE_E",
        _int_parser(1),
        96,
        "experts per tile of the GPU prefill staging ring (two tiles, ping-pong)",
        ("XIAOTU_GPF_STAGE_TILE_E",),
    ),
    EnvSetting(
        "MOEFX_OFFLOAD_GPU_PREFILL_MIN_TOKENS",
        _int_parser(0),
        None,
        "token rows from which experts are streamed to the GPU instead of computed on the CPU; "
        "0 = never stream; unset = from the cost model",
        ("VLLM_XIAOTU_GPU_PREFILL_MIN_TOKENS",),
    ),
    EnvSetting(
        "MOEFX_MOE_BACKEND",
        _choice_parser(MOE_BACKENDS, MOE_BACKEND_ALIASES),
        "auto",
        "force one MoE backend for every call (safety checks still apply); `legacy` is read as `reference`",
    ),
    EnvSetting(
        "MOEFX_DENSE_BACKEND",
        _choice_parser(DENSE_BACKENDS),
        "auto",
        "force the backend of every moefx::dense_linear call: upstream (torch linear) or gemv (safety checks apply)",
    ),
    EnvSetting(
        "MOEFX_MEMORY_BUDGET",
        parse_memory_budget,
        None,
        "memory the decode engine's slots (static caches, CUDA-graph pools) share: a fraction of free device memory "
        "(0.6) or bytes (40GiB); config key memory_budget wins over it; "
        f"unset = {DEFAULT_MEMORY_BUDGET}",
    ),
    EnvSetting(
        "MOEFX_USE_GEMV",
        parse_on_off,
        None,
        "on/off switch of the gemv MoE backend (an older spelling of MOEFX_MOE_BACKEND=gemv): on forces gemv for "
        "every call, off sends gemv's M ranges upstream; it must agree with MOEFX_MOE_BACKEND",
        in_settings=False,
    ),
    EnvSetting(
        "MOEFX_PASSES",
        str,
        "",
        "pass switches between the user's config and the plan's defaults, NAME=on|off separated by commas "
        "(moefx/planner/pass_overrides.py checks the names against the pass toggles)",
        in_settings=False,
    ),
    EnvSetting(
        "MOEFX_LOG",
        _choice_parser(LOG_LEVELS, noun="values"),
        "warning",
        "log level of the moefx loggers; warning or error also silences the progress lines (moefx/log.py)",
        in_settings=False,
    ),
    EnvSetting(
        "MOEFX_COMPILE_CACHE",
        _cache_folder,
        True,
        "the decode engine's persistent compile artifacts: on/off words or a folder; config key compile_cache "
        "wins over it; on = <moefx cache folder>/compile",
        in_settings=False,
    ),
    EnvSetting(
        "MOEFX_DUMP_GRAPHS",
        str,
        None,
        "folder the pass manager writes each graph into, before and after the moefx passes; config key "
        "pass_config.dump_graph_dir wins over it; unset = no dumps",
        in_settings=False,
    ),
    EnvSetting(
        "MOEFX_CONFIG",
        str.strip,
        None,
        "the moefx config of a vLLM process (JSON or YAML text, or a file); unset = defaults",
        in_settings=False,
    ),
)
SETTINGS: tuple[EnvSetting, ...] = tuple(s for s in TABLE if s.in_settings)

_BY_NAME: dict[str, EnvSetting] = {s.name: s for s in TABLE}
_VARS: dict[str, tuple[str, ...]] = {s.name: (s.name, *s.aliases) for s in TABLE}


def _lookup(name: str) -> EnvSetting:
    if name not in _BY_NAME:
        raise ValueError(f"unknown moefx env setting {name!r}; valid names: {sorted(_BY_NAME)}")
    return _BY_NAME[name]


def _parse(var: str, raw: str, setting: EnvSetting) -> Any:
    try:
        return setting.parse(raw)
    except ValueError as exc:
        sep = "; " if isinstance(exc, NotOneOf) else ": "
        raise ValueError(f"environment variable {var}={raw!r} is invalid{sep}{exc}") from None


_aliases_warned: set[str] = set()


def _warn_alias(alias: str, name: str) -> None:
    """The one-time warning for an alias, here rather than through `moefx.log.warn_once`: moefx.log reads
    MOEFX_LOG from this table, so this module stays below it (and free of torch)."""
    if alias not in _aliases_warned:
        _aliases_warned.add(alias)
        warnings.warn(f"environment variable {alias} is an alias of {name}; use {name} (value kept)", UserWarning,
                      stacklevel=4)


def get_setting(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """Resolved value of canonical setting `name` (env > alias > table default)."""
    setting = _lookup(name)
    env = os.environ if environ is None else environ
    found: list[tuple[str, Any]] = []
    if env.get(setting.name, "").strip():
        found.append((setting.name, _parse(setting.name, env[setting.name], setting)))
    for alias in setting.aliases:
        if env.get(alias, "").strip():
            found.append((alias, _parse(alias, env[alias], setting)))
            _warn_alias(alias, setting.name)
    if not found:
        return setting.default
    values = {value for _, value in found}
    if len(values) > 1:
        pairs = ", ".join(f"{var}={env[var]!r}" for var, _ in found)
        raise ValueError(f"conflicting values for {setting.name}: {pairs}; set only {setting.name}")
    return found[0][1]


def setting_raw(name: str) -> tuple[str | None, ...]:
    """The raw environment values of setting `name` and its aliases: part of a memo key for anything decided from
    the setting (moefx/kernels/memo.py), so a changed value gives a new key without parsing it on every call."""
    found = _VARS.get(name)
    if found is None:
        _lookup(name)  # raises, naming the valid settings
    return tuple(os.environ.get(var) for var in found)


def setting_source(name: str, environ: Mapping[str, str] | None = None) -> str:
    """Which variable set `name` ("env NAME"), or "default"; for explain() lines."""
    setting = _lookup(name)
    env = os.environ if environ is None else environ
    for var in (setting.name, *setting.aliases):
        if env.get(var, "").strip():
            return f"env {var}"
    return "default"


def settings(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every canonical name of docs/OFFLOAD.md's knob table -> its resolved value (`moefx.offload.settings()`)."""
    return {s.name: get_setting(s.name, environ) for s in SETTINGS}
