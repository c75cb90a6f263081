"""Regenerate the README's generated parts, so they cannot drift from the code and the data.

- `<!-- generated: supported -->`: the "what is supported" table, resolved from the registries (providers, passes,
  calibration tables, device presets) for every published config in `moefx.models.catalog`;
- `<!-- generated: headline -->`: the measured lines, from `bench/results/` through `bench/report.py`;
- `<!-- example: examples/FILE.py#NAME -->` + a fenced block: `# excerpt of examples/FILE.py`, then the code
  between `# [readme:NAME]` and `# [/readme]` in that example (the examples run in CI; the first line says that
  the snippet alone does not run, its file does).

    python scripts/readme.py            # rewrite README.md
    python scripts/readme.py --check    # exit 1 when README.md is not what this script generates
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GENERATED = re.compile(r"(<!-- generated: (?P<name>[a-z]+) -->\n)(?P<body>.*?)(<!-- /generated -->)", re.S)
EXAMPLE = re.compile(r"(<!-- example: (?P<file>[\w/.-]+)#(?P<name>\w+) -->\n```python\n)(?P<body>.*?)(```)", re.S)
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def example_region(path: Path, name: str) -> str:
    """The dedented lines between `# [readme:NAME]` and the next `# [/readme]` of an example."""
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == f"# [readme:{name}]"), None)
    if start is None:
        raise ValueError(f"{path}: no '# [readme:{name}]' marker")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "# [/readme]")
    return textwrap.dedent("\n".join(lines[start + 1 : end])) + "\n"


def _moe_summary(plan, mode: str = "capture") -> str:
    ranges = plan.moe.policy(mode).ranges
    if all(r.backend == "upstream" for r in ranges):
        return "upstream"
    def span(r) -> str:
        if r.max_m is None:
            return f"{r.min_m}+"
        return f"{r.min_m}" if r.min_m == r.max_m else f"{r.min_m}–{r.max_m}"

    return ", ".join(f"{r.backend} {span(r)}" for r in ranges)


def _calibrated(config: dict, preset: str) -> str:
    """The capture-mode MoE ranges at the smallest tensor-parallel size with a calibration row, else upstream."""
    from moefx.signatures import ExecutionSignature, ModelSignature, resolve

    ms = ModelSignature.from_config(config)
    for tp in (1, 2, 4, 8):
        try:
            plan = resolve(ms, ExecutionSignature.preset(preset, mode="capture", tp_size=tp, cpu_isa=(), numa_nodes=1))
        except ValueError:  # a tensor-parallel size that does not divide the model
            continue
        if plan.moe.applies:
            return _moe_summary(plan) + ("" if tp == 1 else f" (TP={tp})")
    return "upstream (no calibration row)"


def supported_table() -> str:
    """Catalog models × what the plan turns on, per device (H200 and H100 with their calibration tables, other GPU
    presets, the CPU), resolved from the registries exactly as `moefx plan NAME --device ...` does."""
    from moefx.facts.execution import DEVICE_PRESETS
    from moefx.models.catalog import catalog_config, catalog_names
    from moefx.signatures import PROVIDERS, ExecutionSignature, ModelSignature, resolve

    cpu = ExecutionSignature(device_type="cpu", mode="compile")
    measured = ("h200", "h100")  # the devices with shipped calibration tables
    others = [p for p in DEVICE_PRESETS if p not in measured]
    rows, covered = [], set()
    for name in catalog_names():
        config = catalog_config(name)
        if name.startswith("tiny"):
            continue
        ms = ModelSignature.from_config(config)
        gpu = resolve(ms, ExecutionSignature.preset("h200", mode="capture", cpu_isa=(), numa_nodes=1))
        covered.add(gpu.profile)
        fp8_config = config if config.get("quantization_config") else {**config, "quantization_config": FP8_BLOCK}
        per_device = []
        for preset in measured:
            per_device += ["–" if config.get("quantization_config") else _calibrated(config, preset),
                           _calibrated(fp8_config, preset)]
        other = sorted({_calibrated(config, p) for p in others})
        rows.append((f"`{name}`", gpu.profile, ", ".join(f"`{p}`" for p in gpu.enabled_passes()) or "none",
                     *per_device, " / ".join(other),
                     ", ".join(f"`{p}`" for p in resolve(ms, cpu).enabled_passes()) or "none"))
    head = ["model (`moefx plan NAME`)", "profile", "passes on CUDA"]
    for preset in measured:
        head += [f"MoE on {preset.upper()} (M ranges), bf16", f"MoE on {preset.upper()}, FP8 block-128"]
    head += [f"MoE on {', '.join(others)}", "passes on CPU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    builtin = {n for n, cls in PROVIDERS.items() if cls.__module__.startswith("moefx.planner.providers.")}
    missing = sorted(builtin - covered)
    if missing:
        lines.append("")
        lines.append("Providers with no catalog config (planned from a model's own config.json): "
                     + ", ".join(f"`{p}`" for p in missing) + ".")
    return "\n".join(lines) + "\n"


def headline() -> str:
    spec = importlib.util.spec_from_file_location("moefx_bench_report", ROOT / "bench" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    lines = report.headline(report.load_results())
    return "".join(f"{line}\n" if line.startswith("  - ") else f"- {line}\n" for line in lines)


def render(text: str) -> str:
    parts = {"supported": supported_table, "headline": headline}

    def generated(m: re.Match) -> str:
        if m["name"] not in parts:
            raise ValueError(f"README: unknown generated part {m['name']!r}; valid: {sorted(parts)}")
        return m.group(1) + parts[m["name"]]() + m.group(4)

    def example(m: re.Match) -> str:
        return m.group(1) + f"# excerpt of {m['file']}\n" + example_region(ROOT / m["file"], m["name"]) + m.group(5)

    return EXAMPLE.sub(example, GENERATED.sub(generated, text))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if README.md is not up to date")
    args = p.parse_args(argv)
    # The table must not depend on this machine's own calibration folder or MoE overrides.
    os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="moefx-readme-")
    for var in ("MOEFX_MOE_BACKEND", "MOEFX_USE_GEMV", "MOEFX_PASSES", "MOEFX_OFFLOAD_EXPERTS"):
        os.environ.pop(var, None)
    sys.path.insert(0, str(ROOT))
    text = README.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print("README.md is not what scripts/readme.py generates: run `python scripts/readme.py`")
            return 1
        return 0
    README.write_text(new)
    print("wrote README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
