"""The one place the signature registry reads the environment: `MOEFX_PASSES`.

`MOEFX_PASSES="fuse_act_quant=on,last_token_logits=off"` sits between the user's config and the plan's
preferred defaults. Names and values are validated; a bad entry is a ValueError, never ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

PASSES_ENV = "MOEFX_PASSES"
_ON = ("on", "true", "1", "yes")
_OFF = ("off", "false", "0", "no")


def pass_overrides(environ: Mapping[str, str] | None = None) -> dict[str, bool]:
    """Parsed MOEFX_PASSES (pass name -> on/off); empty when unset."""
    from moefx.signatures.rules import pass_toggles

    raw = (os.environ if environ is None else environ).get(PASSES_ENV, "")
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
        if value.lower() not in _ON + _OFF:
            raise ValueError(f"{PASSES_ENV} entry {item!r}: value {value!r} is invalid; valid: {list(_ON + _OFF)}")
        if name in out:
            raise ValueError(f"{PASSES_ENV} sets {name!r} twice")
        out[name] = value.lower() in _ON
    return out
