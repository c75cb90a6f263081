"""ExecutionSignature: where and how the model runs. `detect()` reads this machine; every field can be set
by hand (or from a device preset) to plan for another machine."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moefx.config import MAX_BATCH_SIZE, MODES, did_you_mean
from moefx.machine import DEVICE_PRESETS  # (torch-free there, so the CLI's help lists the presets at once)

DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps")
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
# CPU ISA extensions the offload path cares about, as /proc/cpuinfo spells them.
CPU_ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_vbmi", "amx_bf16", "amx_int8")
# Published memory of the DEVICE_PRESETS GPUs (GiB), for the serving hints of a plan made without the device at hand.
DEVICE_MEMORY_GIB: dict[str, float] = {
    "NVIDIA H200": 140.0, "NVIDIA H100 80GB HBM3": 79.6, "NVIDIA A100-SXM4-80GB": 79.2, "NVIDIA L40S": 44.5,
    "NVIDIA GeForce RTX 4090": 23.6,
}


def read_cpu_isa(cpuinfo: str | Path = "/proc/cpuinfo") -> tuple[str, ...]:
    """The CPU_ISA_FLAGS present in the first `flags` line of cpuinfo (empty where it cannot be read)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return ()
    match = re.search(r"^flags\s*:\s*(.*)$", text, re.MULTILINE)
    present = set(match.group(1).split()) if match else set()
    return tuple(flag for flag in CPU_ISA_FLAGS if flag in present)


def count_numa_nodes(root: str | Path = "/sys/devices/system/node") -> int:
    """Number of NUMA nodes (1 where the kernel exposes none)."""
    try:
        nodes = [p for p in Path(root).iterdir() if re.fullmatch(r"node\d+", p.name)]
    except OSError:
        return 1
    return max(1, len(nodes))


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


@dataclass(frozen=True)
class ExecutionSignature:
    device_type: str = "cpu"
    device_name: str | None = None
    capability: tuple[int, ...] | None = None
    multiprocessor_count: int | None = None
    torch_version: str = torch.__version__
    triton_version: str | None = None
    dtype: str | None = None
    mode: str = "compile"
    tp_size: int = 1
    ep_size: int = 1
    max_batch_size: int | None = None  # None: no cap given (the plan derives one from memory)
    cpu_isa: tuple[str, ...] = ()
    numa_nodes: int = 1
    # Where tp_size/ep_size came from and this process's ranks (a moefx.parallel.ParallelInfo). Not part of the
    # signature's identity: every rank of one model plans alike.
    parallel: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(f"ExecutionSignature device_type {self.device_type!r} is invalid; valid: {DEVICE_TYPES}")
        if self.mode not in MODES:
            raise ValueError(f"ExecutionSignature mode {self.mode!r} is invalid; valid choices: {list(MODES)}")
        for name in ("tp_size", "ep_size", "max_batch_size", "numa_nodes"):
            value = getattr(self, name)
            if name == "max_batch_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                none = " or None" if name == "max_batch_size" else ""
                raise ValueError(f"ExecutionSignature {name} must be an integer >= 1{none}, got {value!r}")
            if name == "max_batch_size" and value > MAX_BATCH_SIZE:
                raise ValueError(f"ExecutionSignature max_batch_size must be <= {MAX_BATCH_SIZE} (config key "
                                 f"'max_batch_size' has the same bound) or None, got {value!r}")
        if self.capability is not None:
            object.__setattr__(self, "capability", tuple(int(x) for x in self.capability))
        unknown = set(self.cpu_isa) - set(CPU_ISA_FLAGS)
        if unknown:
            raise ValueError(f"ExecutionSignature cpu_isa has unknown flags {sorted(unknown)}; valid: {CPU_ISA_FLAGS}")
        object.__setattr__(self, "cpu_isa", tuple(f for f in CPU_ISA_FLAGS if f in set(self.cpu_isa)))
        if self.dtype is not None:
            from moefx.facts.model import normalize_dtype

            dtype = normalize_dtype(self.dtype)
            if dtype is not None and not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(
                    f"ExecutionSignature dtype {self.dtype!r} is not a torch dtype; valid compute dtypes: "
                    f"{list(COMPUTE_DTYPES)} (aliases bf16, fp16, fp32){did_you_mean(dtype, COMPUTE_DTYPES)}"
                )
            object.__setattr__(self, "dtype", dtype)
        info = self.parallel
        if info is not None and (info.tp_size, info.ep_size) != (self.tp_size, self.ep_size):
            object.__setattr__(self, "parallel", None)  # sizes changed by hand (replace()): the source is stale

    @classmethod
    def detect(
        cls,
        device: str | torch.device | None = None,
        mode: str = "compile",
        tp_size: int | None = None,
        ep_size: int | None = None,
        max_batch_size: int | None = None,
        dtype: torch.dtype | str | None = None,
        model: torch.nn.Module | None = None,
    ) -> ExecutionSignature:
        """This machine's facts for `device` (default: CUDA when available, else CPU).

        tp_size/ep_size left None are read from `model`'s sharding and the torch.distributed process group
        (`moefx.parallel.detect_parallel`); the result's `parallel` says where they came from."""
        from moefx.facts.parallel import detect_parallel

        try:
            dev = torch.device(device) if device is not None else torch.device(
                "cuda" if torch.cuda.is_available() else "cpu"
            )
        except RuntimeError:
            raise ValueError(
                f"device {device!r} is invalid; valid choices: 'cpu', 'cuda', 'cuda:N', or a preset to plan for "
                f"another machine: {sorted(DEVICE_PRESETS)}{did_you_mean(str(device).lower(), DEVICE_PRESETS)}"
            ) from None
        name = capability = sms = None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    f"device 'cuda' was requested but no CUDA device is available; to plan for another machine "
                    f"use ExecutionSignature.preset(name) with one of {sorted(DEVICE_PRESETS)}"
                )
            props = torch.cuda.get_device_properties(dev)
            name, capability, sms = props.name, (props.major, props.minor), props.multi_processor_count
        info = detect_parallel(model, tp_size, ep_size)
        return cls(
            device_type=dev.type,
            device_name=name,
            capability=capability,
            multiprocessor_count=sms,
            triton_version=_triton_version(),
            dtype=dtype,  # type: ignore[arg-type]  # normalized in __post_init__
            mode=mode,
            tp_size=info.tp_size,
            ep_size=info.ep_size,
            max_batch_size=max_batch_size,
            cpu_isa=read_cpu_isa(),
            numa_nodes=count_numa_nodes(),
            parallel=info,
        )

    @classmethod
    def preset(cls, name: str, **fields: Any) -> ExecutionSignature:
        """A CUDA signature for a named GPU (see DEVICE_PRESETS); host facts are this machine's."""
        key = name.lower()
        if key not in DEVICE_PRESETS:
            raise ValueError(f"unknown device preset {name!r}; valid presets: {sorted(DEVICE_PRESETS)}")
        base = dict(device_type="cuda", triton_version=_triton_version(), cpu_isa=read_cpu_isa(),
                    numa_nodes=count_numa_nodes(), **DEVICE_PRESETS[key])
        base.update(fields)
        return cls(**base)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExecutionSignature:
        names = {f.name for f in dataclasses.fields(cls) if f.compare}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown ExecutionSignature fields {unknown}; valid fields: {sorted(names)}")
        return cls(**data)

    def replace(self, **changes: Any) -> ExecutionSignature:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The identity fields (not `parallel`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare}

    def key(self) -> str:
        """Stable short hash of every field."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def describe(self) -> str:
        where = self.device_name or self.device_type
        cap = f" sm{self.capability[0]}{self.capability[1]}" if self.capability and len(self.capability) == 2 else ""
        batch = self.max_batch_size or "from memory"
        return f"{where}{cap} mode={self.mode} tp={self.tp_size} ep={self.ep_size} max_batch={batch}"
