"""`moefx.audit_syncs(fn, *args)`: every host sync and graph break in a decode step, with its source line.

Three views of the same function:
1. Graph breaks under plain `torch.compile` (dynamo's explain): `.item()`, data-dependent shapes and
   Python control flow on tensor values each split the graph; they are listed with file:line.
2. The post-grad graph compiled the way moefx compiles sampling code (scalar outputs and dynamic-shape
   ops captured, `rewrite_sampler_syncs` on): each sync op before moefx's passes, whether it is still
   there after them, and the pass's reason when it is.
3. On CUDA, the eager and the compiled function run under `torch.cuda.set_sync_debug_mode("warn")`:
   the syncs that really happen, with the Python line that triggered each.
"""

from __future__ import annotations

import copy
import sys
import types
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from moefx.config import CompilationConfig
from moefx.passes.fx import meta_val, source_of, user_frame

aten = torch.ops.aten

# Post-grad ops that read device data on the host (or whose output shape depends on device data).
SYNC_OPS = {
    aten._local_scalar_dense.default: ".item()",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.multinomial.default: "multinomial (input check reads back)",
    aten.is_nonzero.default: "bool(tensor)",
    aten.equal.default: "torch.equal",
    aten.repeat_interleave.Tensor: "repeat_interleave(tensor repeats)",
    aten._unique2.default: "unique",
}
_BOOL_INDEX = {aten.index.Tensor: "boolean-mask indexing", aten.index_put.default: "boolean-mask assignment"}


@dataclass
class Finding:
    kind: str  # "graph break" | "sync op" | "runtime sync"
    where: str  # `"file", line N (code)` of the user source (`_where`)
    what: str
    removed: bool
    why: str  # how moefx removes it, or why it does not


@dataclass
class AuditReport:
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def count(self, kind: str, removed: bool | None = None) -> int:
        return sum(1 for f in self.findings if f.kind == kind and (removed is None or f.removed == removed))

    def to_dict(self) -> dict[str, Any]:
        return {"findings": [asdict(f) for f in self.findings], "notes": list(self.notes)}

    def format(self) -> str:
        """One block per finding: what and where, then whether moefx removes it and how (or why not)."""
        lines = []
        for f in self.findings:
            verdict = "removed by moefx" if f.removed else "kept"
            lines.append(f"[{f.kind}] {f.what}\n    at {f.where}\n    {verdict}: {f.why}")
        lines.append(
            f"{self.count('graph break')} graph break(s), {self.count('sync op')} sync op(s) "
            f"({self.count('sync op', removed=True)} removed by moefx)"
        )
        return "\n".join([*lines, *self.notes])


def _where(path: str, line: int, code: str | None = None) -> str:
    """A finding's place, `"file", line N (code)` as Python's tracebacks write it, whether it came from dynamo, a
    sync warning or a graph node (the runtime syncs are matched to the graph's findings by this text)."""
    return f'"{path}", line {line}' + (f" ({code.strip()})" if code and code.strip() else "")


def _node_where(node: torch.fx.Node) -> str:
    frame = user_frame(node)
    return _where(frame.path, frame.line, frame.code) if frame is not None else f"node {node.name}"


def _sync_nodes(graph: torch.fx.Graph) -> list[tuple[str, str, str]]:
    """(what, where, the pass reports' `source_of`) of each sync op in `graph`."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in SYNC_OPS:
            found.append((SYNC_OPS[node.target], _node_where(node), source_of(node)))
        elif node.target in _BOOL_INDEX:
            indices = node.args[1] if len(node.args) > 1 else []
            vals = [meta_val(i) for i in indices if i is not None]
            if any(v is not None and v.dtype in (torch.bool, torch.uint8) for v in vals):
                found.append((_BOOL_INDEX[node.target], _node_where(node), source_of(node)))
    return found


class _Recorder(CustomGraphPass):
    """Runs moefx's pass manager and records the sync ops before and after it."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        # (what, where, source_of) per sync op, see `_sync_nodes`
        self.before: list[tuple[str, str, str]] = []
        self.after: list[tuple[str, str, str]] = []
        self.skipped: list[str] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.before += _sync_nodes(graph)
        from moefx.reports import compile_reports

        start = len(compile_reports())
        self.manager(graph)
        for report in compile_reports()[start:]:
            self.skipped += report.skipped.get("rewrite_sampler_syncs", [])
        self.after += _sync_nodes(graph)

    def uuid(self) -> None:
        return None  # never served from the cache: the audit must see the graph


def _graph_breaks(fn: Callable[..., Any], args: tuple, kwargs: dict, capture: bool) -> list[tuple[str, str]]:
    torch._dynamo.reset()
    flags = {"capture_scalar_outputs": capture, "capture_dynamic_output_shape_ops": capture}
    with torch._dynamo.config.patch(flags), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch._dynamo.explain(fn)(*copy.deepcopy(args), **kwargs)
    breaks = []
    for br in out.break_reasons:
        frame = br.user_stack[-1] if br.user_stack else None
        where = _where(frame.filename, frame.lineno, frame.line) if frame else "unknown"
        breaks.append((str(br.reason).strip().splitlines()[0], where))
    torch._dynamo.reset()
    return breaks


# Top-level modules a sync warning passes through that are not the code being audited (this module is skipped too).
_NOT_USER = ("torch", "warnings", "_py_warnings")


def _user_line(frame: types.FrameType | None, stop: types.FrameType) -> str | None:
    """`"file", line N` of the innermost frame under `stop` outside torch, the warnings module and this one; ""
    when every frame under `stop` is one of those; None when `stop` is not on the stack (another thread warned).

    A sync warning names the innermost Python frame running when the device was read, which is inside torch
    when the sync came through one of its Python functions (torch.unique, a torch.cuda helper); the line to
    report is the caller's."""
    found = ""
    while frame is not None:
        if frame is stop:
            return found
        module = str(frame.f_globals.get("__name__", ""))
        if not found and module.split(".", 1)[0] not in _NOT_USER and module != __name__:
            found = _where(frame.f_code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return None


def _record_sync_warnings(call: Callable[[], Any]) -> list[str]:
    """Run `call()` and return where each sync warning it raised came from, attributed by `_user_line` (sync
    warnings of other threads, which the process-wide debug mode also raises, are not the call's)."""
    stop = sys._getframe()
    found: list[str] = []

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" in str(message):
            where = _user_line(sys._getframe(1), stop)
            if where is not None:
                found.append(where or _where(filename, lineno))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        call()
    return found


def _runtime_syncs(fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[str]:
    def call() -> None:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    found = _record_sync_warnings(call)
    torch.cuda.current_stream().synchronize()  # after: this wait is the audit's, not the function's
    return found


def _same_line(where: str, line: str) -> bool:
    """Whether a finding's `where` (`"file", line N` then ` (code)` or `, in fn`) names `line` exactly (not line N0)."""
    return where.startswith(line) and where[len(line):len(line) + 1] in ("", " ", ",")


def _why_kept(source: str, what: str, skipped: list[str]) -> str:
    """The reason `rewrite_sampler_syncs` gave for keeping the sync op it names at `source`."""
    for line in skipped:
        if source in line:
            return line.split(" kept: ", 1)[-1]
    return f"no exact sync-free form for {what} here"


def audit_syncs(fn: Callable[..., Any], *args: Any, config: Any = None, **kwargs: Any) -> AuditReport:
    """Audit `fn(*args, **kwargs)` (a decode step and/or sampler). `config` as for `moefx.backend`;
    by default `rewrite_sampler_syncs` and `sampler_exponential_race` are on."""
    from moefx.compile import backend as moefx_backend

    cfg = CompilationConfig.from_any(config or {})
    if config is None:
        cfg.pass_config.rewrite_sampler_syncs = True
        cfg.pass_config.sampler_exponential_race = True
    report = AuditReport()

    plain = _graph_breaks(fn, args, kwargs, capture=False)
    captured = {where for _, where in _graph_breaks(fn, args, kwargs, capture=True)}
    for reason, where in plain:
        fixed = where not in captured
        if fixed:
            why = "captured with capture_scalar_outputs / capture_dynamic_output_shape_ops (see the sync ops)"
        elif "jump" in reason or "bool" in reason.lower():
            why = (
                "a Python branch on a tensor value needs the host, so no graph rewrite removes it; move the "
                "check out of the step (moefx's deferred stop check does this for generate() on CUDA)"
            )
        else:
            why = f"remains a graph break: {reason}"
        report.findings.append(Finding("graph break", where, reason, fixed, why))

    backend = moefx_backend(cfg)
    recorder = _Recorder(backend.pass_manager)
    torch._dynamo.reset()
    flags = {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": True}

    on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)

    def compiler(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        from moefx.compile import post_grad_only

        # Off CUDA nothing is run for its syncs: the post-grad graphs are all the audit reads, so no codegen.
        return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": recorder},
                          inner_compile=compile_fx_inner if on_cuda else post_grad_only)

    compiled = torch.compile(fn, backend=compiler)
    with torch._dynamo.config.patch(flags), torch._inductor.config.patch(fx_graph_cache=False):
        compiled(*copy.deepcopy(args), **kwargs)
        remaining = list(recorder.after)
        for what, where, source in recorder.before:
            if (what, where, source) in remaining:
                remaining.remove((what, where, source))
                why = _why_kept(source, what, recorder.skipped)
                report.findings.append(Finding("sync op", where, what, False, why))
            else:
                report.findings.append(Finding("sync op", where, what, True, "rewritten by rewrite_sampler_syncs"))
        if on_cuda:
            eager = _runtime_syncs(fn, copy.deepcopy(args), kwargs)
            after = _runtime_syncs(compiled, copy.deepcopy(args), kwargs)
            for where in eager:
                static = [f for f in report.findings if _same_line(f.where, where)]
                gone = bool(static) and all(f.removed for f in static)
                why = static[0].why if static else "not seen by the compiler (outside the traced code)"
                report.findings.append(Finding("runtime sync", where, "device->host sync", gone, why))
            report.notes.append(f"runtime: {len(eager)} sync(s) eager, {len(after)} compiled with moefx")
        else:
            report.notes.append("runtime sync detection needs CUDA tensors (torch.cuda.set_sync_debug_mode)")
    torch._dynamo.reset()
    return report
