"""Saved traces (moefx/engine/compile_cache/aot.py): an entry per distinct call picked by its kept guards, loaded by a
new AotFunction without tracing, dynamic where sizes changed, the ordinary path where fullgraph tracing fails.

The functions here compile with a backend function around inductor, as the engine's counting backend is: torch 2.11
saves the output of such a backend only as moefx's `SavedGraph`, and offers `aot_compile` only under
`torch._dynamo.config.enable_aot_compile`, which moefx turns on for its own compiles alone. The engine-level checks
(a new process traces nothing and gives the same tokens, in both layer-call forms) are in
tests/test_compile_cache.py; these compile tiny functions with inductor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

from moefx.engine.compile_cache import aot

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(aot.why_no_aot() is not None, reason=f"{aot.why_no_aot()}")


@pytest.fixture(autouse=True)
def _first_failure_warns(monkeypatch):
    """Each test's first failed step warns afresh (a process says the first one in a warning, later ones in the log)."""
    monkeypatch.setattr(aot, "_SAID", False)


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


def _output(x: torch.Tensor) -> object:
    """A transformers ModelOutput, as the forward's fast path returns: dynamo rebuilds it (an OrderedDict) with the
    `collections` module, from a global it installs under a name of this process (this module does not import it)."""
    from transformers.modeling_outputs import CausalLMOutput

    return CausalLMOutput(logits=x * 2)


def _inductor(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """A backend function, as the engine's is (torch 2.11 saves its output only as moefx's SavedGraph)."""
    from torch._dynamo import lookup_backend

    return lookup_backend("inductor")(gm, example_inputs)


def _function(fallback=None, backend=_inductor) -> aot.AotFunction:
    return aot.AotFunction("affine", _affine, None, backend, fallback or _affine)


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
def test_the_flag_is_on_for_moefx_compiles_only_and_the_output_is_a_saved_graph():
    """torch 2.11's defaults on any torch: the flag off for the process; moefx turns it on around its own compiles."""
    if not aot._HAS_FLAG:
        pytest.skip("this torch has no torch._dynamo.config.enable_aot_compile")
    function = _function()
    x = torch.randn(3)
    with torch._dynamo.config.patch(enable_aot_compile=False):
        torch.testing.assert_close(function(x, True), x * 2 + 1)
        assert torch._dynamo.config.enable_aot_compile is False  # restored after the compile
        assert not hasattr(torch.compile(_affine, fullgraph=True), "aot_compile")
    assert function.broken is None and len(function.blobs()) == 1
    assert isinstance(function.entries[0].compiled._artifacts.compiled_fn, aot.SavedGraph)


def test_a_torch_without_the_flag_or_aot_compile_keeps_todays_path_and_says_why(monkeypatch):
    monkeypatch.setattr(aot, "_HAS_FLAG", False)
    aot.why_no_aot.cache_clear()
    try:
        with torch._dynamo.config.patch(enable_aot_compile=False):  # what `_aot_flag` cannot turn on without a flag
            why = aot.why_no_aot()
    finally:
        aot.why_no_aot.cache_clear()
    assert why is not None and "has no aot_compile" in why and "enable_aot_compile" in why


# One process saves a backend function's traces, a new one (its own empty inductor folder) loads them: the engine's
# case on torch 2.11, where torch itself wraps only its own inductor backend's output; and a function returning a
# ModelOutput, whose rebuild reads a module from a global of the saving process (`aot._modules_as_imports`).
NEW_PROCESS = r"""
import json, pickle, sys
import torch
from torch._dynamo.utils import counters
from moefx.engine.compile_cache.aot import AotFunction
from tests.test_aot_steps import _affine, _function, _output
calls = []
def counting(gm, example_inputs):
    from torch._dynamo import lookup_backend
    calls.append(1)
    return lookup_backend("inductor")(gm, example_inputs)
function = _function(backend=counting)
output = AotFunction("output", _output, None, counting, _output)
if sys.argv[1] == "save":
    for n in (4, 6):
        function(torch.arange(float(n)), True)
    function(torch.arange(4.0), False)
    output(torch.arange(4.0))
    open(sys.argv[2], "wb").write(pickle.dumps([function.blobs(), output.blobs()]))
else:
    function.pending, output.pending = pickle.loads(open(sys.argv[2], "rb").read())
out = [function(torch.arange(float(n)), shift).tolist() for n, shift in ((4, True), (9, True), (5, False))]
result = output(torch.arange(4.0))
out.append([type(result).__name__, result.logits.tolist()])
print(json.dumps({"out": out, "traced": counters["stats"]["unique_graphs"], "backend": len(calls),
                  "loaded": function.loaded + output.loaded, "broken": function.broken or output.broken}))
"""


@pytest.mark.compile
def test_a_new_process_loads_a_backend_functions_traces_and_traces_nothing(tmp_path):
    blobs = tmp_path / "blobs.pkl"
    runs = {}
    for step in ("save", "load"):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{step}")}
        proc = subprocess.run([sys.executable, "-c", NEW_PROCESS, step, str(blobs)], cwd=ROOT, env=env,
                              capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "saved trace" not in proc.stderr, proc.stderr[-3000:]  # no step fell back
        runs[step] = json.loads(proc.stdout.strip().splitlines()[-1])
    saved, loaded = runs["save"], runs["load"]
    assert saved["broken"] is None and saved["traced"] == 4 and saved["backend"] == 4, saved
    assert loaded["traced"] == 0 and loaded["backend"] == 0 and loaded["loaded"] == 4, loaded
    assert loaded["out"] == saved["out"] and loaded["out"][-1] == ["CausalLMOutput", [0.0, 2.0, 4.0, 6.0]]


@pytest.mark.compile
def test_an_entry_that_does_not_load_is_traced_again_with_one_warning():
    first = _function()
    x = torch.randn(5)
    first(x, True)
    second = _function()
    second.pending = [b"not a trace", b"nor this"] + first.blobs()
    before = _traced()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.testing.assert_close(second(x, True), x * 2 + 1)
    assert second.loaded == 1 and _traced() == before
    assert second.changes == 2  # the file is out of date: the next save drops the bad entries
    said = [str(w.message) for w in caught if "saved trace" in str(w.message)]
    assert len(said) == 1 and "does not load" in said[0], said  # one line for both


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
