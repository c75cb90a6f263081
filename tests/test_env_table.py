"""moefx/env.py is the one table of moefx's environment knobs: every MOEFX_* name in moefx's source is a row, and
only the table reads the environment for one; each row parses through it with the one on/off word list."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import moefx
from moefx.env import ON_OFF_WORDS, TABLE, get_setting, parse_on_off
from moefx.offload import SETTINGS

ROOT = Path(moefx.__file__).parent
NAMES = {s.name for s in TABLE}


def _sources() -> dict[Path, str]:
    return {path: path.read_text() for path in ROOT.rglob("*.py")}


def test_every_moefx_variable_is_a_row() -> None:
    named = {m for text in _sources().values() for m in re.findall(r"\bMOEFX_[A-Z0-9_]*[A-Z0-9]\b", text)}
    assert named <= NAMES, f"not in moefx/env.py's table: {sorted(named - NAMES)}"


def test_only_the_table_reads_a_moefx_variable() -> None:
    read = re.compile(r"(environ\.get\(|environ\[|getenv\()\s*[\"']MOEFX_")
    readers = [str(path.relative_to(ROOT)) for path, text in _sources().items() if read.search(text)]
    assert readers == [], f"read outside moefx/env.py: {readers}"


def test_settings_are_the_rows_marked_so() -> None:
    assert SETTINGS == tuple(s for s in TABLE if s.in_settings)
    assert len(NAMES) == len(TABLE)


@pytest.mark.parametrize("word", ON_OFF_WORDS)
def test_on_off_words(word: str) -> None:
    assert parse_on_off(word.upper()) is (word in ("1", "true", "on", "yes"))


@pytest.mark.parametrize(
    "name,raw,value",
    [("MOEFX_USE_GEMV", "yes", True), ("MOEFX_LOG", "INFO", "info"), ("MOEFX_COMPILE_CACHE", "off", False),
     ("MOEFX_COMPILE_CACHE", "~/cc", "~/cc"), ("MOEFX_DUMP_GRAPHS", "/tmp/g", "/tmp/g"),
     ("MOEFX_PASSES", "last_token_logits=off", "last_token_logits=off")],
)
def test_process_rows_parse(name: str, raw: str, value: object) -> None:
    assert get_setting(name, {name: raw}) == value
    assert get_setting(name, {}) == next(s.default for s in TABLE if s.name == name)


@pytest.mark.parametrize(
    "name,raw,message",
    [("MOEFX_USE_GEMV", "maybe", "MOEFX_USE_GEMV='maybe' is invalid: expected one of"),
     ("MOEFX_LOG", "loud", "MOEFX_LOG='loud' is invalid; valid values: "),
     ("MOEFX_COMPILE_CACHE", "sometimes", "MOEFX_COMPILE_CACHE='sometimes' is invalid; valid values: ")],
)
def test_bad_values_name_the_variable_and_the_valid_values(name: str, raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        get_setting(name, {name: raw})
