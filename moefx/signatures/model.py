"""ModelSignature: frozen, normalized facts about a model that providers and rules match on."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSignature:
    family: str | None = None
    model_type: str | None = None
    architectures: tuple[str, ...] = ()
    dtype: str | None = None
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    num_experts: int | None = None
    top_k: int | None = None
    moe_intermediate_size: int | None = None

    @classmethod
    def unknown(cls) -> ModelSignature:
        return cls()

    @classmethod
    def from_config(cls, config: Any) -> ModelSignature:
        cfg = getattr(config, "hf_config", config)
        cfg = getattr(cfg, "text_config", None) or cfg
        get = (lambda k: cfg.get(k)) if isinstance(cfg, dict) else (lambda k: getattr(cfg, k, None))
        dtype = get("dtype") or get("torch_dtype")
        return cls(
            model_type=get("model_type"),
            architectures=tuple(get("architectures") or ()),
            dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
            hidden_size=get("hidden_size"),
            num_layers=get("num_hidden_layers"),
            num_heads=get("num_attention_heads"),
            num_kv_heads=get("num_key_value_heads"),
            head_dim=get("head_dim"),
            vocab_size=get("vocab_size"),
            num_experts=get("num_experts") or get("num_local_experts") or get("n_routed_experts"),
            top_k=get("num_experts_per_tok"),
            moe_intermediate_size=get("moe_intermediate_size"),
        )

    @classmethod
    def from_module(cls, module: Any) -> ModelSignature:
        config = getattr(module, "config", None)
        return cls.from_config(config) if config is not None else cls.unknown()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
