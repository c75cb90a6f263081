"""vLLM integration without a fork: a `vllm.general_plugins` entry point and a pass manager for vLLM's hook.

- `register()` runs in every vLLM process (entry point `moefx = moefx.integrations.vllm:register`). It
  validates `MOEFX_CONFIG` (a JSON string or a .json/.yaml path, same keys as `CompilationConfig`) and
  registers moefx's fused-MoE method out of tree. That method runs a moefx backend only where the
  calibrated policy names one for the layer's exact shape on this device; everywhere else it is vLLM's
  own method unchanged (fail closed).
- `pass_manager(cfg)` returns a vLLM `InductorPass` to put in
  `compilation_config={"inductor_compile_config": {"post_grad_custom_post_pass": pass_manager(cfg)}}`;
  its `uuid()` is moefx's (config hash + pass sources), so vLLM's compile cache keys it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moefx.config import CompilationConfig
from moefx.env import get_setting
from moefx.facts import ExecutionSignature, ModelSignature
from moefx.log import get_logger, warn_once
from moefx.passes import PassManager
from moefx.planner import resolve

log = get_logger("moefx.vllm")
CONFIG_ENV = "MOEFX_CONFIG"
_registered = False


def load_config() -> CompilationConfig:
    """The moefx config of this vLLM process, from `MOEFX_CONFIG` (defaults when unset)."""
    raw = get_setting(CONFIG_ENV)
    if not raw:
        return CompilationConfig()
    try:
        return CompilationConfig.from_any(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {CONFIG_ENV}: {exc}") from exc


def _inductor_pass_base() -> type:
    try:
        from vllm.compilation.passes.inductor_pass import InductorPass
    except ImportError:  # vLLM before the passes/ reorganisation
        from vllm.compilation.inductor_pass import InductorPass
    return InductorPass


def _current_model_signature() -> ModelSignature:
    try:
        from vllm.config import get_current_vllm_config

        model_config = get_current_vllm_config().model_config
    except Exception:  # no vLLM config is being built in this process
        return ModelSignature.unknown()
    return ModelSignature.from_config(model_config) if model_config is not None else ModelSignature.unknown()


def _parallel_sizes() -> tuple[int | None, int | None]:
    """(tp, ep) from the vLLM config being built: dense layers split over tensor_parallel_size; with
    enable_expert_parallel, whole experts placed over tp x dp ranks (vLLM's FusedMoEParallelConfig)."""
    try:
        from vllm.config import get_current_vllm_config

        pc = get_current_vllm_config().parallel_config
    except Exception:  # no vLLM config is being built in this process
        return None, None
    tp = int(pc.tensor_parallel_size)
    return tp, tp * int(pc.data_parallel_size) if pc.enable_expert_parallel else 1


def pass_manager(config: Any = None) -> Any:
    """moefx's pass manager as a vLLM `InductorPass` (config defaults to `MOEFX_CONFIG`)."""
    cfg = CompilationConfig.from_any(config) if config is not None else load_config()
    tp, ep = _parallel_sizes()
    es = ExecutionSignature.detect(mode=cfg.mode, max_batch_size=cfg.max_batch_size, tp_size=tp, ep_size=ep)
    if tp is not None and es.parallel is not None:
        es = es.replace(parallel=dataclasses.replace(es.parallel, source="vLLM parallel_config"))
    plan = resolve(_current_model_signature(), es, cfg)
    return _vllm_pass_manager_class()(cfg, plan.enabled_passes(), plan)


def _vllm_pass_manager_class() -> type:
    """PassManager that is also a vLLM InductorPass; made once, kept as a module attribute so it pickles."""
    cls = globals().get("MoefxVllmPassManager")
    if cls is None:
        cls = type("MoefxVllmPassManager", (PassManager, _inductor_pass_base()), {"__module__": __name__})
        globals()["MoefxVllmPassManager"] = cls
    return cls


def _moe_method_class() -> type:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    from moefx.backends.op import moe_experts, select_backend

    class MoefxFusedMoEMethod(UnquantizedFusedMoEMethod):
        """vLLM's unquantized fused-MoE method, with moefx's calibrated backends where a row says so."""

        def _moefx_backend(self, layer: Any, x: torch.Tensor, topk_ids: torch.Tensor, shared: Any) -> str | None:
            plain = (
                shared is None
                and getattr(layer, "expert_map", None) is None
                and not getattr(layer, "apply_router_weight_on_input", False)
                and str(getattr(layer, "activation", "silu")).lower().endswith("silu")
            )
            if not plain:
                warn_once("moefx fused-MoE: layer uses shared experts, expert map, input weighting or a "
                          "non-SiLU activation; running vLLM's own method")
                return None
            name = select_backend(x, topk_ids, layer.w13_weight, layer.w2_weight, upstream="upstream")
            return None if name == "upstream" else name

        def forward_cuda(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
            name = self._moefx_backend(layer, x, topk_ids, shared_experts)
            if name is None:
                return super().forward_cuda(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
            return moe_experts(x, topk_ids, topk_weights, layer.w13_weight, layer.w2_weight, backend=name)

    return MoefxFusedMoEMethod


def register() -> None:
    """vLLM plugin entry point: validate the config, register moefx's ops and fused-MoE method."""
    global _registered
    if _registered:
        return
    cfg = load_config()
    import moefx.backends  # noqa: F401  (registers moefx::moe_experts and the backends)

    if cfg.moe_backend != "upstream":
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

        UnquantizedFusedMoEMethod.register_oot(_moe_method_class(), name="UnquantizedFusedMoEMethod")
    _registered = True
    log.info("moefx vLLM plugin registered (config hash %s)", cfg.compute_hash())
