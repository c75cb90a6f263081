"""Saved traces (moefx/engine/compile_cache/aot.py): an entry per distinct call picked by its kept guards, loaded by a
new AotFunction without tracing, dynamic where sizes changed, the ordinary path where fullgraph tracing fails.

The engine-level checks (a new process traces nothing and gives the same tokens, in both layer-call forms) are in
tests/test_compile_cache.py; these compile tiny functions with inductor.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

from moefx.engine.compile_cache import aot

pytestmark = pytest.mark.skipif(aot.why_no_aot() is not None, reason=f"{aot.why_no_aot()}")


def _guard(kind: str, name: str, is_global: bool = False) -> SimpleNamespace:
    return SimpleNamespace(guard_type=kind, name=name, is_global=is_global)


def test_kept_guards_are_the_calls_own_values():
    assert aot._keep(_guard("TENSOR_MATCH", "cache.layers[0].keys"), "self")
    assert aot._keep(_guard("CONSTANT_MATCH", "by_head"), "self")
    assert aot._keep(_guard("SHAPE_ENV", ""), None)
    assert not aot._keep(_guard("ID_MATCH", "layer"), None)  # identity: fixed by the file's engine identity
    assert not aot._keep(_guard("DICT_VERSION", "kwargs"), None)
    assert not aot._keep(_guard("CONSTANT_MATCH", "self._cache_arg"), "self")  # the engine's own attributes
    assert not aot._keep(_guard("CONSTANT_MATCH", "loop[0]"), "loop")
    assert aot._keep(_guard("CONSTANT_MATCH", "looped"), "loop")
    assert not aot._keep(_guard("CONSTANT_MATCH", "fn.__closure__[0].cell_contents"), None)
    assert not aot._keep(_guard("TENSOR_MATCH", "G['x']", is_global=True), None)


def _affine(x: torch.Tensor, shift: bool) -> torch.Tensor:
    return x * 2 + 1 if shift else x - 1


def _traced() -> int:
    return int(counters["stats"]["unique_graphs"])


def _function(fallback=None) -> aot.AotFunction:
    return aot.AotFunction("affine", _affine, None, "inductor", fallback or _affine)


@pytest.mark.compile
def test_entries_by_guards_saved_and_loaded_without_tracing():
    first = _function()
    x = torch.randn(4)
    torch.testing.assert_close(first(x, True), x * 2 + 1)
    torch.testing.assert_close(first(x + 1, True), (x + 1) * 2 + 1)  # the same guards: the same entry
    assert len(first.entries) == 1
    traced = _traced()
    y = torch.randn(6)  # a new size: traced once more, dynamic in that dimension
    torch.testing.assert_close(first(y, True), y * 2 + 1)
    assert first(torch.randn(7), True).shape == (7,)
    assert _traced() == traced + 1 and len(first.entries) == 2
    torch.testing.assert_close(first(x, False), x - 1)  # the constant's guard: an entry of its own
    assert len(first.entries) == 3

    second = _function()
    second.pending = first.blobs()
    before = _traced()
    for value, shift in ((x, True), (torch.randn(11), True), (x + 3, False)):
        torch.testing.assert_close(second(value, shift), _affine(value, shift))
    assert _traced() == before and second.loaded == 3  # nothing traced: each call took a loaded entry
    torch.testing.assert_close(second(x.double(), True), x.double() * 2 + 1)  # a dtype no entry guards
    assert _traced() == before + 1 and len(second.entries) == 4


@pytest.mark.compile
def test_an_entry_that_does_not_load_is_traced_again_with_a_warning(caplog):
    first = _function()
    x = torch.randn(5)
    first(x, True)
    second = _function()
    second.pending = [b"not a trace"] + first.blobs()
    before = _traced()
    torch.testing.assert_close(second(x, True), x * 2 + 1)
    assert second.loaded == 1 and _traced() == before
    assert second.changes == 1  # the file is out of date: the next save drops the bad entry
    assert any("does not load" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def _breaks(x: torch.Tensor, shift: bool) -> torch.Tensor:
    y = x + 1
    torch._dynamo.graph_break()
    return y * 2


def test_a_call_fullgraph_cannot_take_runs_the_ordinary_path_and_says_so():
    calls = []

    def fallback(*args):
        calls.append(args)
        return _breaks(*args)

    function = aot.AotFunction("breaks", _breaks, None, "inductor", fallback)
    x = torch.randn(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(function(x, True), (x + 1) * 2)
    assert function.broken and len(calls) == 1 and not function.entries
    assert any("compiled without a saved trace" in str(w.message) for w in caught)
    function(x, True)
    assert len(calls) == 2  # no second attempt
