"""ModelSignature: frozen, normalized facts about a model that providers and rules match on.

Facts come from what the config states, or from what the architecture fixes (`architectures.py`);
nothing is guessed. A fact that is not known stays None, and a provider that needs it then declines,
so the model runs the plain path.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moefx.config import load_data_file
from moefx.facts.architectures import architecture_for
from moefx.facts.quant import parse_quantization

_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "auto": None,
}


def normalize_dtype(value: Any) -> str | None:
    """torch.bfloat16 / 'torch.bfloat16' / 'bf16' -> 'bfloat16'; None and 'auto' -> None."""
    if value is None:
        return None
    text = str(value).replace("torch.", "").strip().lower()
    return _DTYPE_ALIASES.get(text, text)


@dataclass(frozen=True)
class ModelSignature:
    # identity
    family: str | None = None
    model_type: str | None = None
    architectures: tuple[str, ...] = ()
    dtype: str | None = None
    # Where `dtype` came from ("config 'dtype'", "weights", "execution signature", ...); not a fact: it takes
    # no part in equality or key().
    dtype_source: str | None = dataclasses.field(default=None, compare=False)
    # quantization (from `quantization_config`; see quant.py)
    quant_method: str | None = None
    quant_weight_dtype: str | None = None
    quant_act_dtype: str | None = None
    quant_act_scheme: str | None = None  # "dynamic" | "static"
    quant_block_shape: tuple[int, ...] | None = None  # weight block (bn, bk)
    quant_act_group_size: int | None = None  # per-token-group size; None = per token
    # dense geometry
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    tie_word_embeddings: bool | None = None
    hidden_act: str | None = None  # the experts' gate activation
    attention: str | None = None  # "mha" | "gqa" | "mla"
    kv_lora_rank: int | None = None
    # MoE geometry and routing
    num_experts: int | None = None
    top_k: int | None = None
    moe_intermediate_size: int | None = None
    num_shared_experts: int | None = None
    shared_expert_intermediate_size: int | None = None
    first_dense_layers: int | None = None
    moe_layer_step: int | None = None
    routing: str | None = None  # "softmax" | "softmax_group_topk" | "sigmoid_bias" | "sigmoid_bias_group_topk"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool | None = None
    routed_scaling_factor: float | None = None

    def __post_init__(self) -> None:
        hints = _hints()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                value = tuple(value)
                object.__setattr__(self, f.name, value)
            if value is not None and not _type_ok(hints[f.name], value):
                raise ValueError(f"ModelSignature field {f.name!r} has a value of the wrong type: {value!r}")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", normalize_dtype(self.dtype))

    @classmethod
    def unknown(cls) -> ModelSignature:
        return cls()

    @property
    def is_causal_lm(self) -> bool:
        return any(a.endswith("ForCausalLM") for a in self.architectures)

    @classmethod
    def from_config(cls, config: Any) -> ModelSignature:
        """From a transformers config (incl. nested `text_config`), a vLLM config (`hf_config`), a dict,
        or a path to config.json / a model folder / a YAML file. Dict keys may also be field names."""
        if isinstance(config, ModelSignature):
            return config
        if isinstance(config, (str, os.PathLike)):
            config = _load_mapping(Path(config))
        if config is None:
            return cls()
        outer, vllm = _unwrap(config)
        return cls(**_complete(_facts_from_config(outer, vllm)))

    @classmethod
    def from_module(cls, module: Any) -> ModelSignature:
        """From `module.config` when present, with the weights' facts (expert geometry, compute dtype)
        taking precedence: they are what will run. Without a config, only weight geometry is known."""
        from moefx.facts.weights import infer_from_module
        from moefx.log import warn_once

        config = getattr(module, "config", None)
        base = cls.from_config(config) if config is not None else cls()
        facts = {k: v for k, v in dataclasses.asdict(base).items() if v is not None and v != ()}
        for key, value in infer_from_module(module).items():
            stated = facts.get(key)
            if stated is not None and stated != value and key != "dtype":
                warn_once(f"{type(module).__name__}: config says {key}={stated!r} but the weights say {value!r}; "
                          f"the signature uses the weights")
            facts[key] = value
            if key == "dtype":
                facts["dtype_source"] = "weights"
        return cls(**_complete(facts))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def key(self) -> str:
        """Stable short hash of every fact (differs whenever any fact differs)."""
        compared = {f.name for f in dataclasses.fields(self) if f.compare}  # where a fact came from is no fact
        facts = {k: v for k, v in self.to_dict().items() if k in compared}
        blob = json.dumps(facts, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def with_dtype(self, dtype: str | None, source: str) -> ModelSignature:
        """This signature with `dtype` filled in from `source` where the config stated none."""
        if self.dtype is not None or dtype is None:
            return self
        return dataclasses.replace(self, dtype=dtype, dtype_source=source)

    def describe(self) -> str:
        parts = [self.model_type or "unknown model_type"]
        parts.append(f"dtype={self.dtype} [{self.dtype_source or 'stated'}]" if self.dtype
                     else "dtype=unknown [the config states none]")
        if self.num_experts is not None:
            parts.append(f"E={self.num_experts} top_k={self.top_k} I={self.moe_intermediate_size} H={self.hidden_size}")
        if self.quant_method:
            parts.append(f"quant={self.quant_method}")
        return " ".join(parts)


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(ModelSignature)


def _type_ok(tp: Any, value: Any) -> bool:
    is_union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(tp) if a is not type(None)] if is_union else [tp]
    for arg in args:
        origin = typing.get_origin(arg) or arg
        if origin is tuple:
            if isinstance(value, tuple) and all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in value):
                return True
        elif origin is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return True
        elif origin is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return True
        elif isinstance(value, origin):
            return True
    return False


def _load_mapping(path: Path) -> dict[str, Any]:
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model config {str(path)!r} does not exist")
    data = load_data_file(path, "model config")
    if not isinstance(data, dict):
        raise ValueError(f"model config {str(path)!r} must hold a mapping, got {type(data).__name__}")
    return data


def _unwrap(config: Any) -> tuple[Any, Any]:
    """(the HF-style config, the vLLM object that wrapped it or None)."""
    if getattr(config, "hf_config", None) is not None:
        return config.hf_config, config
    model_config = getattr(config, "model_config", None)
    if getattr(model_config, "hf_config", None) is not None:
        return model_config.hf_config, model_config
    return config, None


def _getter(obj: Any) -> typing.Callable[[str], Any]:
    if isinstance(obj, dict):
        return obj.get
    return lambda k: getattr(obj, k, None)


def _text_config(outer: Any) -> Any:
    inner = outer.get("text_config") if isinstance(outer, dict) else getattr(outer, "text_config", None)
    return inner if inner is not None else outer


def _first(get: typing.Callable[[str], Any], *keys: str) -> Any:
    for key in keys:
        value = get(key)
        if value is not None:
            return value
    return None


def _facts_from_config(outer: Any, vllm: Any) -> dict[str, Any]:
    """What the config states, under normalized names. Text-model keys win; the outer config fills the rest."""
    inner_get, outer_get = _getter(_text_config(outer)), _getter(outer)

    def get(key: str) -> Any:
        value = inner_get(key)
        return outer_get(key) if value is None else value

    qc = get("quantization_config")
    if qc is None and vllm is not None and getattr(vllm, "quantization", None):
        qc = {"quant_method": vllm.quantization}
    dtype, dtype_source = get("dtype"), "config 'dtype'"
    if dtype is None and isinstance(outer, dict):
        dtype, dtype_source = get("torch_dtype"), "config 'torch_dtype'"  # config.json written before transformers 5
    if dtype is None and vllm is not None:
        dtype, dtype_source = getattr(vllm, "dtype", None), "vLLM model config dtype"
    mlp_only = get("mlp_only_layers")
    dtype = normalize_dtype(dtype)
    facts: dict[str, Any] = {
        "model_type": get("model_type"),
        "architectures": tuple(outer_get("architectures") or inner_get("architectures") or ()),
        "dtype": dtype,
        "dtype_source": dtype_source if dtype is not None else None,
        "hidden_size": get("hidden_size"),
        "intermediate_size": get("intermediate_size"),
        "num_layers": get("num_hidden_layers"),
        "num_heads": get("num_attention_heads"),
        "num_kv_heads": get("num_key_value_heads"),
        "head_dim": get("head_dim"),
        "vocab_size": get("vocab_size"),
        "tie_word_embeddings": get("tie_word_embeddings"),
        "hidden_act": get("hidden_act"),
        "kv_lora_rank": get("kv_lora_rank"),
        "num_experts": _first(get, "num_experts", "num_local_experts", "n_routed_experts"),
        "top_k": get("num_experts_per_tok"),
        "moe_intermediate_size": get("moe_intermediate_size"),
        "num_shared_experts": get("n_shared_experts"),
        "shared_expert_intermediate_size": get("shared_expert_intermediate_size"),
        "first_dense_layers": get("first_k_dense_replace"),
        "moe_layer_step": _first(get, "decoder_sparse_step", "moe_layer_freq"),
        "n_group": get("n_group"),
        "topk_group": get("topk_group"),
        "norm_topk_prob": get("norm_topk_prob"),
        "routed_scaling_factor": get("routed_scaling_factor"),
        "routing": _routing(get),
        **parse_quantization(qc),
    }
    if mlp_only:
        # Dense layers scattered through the stack: no provider plans for that layout yet.
        facts["moe_layer_step"] = None
    if isinstance(outer, dict):
        # Mappings may also state signature facts by field name (a saved or hand-written signature).
        for f in dataclasses.fields(ModelSignature):
            if facts.get(f.name) is None and get(f.name) is not None:
                facts[f.name] = get(f.name)
    architecture = architecture_for(facts["model_type"])
    if architecture is not None:
        facts["family"] = architecture.family
        for key, value in architecture.implied(get).items():
            if facts.get(key) is None and value is not None:
                facts[key] = value
    return facts


def _routing(get: typing.Callable[[str], Any]) -> str | None:
    """Routing kind from explicit keys only (scoring_func / topk_method / n_group)."""
    score = get("scoring_func")
    if score not in ("softmax", "sigmoid"):
        return None
    method = get("topk_method")
    grouped = method in ("group_limited_greedy", "noaux_tc") and (get("n_group") or 1) > 1
    if score == "sigmoid":
        if method != "noaux_tc":
            return None  # sigmoid without the correction bias: a kind no provider knows
        return "sigmoid_bias_group_topk" if grouped else "sigmoid_bias"
    return "softmax_group_topk" if grouped else "softmax"


def _complete(facts: dict[str, Any]) -> dict[str, Any]:
    """Facts that follow from others by definition (head_dim, attention kind)."""
    hidden, heads, kv = facts.get("hidden_size"), facts.get("num_heads"), facts.get("num_kv_heads")
    if facts.get("head_dim") is None and hidden and heads and facts.get("kv_lora_rank") is None:
        facts["head_dim"] = hidden // heads
    if facts.get("attention") is None and heads:
        if facts.get("kv_lora_rank"):
            facts["attention"] = "mla"
        elif kv:
            facts["attention"] = "mha" if kv == heads else "gqa"
    return {k: v for k, v in facts.items() if v is not None}
