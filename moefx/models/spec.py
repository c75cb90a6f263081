"""A model named by a spec: a built-in name (`catalog.py`, HF ids too), a config.json or a model folder holding one;
its config dict (`model_config`) and a causal LM of it with seeded random weights (`build_model_from_spec`). The
CLI's MODEL arguments and `moefx.precompile` take these specs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moefx.config import load_data_file
from moefx.machine import free_memory


def model_config(spec: str) -> dict[str, Any]:
    """The transformers config dict of a built-in name (`moefx.models.catalog`, HF ids too), a config.json or a
    model folder holding one; a missing path is named as missing, not as an unknown built-in name."""
    from moefx.models.catalog import catalog_config, catalog_names

    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"model folder {spec!r} holds no config.json")
    if path.is_file():
        data = load_data_file(path, "model config")
        if not isinstance(data, dict):
            raise ValueError(f"model config {str(path)!r} must hold a JSON object")
        return data
    try:
        return catalog_config(spec)
    except ValueError:
        if "/" in spec or spec.startswith((".", "~")) or spec.lower().endswith((".json", ".yaml", ".yml")):
            raise ValueError(f"model {spec!r}: no such file or folder (nor a built-in name; built-in names: "
                             f"{catalog_names()})") from None
        raise


def default_layers(config: dict[str, Any]) -> int:
    """Enough depth to hold every kind of layer once: the dense prefix, then one MoE layer (at least 2 layers)."""
    total = int(config["num_hidden_layers"])
    dense = int(config.get("first_k_dense_replace") or 0)
    return min(total, max(2, dense + 1))


def build_model_from_spec(spec: str, layers: int | None, device: Any, dtype: Any, seed: int = 0) -> tuple[Any, str]:
    """(causal LM with seeded random weights, a one-line description) for a built-in name or config at `layers`
    decoder layers. The size is computed on the meta device first: a model whose weights would take more than
    half of the free memory is refused with the depth that fits, never built."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    data = model_config(spec)
    total = data.get("num_hidden_layers")
    if not isinstance(total, int) or total < 1:
        raise ValueError(f"model {spec!r}: the config has no num_hidden_layers")
    depth = default_layers(data) if layers is None else layers
    if not 1 <= depth <= total:
        raise ValueError(f"--layers must be between 1 and {total} (the model's depth), got {depth}")
    # Per-layer lists (mlp_only_layers holds indices and is kept) follow the reduced depth.
    data = {k: (v[:depth] if isinstance(v, list) and len(v) == total and k != "mlp_only_layers" else v)
            for k, v in data.items()}
    data["num_hidden_layers"] = depth
    data.pop("torch_dtype", None)
    data["dtype"] = str(dtype).replace("torch.", "")  # transformers builds in the config's dtype: no fp32 copy
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ValueError(f"model {spec!r}: the config states no model_type")
    config = AutoConfig.for_model(model_type, **data)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    width = torch.empty((), dtype=dtype).element_size()
    need = sum(t.numel() for t in (*meta.parameters(), *meta.buffers())) * width
    budget = free_memory(device) // 2
    if need > budget:
        blocks = list(getattr(getattr(meta, "model", None), "layers", None) or [])
        sizes = [sum(p.numel() for p in b.parameters()) * width for b in blocks]
        used, fits = need - sum(sizes), 0
        for size in sizes:  # the deepest prefix of these layers that fits
            used += size
            if used > budget:
                break
            fits += 1
        hint = f"--layers {fits} fits" if fits >= 1 else "not even one layer fits"
        name = str(dtype).replace("torch.", "")
        raise ValueError(f"model {spec!r} at {depth} layers needs about {need / 2**30:.1f} GiB of {name} weights, "
                         f"more than half of the {2 * budget / 2**30:.1f} GiB free on {device.type}; {hint}")
    del meta
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    return model.eval(), f"{spec} ({depth} of {total} layers, random weights, {need / 2**20:.0f} MiB)"
