"""The experts-implementation compatibility matrix: every installed transformers model class whose experts use
transformers' experts interface, built tiny from its config class, run with "eager", "grouped_mm" and "moefx".

Per row (CPU, seeded weights): forward logits within transformers' tolerances of eager's (fp32 1e-4, fp16 1e-3,
bf16 5e-3, `torch.testing.assert_close` atol = rtol), greedy `generate()` tokens equal, backward gradients of every
parameter within relative 1e-4 of eager's (fp32), and the experts module compiled with `fullgraph=True` (dynamo +
AOT autograd, forward and backward) equal to its eager result; or, for a model the op does not take, the exact
fallback reason (the row then checks that moefx still equals eager: it runs transformers' grouped_mm).
"moefx" forces `MOE_POLICY` (gemv for decode-sized calls, the grouped algorithm above: moefx's own kernels' math,
their PyTorch form on the CPU), so the rows test moefx's paths, not the plain path the op takes without a
calibration row. `scripts/compat_matrix.py` prints the table (docs/COMPAT.md); tests/test_compat_matrix.py runs it.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moefx.integrations.transformers import is_experts_module, register, unsupported_reason

IMPLEMENTATIONS = ("eager", "grouped_mm", "moefx")
MOE_POLICY = "eager=gemv@1-4,grouped@5-;capture=grouped@1-"
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 5e-3}
BACKWARD_RTOL = 1e-4
SMALL_GRAD = 1e-3  # a parameter's gradient below this fraction of the largest is checked in the total only
CHECKS = ("forward", "generate", "backward", "compile")

# Config fields shrunk wherever a config class has them (the sizes transformers' own model testers use, about).
TINY: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    shared_intermediate_size=32, moe_shared_expert_intermediate_size=32, shared_experts_intermediate_size=32,
    dense_intermediate_size=64, moe_hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=256, model_max_length=256,
    num_experts=8, num_local_experts=8, n_routed_experts=8, moe_num_experts=8, num_experts_per_tok=2,
    num_experts_per_token=2, top_k_experts=2, moe_k=2, moe_topk=2, n_group=2, topk_group=1, num_expert_group=2,
    n_shared_experts=1, num_shared_experts=1, moe_num_shared_experts=1,
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    first_k_dense_replace=1, num_dense_layers=1, moe_layer_start_index=1, decoder_sparse_step=1,
    expert_layer_period=1, expert_layer_offset=0, sliding_window=16, sliding_window_size=16,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_head_dim=16, linear_num_heads=4, index_n_heads=2, index_head_dim=16, index_topk=8,
    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8,
    n_groups=1, mamba_n_groups=1, mamba_chunk_size=16, chunk_size=16, mamba_dt_rank=8,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, router_hidden_size=32,
    hidden_size_per_layer_input=16, vocab_size_per_layer_input=128, rotary_dim=8, gated_norm_rank=8,
    o_lora_rank=16, o_groups=2, hc_lowrank=8, ple_embed_dim=16, loop_gate_rank=8,
    unpadded_vocab_size=128, adapter_in_dim=64, adapter_out_dim=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
TIES = (  # MLA's rope dim, MHA, a vision adapter's input
    ("head_dim", "qk_rope_head_dim"), ("num_attention_heads", "num_key_value_heads"), ("hidden_size", "adapter_in_dim"),
)
NONE_MEANS_OFF = ("q_lora_rank", "sliding_window", "sliding_window_size")  # None there switches a feature off
# Per-layer lists (their length is num_hidden_layers): cut to the tiny depth keeping one layer of each kind.
PER_LAYER_HINT = ("layer_types", "mlp_layer_types", "indexer_types")


@dataclass
class Row:
    model_type: str
    model_class: str
    experts: list[str] = field(default_factory=list)
    reason: str | None = None  # why moefx falls back (None: the op runs)
    plain: str | None = None  # the op runs, but its plain path (grouped_mm) instead of moefx's kernels, and why
    results: dict[str, dict[str, str]] = field(default_factory=dict)  # impl -> check -> "ok" / "n/a: ..." / error
    error: str | None = None  # the row could not be built or run
    seconds: float = 0.0
    times: dict[str, float] = field(default_factory=dict)  # seconds per check, all implementations

    def passed(self, impl: str, check: str) -> bool:
        return self.results.get(impl, {}).get(check, "").startswith("ok")


def _modules_with_experts() -> list[str]:
    from pathlib import Path

    import transformers

    root = Path(transformers.__file__).parent / "models"
    return sorted(p.parent.name for p in root.glob("*/modeling_*.py") if "use_experts_implementation" in p.read_text())


def _model_class(model_type: str, config_cls: type) -> type | None:
    """The class a row builds: the causal LM for this config, else its base (text) model."""
    import transformers
    from transformers import PreTrainedModel
    from transformers.models.auto import modeling_auto as ma
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = importlib.import_module(f"transformers.models.{model_type_to_module_name(model_type)}.modeling_"
                                     f"{model_type_to_module_name(model_type)}")
    own = [c for c in vars(module).values()
           if isinstance(c, type) and issubclass(c, PreTrainedModel) and getattr(c, "config_class", None) is config_cls]
    for name in (ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type), ma.MODEL_MAPPING_NAMES.get(model_type)):
        cls = getattr(transformers, name, None) if name else None
        if cls is not None and cls in own:
            return cls
    for suffix in ("ForCausalLM", "Model"):
        for cls in own:
            if cls.__name__.endswith(suffix) and not cls.__name__.endswith("PreTrainedModel"):
                return cls
    return None


def _has_experts(cls: type, model_type: str) -> bool:
    """Whether the model holds an experts-interface module, built on the meta device (no memory) from its default
    config or the tiny one (which switches on opt-in MoE blocks: Gemma 4); a text class that neither builds counts
    (its row says why it was not built)."""
    built = False
    for make in (lambda: cls.config_class(), lambda: tiny_config(model_type)):
        try:
            with torch.device("meta"):
                model = cls(make())
        except Exception:  # some default configs do not build their own model
            continue
        built = True
        if any(is_experts_module(m) for m in model.modules()):
            return True
    return not built and not any(part in cls.__name__ for part in ("Vision", "Audio"))


def discover() -> list[tuple[str, type]]:
    """(model_type, model class) for every non-composite config whose model holds experts-interface modules at its
    default size (composite configs, e.g. vision-language ones, are covered by the rows of their text configs)."""
    from transformers.models.auto.configuration_auto import (
        CONFIG_MAPPING,
        CONFIG_MAPPING_NAMES,
        model_type_to_module_name,
    )

    modules = set(_modules_with_experts())
    out = []
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        if model_type_to_module_name(model_type) not in modules:
            continue
        config_cls = CONFIG_MAPPING[model_type]
        if getattr(config_cls, "sub_configs", None):
            continue
        cls = _model_class(model_type, config_cls)
        if cls is not None and _has_experts(cls, model_type):
            out.append((model_type, cls))
    return out


def _per_layer(values: list, kinds_first: int) -> list:
    """`kinds_first` entries of a per-layer list keeping one of each distinct value where possible (first each)."""
    picked: list[int] = []
    for i, v in enumerate(values):
        if all(values[j] != v for j in picked):
            picked.append(i)
    for i in range(len(values)):
        if len(picked) >= kinds_first:
            break
        if i not in picked:
            picked.append(i)
    return [values[i] for i in sorted(picked[:kinds_first])]


def tiny_config(model_type: str, extra: dict[str, Any] | None = None) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    values = default.to_dict()
    layers = values.get("num_hidden_layers")
    kw: dict[str, Any] = {}
    for key, tiny in TINY.items():  # sizes only shrink (a 0 stays 0); token ids fit the vocab
        if key not in values:
            continue
        val = values[key]
        if key in TOKEN_IDS:
            if isinstance(val, int) or isinstance(val, list) and val:
                kw[key] = tiny
        elif val is None and key not in NONE_MEANS_OFF:
            kw[key] = tiny
        elif isinstance(val, int) and not isinstance(val, bool) and tiny < val:
            kw[key] = tiny
    for key, val in values.items():
        if isinstance(val, list) and layers and len(val) == layers and key not in kw:
            kw[key] = None if key not in PER_LAYER_HINT else val
    for a, b in TIES:  # sizes equal by default stay equal
        if a in kw and b in kw and values.get(a) == values.get(b):
            kw[a] = kw[b] = min(kw[a], kw[b])
    lists = {k: v for k, v in kw.items() if isinstance(v, list)}
    if lists:  # enough layers for one of each layer kind, the same cut for every per-layer list
        depth = max(2, max(len(set(map(str, v))) for v in lists.values()))
        kw["num_hidden_layers"] = min(depth, 4)
        for k, v in lists.items():
            kw[k] = _per_layer(v, kw["num_hidden_layers"])
    for key in ("attention_dropout", "hidden_dropout", "dropout", "router_jitter_noise", "resid_pdrop", "embd_pdrop"):
        if isinstance(values.get(key), float):
            kw[key] = 0.0
    kw.update(OVERRIDES.get(model_type, {}))
    kw.update(extra or {})
    kw = {k: v for k, v in kw.items() if not (v is None and values.get(k) is None)}
    return _build_config(cls, kw)


def _build_config(cls: type, kw: dict[str, Any]) -> Any:
    try:
        return cls(**kw)
    except Exception:
        # a per-layer list set to None that this config cannot regenerate: cut the default instead
        default = cls().to_dict()
        layers = kw.get("num_hidden_layers", 2)
        for k, v in list(kw.items()):
            if v is None and isinstance(default.get(k), list):
                kw[k] = _per_layer(default[k], layers)
        return cls(**kw)


# What a model type needs beyond TINY to build with one MoE layer (config validators, defaults that do not build).
OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek_ocr2_text": dict(mlp_layer_types=["dense", "sparse"]),
    "dots3_note_text": dict(swa_num_attention_heads=4, swa_num_key_value_heads=4,
                            swa_q_lora_rank=32, swa_kv_lora_rank=16, swa_head_dim=16, swa_qk_nope_head_dim=8,
                            swa_v_head_dim=16),
    "ernie4_5_vl_moe_text": dict(moe_intermediate_size=[32, 32], rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, mrope_section=[2, 2, 4])),
    "flint": dict(mlp_only_layers=[0]),
    "gemma4_text": dict(enable_moe_block=True, num_experts=8, top_k_experts=2),
    "glm4v_moe_text": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1],
                                                partial_rotary_factor=0.5)),
    "glm5_next_text": dict(index_kpool=2),
    "granitemoehybrid": dict(mamba_d_head=32, layer_types=["linear_attention", "attention"]),
    "hunyuan_v1_moe": dict(num_experts=8, moe_topk=2),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "hy_v4_vl_text": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1])),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "qwen3_omni_moe_talker_text": dict(shared_expert_intermediate_size=32),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=2),
    "zaya": dict(num_experts_per_tok=1),
}


# transformers' own model tests build these families with GELU (hidden_act="gelu"): a row each runs them that way too
VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("qwen3_moe", dict(hidden_act="gelu")),
    ("qwen2_moe", dict(hidden_act="gelu")),
    ("glm4_moe", dict(hidden_act="gelu")),
    ("mixtral", dict(hidden_act="gelu")),
    ("olmoe", dict(hidden_act="gelu_new")),
)
MAX_PARAMS = 3_000_000  # a tiny config that is still larger than this is a shrinking bug: not built


def _tiny_model(model_type: str, cls: type, seed: int = 0, extra: dict[str, Any] | None = None) -> nn.Module:
    config = tiny_config(model_type, extra)
    with torch.device("meta"):
        size = sum(p.numel() for p in cls(config).parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"the tiny config still has {size / 1e6:.1f} M parameters")
    torch.manual_seed(seed)
    model = cls(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # expert weights large enough that a wrong experts path moves the logits
        for module in model.modules():
            if is_experts_module(module):
                for p in module.parameters(recurse=False):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def _set_impl(model: nn.Module, impl: str) -> None:
    model.set_experts_implementation(impl)
    for module in model.modules():
        if is_experts_module(module):
            module.moefx_backend = MOE_POLICY


def _is_causal_lm(model: nn.Module) -> bool:
    return type(model).__name__.endswith("ForCausalLM")


def _inputs(model: nn.Module) -> dict[str, torch.Tensor]:
    """Token ids for a causal LM; embeddings for a base model (some take no ids: Qwen3-Omni's talker); nothing for
    a vision or audio encoder with experts (Dots3-Note's): its rows check the experts module alone."""
    g = torch.Generator().manual_seed(5)
    config = model.config
    if any(part in type(model).__name__ for part in ("Vision", "Audio")):
        return {}
    if _is_causal_lm(model):
        return dict(input_ids=torch.randint(3, config.vocab_size, (2, 7), generator=g))
    return dict(inputs_embeds=torch.randn(2, 7, config.hidden_size, generator=g))


def _outputs(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**inputs)
    for name in ("logits", "last_hidden_state"):
        t = getattr(out, name, None)
        if t is not None:
            return t
    return out[0]


def _experts_inputs(experts: nn.Module, seed: int = 13) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden rows, top-2 ids and routing weights for one experts module (its hidden size and expert count)."""
    hidden_size = experts.down_proj.shape[2] if experts.is_transposed else experts.down_proj.shape[1]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, hidden_size, generator=g)
    probs = torch.softmax(torch.randn(9, experts.num_experts, generator=g), -1)
    w, idx = probs.topk(min(2, experts.num_experts), dim=-1)
    return x, idx, w


def _plain_path_reason(experts: nn.Module) -> str | None:
    """Why the op, under MOE_POLICY, runs its plain path (grouped_mm) for this module, or None (moefx's kernels)."""
    from moefx.backends import BACKENDS, MoeCall
    from moefx.backends.policy import parse_policy_spec
    from moefx.integrations.transformers import gate_of

    w13, w2 = experts.gate_up_proj, experts.down_proj
    if experts.is_transposed:
        w13, w2 = w13.transpose(-2, -1), w2.transpose(-2, -1)
    x, _, _ = _experts_inputs(experts)
    activation, limit = gate_of(experts)
    reasons = []
    for m in (2, 9):  # a decode-sized and a prefill-sized call
        name = parse_policy_spec(MOE_POLICY)["eager"].backend_for(m)
        why = BACKENDS[name].unsupported_reason(MoeCall.unrouted(x[:m], w13, w2, activation=activation,
                                                                 gate_limit=limit))
        if why:
            reasons.append(f"{name}: {why}")
    return "; ".join(reasons) or None


def _rel_err(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).norm() / exact.norm()).item()


def _forward_outputs(model: nn.Module, inputs: dict[str, torch.Tensor]) -> dict[Any, torch.Tensor]:
    """fp32: the model's output; fp16 / bf16: the first experts module's, on fixed rows and routing (a whole model in
    low precision re-routes tokens whose top-k scores are within rounding of each other, whatever the experts path);
    "exact": that experts module in fp64."""
    with torch.no_grad():
        experts = next(m for m in model.modules() if is_experts_module(m))
        x, idx, w = _experts_inputs(experts)
        out = {torch.float32: _outputs(model, inputs).float() if inputs else experts(x, idx, w)}
        for dtype in (torch.float16, torch.bfloat16):
            out[dtype] = copy.deepcopy(experts).to(dtype)(x.to(dtype), idx, w.to(dtype)).float()
        exact = copy.deepcopy(experts).double()  # its own copy of the config: eager there leaves the model alone
        exact.config._experts_implementation = "eager"
        out["exact"] = exact(x.double(), idx, w.double())
    return out


def _check_forward(model: nn.Module, inputs: dict, impl: str, ref: dict) -> str:
    """Within transformers' tolerance of eager; in fp16 / bf16 a path that rounds differently passes when it is at
    least as close to the fp64 result as eager is (eager and grouped_mm round alike on the CPU; moefx keeps fp32
    accumulators and intermediates, as its kernels do)."""
    out = _forward_outputs(model, inputs)
    if impl == "eager":
        ref.update(out)
        return "ok"
    errors, notes = [], []
    for dtype, tol in TOLERANCE.items():
        try:
            torch.testing.assert_close(out[dtype], ref[dtype], atol=tol, rtol=tol)
            continue
        except AssertionError:
            diff = (out[dtype] - ref[dtype]).abs().max().item()
        name = str(dtype).replace("torch.", "")
        if dtype != torch.float32:
            ours, eager = (_rel_err(o, ref["exact"]) for o in (out[dtype], ref[dtype]))
            if ours <= eager:
                notes.append(f"{name} {ours:.1e} vs eager {eager:.1e} from fp64")
                continue
        errors.append(f"{name} max |diff| {diff:.2e} > {tol:g}")
    if errors:
        return "; ".join(errors)
    return "ok" + (f" ({'; '.join(notes)})" if notes else "")


def _check_fallback(model: nn.Module, inputs: dict, impl: str, ref: dict) -> str:
    """A module the op does not take: moefx must give exactly grouped_mm's outputs (it runs grouped_mm)."""
    out = _forward_outputs(model, inputs)
    if impl != "moefx":
        ref[impl] = out
        return "ok"
    same = all(torch.equal(out[k], ref["grouped_mm"][k]) for k in out)
    return "ok: equal to grouped_mm" if same else "differs from grouped_mm"


def _check_generate(model: nn.Module, inputs: dict, impl: str, ref: dict) -> str:
    if not (_is_causal_lm(model) and model.can_generate()):
        return "n/a: no generation head in this class"
    ids = inputs["input_ids"]
    with torch.no_grad():
        tokens = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                pad_token_id=0)
    if impl == "eager":
        ref["tokens"] = tokens
        return "ok"
    return "ok" if torch.equal(tokens, ref["tokens"]) else "tokens differ from eager"


def _check_backward(model: nn.Module, inputs: dict, impl: str, ref: dict) -> str:
    """Gradients of every parameter (eval mode: no dropout or router noise) within relative 1e-4 of eager's: all of
    them together, and each one whose gradient is at least `SMALL_GRAD` of the largest (a smaller one, e.g. a router
    whose routing is hashed, is fp32 cancellation noise: its relative error means nothing)."""
    model.zero_grad(set_to_none=True)
    if inputs:
        out = _outputs(model, inputs).float()
    else:  # an encoder without token inputs: the experts module's gradients
        experts = next(m for m in model.modules() if is_experts_module(m))
        out = experts(*_experts_inputs(experts))
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * weights).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    if impl == "eager":
        ref["grads"] = grads
        return "ok"
    want = ref["grads"]
    if grads.keys() != want.keys():
        return f"gradients of {sorted(grads.keys() ^ want.keys())[:3]} present in one run only"
    norms = {n: want[n].norm().item() for n in want}
    diffs = {n: (grads[n] - want[n]).norm().item() for n in want}
    total = math.sqrt(sum(d * d for d in diffs.values())) / max(math.sqrt(sum(v * v for v in norms.values())), 1e-30)
    if total > BACKWARD_RTOL:
        return f"relative error {total:.1e} > {BACKWARD_RTOL:g} over all gradients"
    top = max(norms.values(), default=0.0)
    worst, where = max(((diffs[n] / norms[n], n) for n in want if norms[n] >= SMALL_GRAD * top), default=(0.0, ""))
    return "ok" if worst <= BACKWARD_RTOL else f"relative error {worst:.1e} > {BACKWARD_RTOL:g} ({where})"


def _check_compile(model: nn.Module, inputs: dict, impl: str, ref: dict) -> str:
    """The first experts module under `torch.compile(fullgraph=True)` (dynamo + AOT autograd, so the backward is
    traced too): output and gradients equal to the module's eager result under this implementation."""
    experts = next(m for m in model.modules() if is_experts_module(m))
    x, idx, w = _experts_inputs(experts)

    def run(fn: Callable) -> list[torch.Tensor]:
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        experts.zero_grad(set_to_none=True)
        out = fn(xs, idx, ws)
        out.pow(2).sum().backward()
        grads = [xs.grad, ws.grad, *(p.grad for p in experts.parameters(recurse=False))]
        experts.zero_grad(set_to_none=True)
        return [out.detach(), *[gr for gr in grads if gr is not None]]

    want = run(experts)
    torch._dynamo.reset()
    try:
        got = run(torch.compile(experts, backend="aot_eager", fullgraph=True))
    finally:
        torch._dynamo.reset()
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.allclose(a, b, atol=1e-5, rtol=1e-4)]
    return "ok" if len(got) == len(want) and not bad else f"compiled result differs from eager (tensors {bad})"


STEPS: dict[str, Callable[[nn.Module, dict, str, dict], str]] = {
    "forward": _check_forward,
    "generate": _check_generate,
    "backward": _check_backward,
    "compile": _check_compile,
}


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:160]


def _run_check(row: Row, check: str, step: Callable, model: nn.Module, inputs: dict, impl: str, ref: dict) -> None:
    start = time.perf_counter()
    try:
        row.results.setdefault(impl, {})[check] = step(model, inputs, impl, ref)
    except Exception as exc:
        row.results.setdefault(impl, {})[check] = _short(exc)
        if impl == "eager":
            row.error = f"eager {check} raised {_short(exc)}"
    row.times[check] = row.times.get(check, 0.0) + time.perf_counter() - start


def run_row(
    model_type: str, model_class: type, checks: Iterable[str] = CHECKS, extra: dict[str, Any] | None = None
) -> Row:
    """Build the tiny model and run every check under every implementation; never raises (errors go in the row).

    Compile runs for moefx, and for grouped_mm only when moefx's fails (to say whether grouped_mm's does too)."""
    register()
    label = model_type + "".join(f" {k}={v}" for k, v in (extra or {}).items())
    row = Row(label, model_class.__name__)
    start = time.perf_counter()
    try:
        model = _tiny_model(model_type, model_class, extra=extra)
    except Exception as exc:
        row.error = f"not built tiny: {_short(exc)}"
        return row
    experts = [m for m in model.modules() if is_experts_module(m)]
    row.experts = sorted({type(m).__name__ for m in experts})
    if not experts:
        row.error = "no experts-interface module at the tiny size"
        return row
    row.reason = "; ".join(sorted({r for r in (unsupported_reason(m) for m in experts) if r})) or None
    if row.reason is None:
        row.plain = _plain_path_reason(experts[0])
    inputs = _inputs(model)
    ref: dict = {}
    if row.reason:  # moefx runs transformers' grouped_mm: it must give grouped_mm's outputs exactly
        plan = [(impl, "forward", _check_fallback) for impl in IMPLEMENTATIONS]
    else:
        wanted = [c for c in CHECKS if c in set(checks)]
        plan = [(impl, c, STEPS[c]) for impl in IMPLEMENTATIONS for c in wanted if c != "compile" or impl == "moefx"]
    for impl, check, step in plan:
        if row.error:
            break
        _set_impl(model, impl)
        _run_check(row, check, step, model, inputs, impl, ref)
    if not row.error and "compile" in row.results.get("moefx", {}) and not row.passed("moefx", "compile"):
        _set_impl(model, "grouped_mm")
        _run_check(row, "compile", _check_compile, model, inputs, "grouped_mm", ref)
    row.seconds = time.perf_counter() - start
    return row


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Tiny models run far faster on one intra-op thread (2 threads on a shared 2-core machine: ~50x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_matrix(select: Callable[[str], bool] | None = None, checks: Iterable[str] = CHECKS) -> list[Row]:
    """Every discovered row, then the activation variants (`select` filters by model type)."""
    found = dict(discover())
    jobs = [(t, c, None) for t, c in found.items()]
    jobs += [(t, found[t], extra) for t, extra in VARIANTS if t in found]
    with one_thread():
        return [run_row(t, c, checks, extra) for t, c, extra in jobs if select is None or select(t)]


def failures(row: Row) -> list[str]:
    """The checks grouped_mm passes and moefx does not (empty: the row is fine)."""
    if row.error:
        return []
    if row.reason:
        return [] if row.passed("moefx", "forward") else ["fallback differs from grouped_mm"]
    out = []
    for check in CHECKS:
        ours = row.results.get("moefx", {}).get(check, "")
        if ours.startswith("ok") or ours.startswith("n/a") or not ours:
            continue
        base = row.results.get("grouped_mm", {}).get(check, "ok")
        if base.startswith("ok"):
            out.append(f"{check}: {ours}")
    return out


def _cell(row: Row, check: str) -> str:
    ours = row.results.get("moefx", {}).get(check, "")
    base = row.results.get("grouped_mm", {}).get(check, "")
    if ours == "ok":
        return "ok"
    if ours.startswith("ok"):
        return "ok" + ours[2:].replace("|", "/")
    if ours.startswith("n/a"):
        return ours[5:]
    if not ours:
        return "not run"
    return f"FAIL: {ours}" + (f" (grouped_mm: {base})" if base and not base.startswith("ok") else "")


def markdown(rows: list[Row]) -> str:
    """The table: one row per model class, moefx's result per check (a failure also shows grouped_mm's)."""
    import transformers

    lines = [
        f"transformers {transformers.__version__}, torch {torch.__version__}, CPU; moefx policy `{MOE_POLICY}`.",
        "",
        "| model type | class | experts module | moefx | forward | generate | backward | compile |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r.model_type} | {r.model_class} | {', '.join(r.experts)} | "
        if r.error:
            lines.append(head + f"not run: {r.error} | | | | |")
        elif r.reason:
            lines.append(head + f"falls back: {r.reason} | {_cell(r, 'forward')} | | | |")
        else:
            runs = "runs the op" + (f" (plain path: {r.plain})" if r.plain else "")
            lines.append(head + runs + " | " + " | ".join(_cell(r, c) for c in CHECKS) + " |")
    return "\n".join(lines)
