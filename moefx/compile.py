"""`moefx.backend(cfg)`: inductor with the moefx passes installed as its post-grad custom pass."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from moefx.config import CompilationConfig
from moefx.facts import ExecutionSignature, ModelSignature
from moefx.passes import PassManager
from moefx.planner import Plan, resolve


def with_exact_floats(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """`compiled` tracing float attributes and globals as constants: model code keeps eps, the FP8 max and minimum
    scales there, and as runtime values they could not be matched by the fusions, which reproduce them exactly."""
    return torch._dynamo.config.patch(specialize_float=True)(compiled)


def backend(config: Any = None, plan: Plan | None = None, cudagraphs: bool | None = None) -> Callable[..., Any]:
    """A `torch.compile` backend. Without a plan, one is resolved for an unknown model on this machine,
    so only what the user's config asks for (and the machine supports) runs. In mode capture on CUDA,
    inductor wraps each graph in CUDA graphs unless `cudagraphs=False` (for callers that capture
    themselves, like moefx's decode engine)."""
    cfg = CompilationConfig.from_any(config)
    if plan is None:
        es = ExecutionSignature.detect(mode=cfg.mode, max_batch_size=cfg.max_batch_size)
        plan = resolve(ModelSignature.unknown(), es, cfg)
    manager = PassManager(cfg, plan.enabled_passes(), plan)
    patches: dict[str, Any] = {"post_grad_custom_post_pass": manager}
    if cudagraphs is None:
        cudagraphs = cfg.mode == "capture" and plan.execution.device_type == "cuda"
    if cudagraphs:
        patches["triton.cudagraphs"] = True

    def moefx_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=patches)

    moefx_backend.pass_manager = manager  # type: ignore[attr-defined]
    moefx_backend.plan = plan  # type: ignore[attr-defined]
    moefx_backend.cudagraphs = cudagraphs  # type: ignore[attr-defined]
    return moefx_backend


def post_grad_only(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
    """An inductor `inner_compile` that runs inductor's post-grad passes (moefx's among them, which write their
    compile reports) and then the graph as the PyTorch ops it holds, with no code generation. For looking at
    what the passes did without paying for a C++/Triton compile: `compile_fx(gm, inputs, inner_compile=...)`."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import _recursive_post_grad_passes

    _recursive_post_grad_passes(gm, is_inference=bool(kwargs.get("is_inference")))
    _drop_unused_items_of_void_ops(gm)
    gm.recompile()
    return make_boxed_func(gm.forward)


def _drop_unused_items_of_void_ops(gm: torch.fx.GraphModule) -> None:
    """Inductor's reinplacing turns `_foreach_add` + copies into `_foreach_add_` and keeps unused `getitem`s of its
    result, which its lowering ignores but which fail when run as PyTorch ops (the in-place foreach returns None)."""
    for node in list(gm.graph.nodes):
        if (node.op == "call_function" and node.target is operator.getitem and not node.users
                and isinstance(node.args[0], torch.fx.Node)
                and str(getattr(node.args[0].target, "_schema", "")).endswith("-> ()")):
            gm.graph.erase_node(node)
