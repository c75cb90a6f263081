"""Normalize a `quantization_config` into ModelSignature's quant_* facts.

A method we do not understand keeps `quant_method` but leaves the dtypes None; providers treat that as
"unknown format" and decline, so such a model runs the plain path instead of a kernel built for
another format.
"""

from __future__ import annotations

from typing import Any

_EMPTY: dict[str, Any] = {
    "quant_method": None,
    "quant_weight_dtype": None,
    "quant_act_dtype": None,
    "quant_act_scheme": None,
    "quant_block_shape": None,
    "quant_act_group_size": None,
}


def _as_dict(qc: Any) -> dict[str, Any]:
    if isinstance(qc, dict):
        return qc
    if hasattr(qc, "to_dict"):
        return qc.to_dict()
    return dict(vars(qc))


def _ct_dtype(spec: dict[str, Any] | None) -> str | None:
    """compressed-tensors {num_bits, type} -> dtype name."""
    if not spec:
        return None
    bits, kind = spec.get("num_bits"), spec.get("type")
    if kind == "float" and bits == 8:
        return "float8_e4m3fn"
    if kind == "int" and bits in (4, 8):
        return f"int{bits}"
    return None


def _fp8(qc: dict[str, Any]) -> dict[str, Any]:
    fmt = qc.get("fmt", "e4m3")
    dtype = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}.get(fmt)
    block = qc.get("weight_block_size")
    scheme = qc.get("activation_scheme", "dynamic")
    return {
        "quant_weight_dtype": dtype,
        "quant_act_dtype": dtype,
        "quant_act_scheme": scheme if scheme in ("dynamic", "static") else None,
        "quant_block_shape": tuple(block) if block else None,
        # Block-quantized checkpoints quantize activations per token group of the block's K width.
        "quant_act_group_size": int(block[1]) if block else None,
    }


def _compressed_tensors(qc: dict[str, Any]) -> dict[str, Any]:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        return {}  # several schemes in one model: not one format we can plan for
    scheme = next(iter(groups.values()))
    weights, acts = scheme.get("weights") or {}, scheme.get("input_activations")
    out: dict[str, Any] = {"quant_weight_dtype": _ct_dtype(weights)}
    if weights.get("strategy") == "block" and weights.get("block_structure"):
        out["quant_block_shape"] = tuple(weights["block_structure"])
    if acts:
        out["quant_act_dtype"] = _ct_dtype(acts)
        out["quant_act_scheme"] = "dynamic" if acts.get("dynamic") else "static"
        if acts.get("strategy") == "group":
            out["quant_act_group_size"] = acts.get("group_size")
    return out


def parse_quantization(qc: Any) -> dict[str, Any]:
    """quant_* facts for a quantization config (dict or transformers QuantizationConfig), or all None."""
    if qc is None:
        return dict(_EMPTY)
    data = _as_dict(qc)
    method = str(data.get("quant_method") or "unknown").lower()
    out = dict(_EMPTY, quant_method=method)
    if method == "fp8":
        out.update(_fp8(data))
    elif method == "compressed-tensors":
        out.update(_compressed_tensors(data))
    elif method in ("gptq", "awq") and data.get("bits") in (4, 8):
        out["quant_weight_dtype"] = f"int{data['bits']}"
    elif method == "bitsandbytes":
        if data.get("load_in_4bit"):
            out["quant_weight_dtype"] = data.get("bnb_4bit_quant_type") or "int4"
        elif data.get("load_in_8bit"):
            out["quant_weight_dtype"] = "int8"
    elif method == "w8a8_int8":
        out.update(quant_weight_dtype="int8", quant_act_dtype="int8", quant_act_scheme="dynamic")
    elif method == "mxfp4":
        out["quant_weight_dtype"] = "mxfp4"
    return out
