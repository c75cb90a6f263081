"""The one place the planner reads the environment: `MOEFX_PASSES` (a row of moefx/env.py's table).

`MOEFX_PASSES="fuse_act_quant=on,last_token_logits=off"` sits between the user's config and the plan's
preferred defaults. Names and values are validated; a bad entry is a ValueError, never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping

from moefx.env import ON_OFF_WORDS, ON_WORDS, get_setting
from moefx.planner.rules import pass_toggles

PASSES_ENV = "MOEFX_PASSES"


def pass_overrides(environ: Mapping[str, str] | None = None) -> dict[str, bool]:
    """Parsed MOEFX_PASSES (pass name -> on/off); empty when unset."""
    raw = get_setting(PASSES_ENV, environ)
    valid = pass_toggles()
    out: dict[str, bool] = {}
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        name, sep, value = (x.strip() for x in item.partition("="))
        if not sep or name not in valid:
            raise ValueError(
                f"{PASSES_ENV} entry {item!r} must be NAME=on|off with NAME one of {list(valid)}"
            )
        if value.lower() not in ON_OFF_WORDS:
            raise ValueError(f"{PASSES_ENV} entry {item!r}: value {value!r} is invalid; valid: {list(ON_OFF_WORDS)}")
        if name in out:
            raise ValueError(f"{PASSES_ENV} sets {name!r} twice")
        out[name] = value.lower() in ON_WORDS
    return out
