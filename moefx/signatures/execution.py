"""ExecutionSignature: where and how the model runs. `detect()` reads the machine; fields can be set by hand."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ExecutionSignature:
    device_type: str = "cpu"
    device_name: str | None = None
    capability: tuple[int, int] | None = None
    multiprocessor_count: int | None = None
    torch_version: str = torch.__version__
    triton_version: str | None = None
    dtype: str | None = None
    mode: str = "compile"
    tp_size: int = 1
    ep_size: int = 1
    max_batch_size: int = 1

    @classmethod
    def detect(
        cls,
        device: str | torch.device | None = None,
        mode: str = "compile",
        tp_size: int = 1,
        ep_size: int = 1,
        max_batch_size: int = 1,
        dtype: torch.dtype | str | None = None,
    ) -> ExecutionSignature:
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu"
        )
        name = capability = sms = None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device 'cuda' was requested but no CUDA device is available")
            props = torch.cuda.get_device_properties(dev)
            name, capability, sms = props.name, (props.major, props.minor), props.multi_processor_count
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = None
        return cls(
            device_type=dev.type,
            device_name=name,
            capability=capability,
            multiprocessor_count=sms,
            triton_version=triton_version,
            dtype=str(dtype).replace("torch.", "") if dtype is not None else None,
            mode=mode,
            tp_size=tp_size,
            ep_size=ep_size,
            max_batch_size=max_batch_size,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
