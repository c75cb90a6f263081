"""docs/PERFORMANCE.md and the README's measured lines from bench/results/: one kept JSON per stage and device.

The page is generated so it cannot drift from the data: each section reads the newest
`bench/results/<stage>_<device>_<YYYY-MM-DD>.json` of its stage for the page's device (one file per stage and
device is kept; git keeps the older ones) and prints the run (date, device, versions, commit), the command that
reproduces it, the same-run peer, the floor, and a table. Every kept file has the keys `stage`, `date`, `device`,
`versions` (torch, triton, transformers), `commit`, `command`, plus what its bench script wrote.

Each benchmark renders its own sections (bench/sections/); this script orders them into the page, checks that
every stage has a section and that each result's command names stages of bench/stages.py that feed it, and
writes or checks the page.

    python bench/report.py                  # rewrite docs/PERFORMANCE.md
    python bench/report.py --check          # exit 1 when the page is not what the results say
    python bench/report.py --ingest DIR [--commit SHA]
        # DIR = an unpacked `bash bench/run_h200.sh STAGES` tarball: each stage's JSON is stamped with the run's
        # versions, date and commit, kept as bench/results/<stage>_<device>_<date>.json (the stage's older file
        # for that device is removed), and the page is rewritten

Plain Python (no torch): the docs test runs it in CI.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import date as _date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/report.py`: the bench package lives at the root
    sys.path.insert(0, str(ROOT))

from bench import stages as stage_table  # noqa: E402
from bench.sections import (  # noqa: E402
    attention,
    coldstart,
    dense,
    e2e,
    forward,
    fusions,
    moe,
    moe_backward,
    offload,
    sampler,
    stream,
)
from bench.sections.markdown import Section  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "PERFORMANCE.md"
DEVICE = "h200"  # the device of the page's main sections; every other device's results follow under its own heading
NAME = re.compile(r"^(?P<stage>[a-z0-9-]+)_(?P<device>[a-z0-9-]+)_(?P<date>\d{4}-\d{2}-\d{2})\.json$")
STAMP = ("stage", "date", "device", "versions", "commit", "command")

SECTIONS: dict[str, Section] = {s.stage: s for mod in (e2e, forward, stream, coldstart, moe, moe_backward, dense,
                                                        attention, fusions, sampler, offload) for s in mod.SECTIONS}
HEADLINES = (e2e.headline, moe.headline, fusions.headline, sampler.headline, offload.headline)  # README order


# ------------------------------------------------------------------------------------------- loading


def devices(folder: Path = RESULTS) -> list[str]:
    """The device slugs with kept results: the page's main device first, the others by name."""
    found = {m["device"] for p in folder.glob("*.json") if (m := NAME.match(p.name))}
    return sorted(found, key=lambda d: (d != DEVICE, d))


def load_results(folder: Path = RESULTS, device: str = DEVICE) -> dict[str, dict[str, Any]]:
    """stage -> its kept result for `device` (with `_file` set). More than one file for a stage and device is an
    error: keep one."""
    found: dict[str, list[Path]] = {}
    for path in sorted(folder.glob("*.json")):
        m = NAME.match(path.name)
        if not m:
            raise ValueError(f"{path}: result files are named <stage>_<device>_<YYYY-MM-DD>.json")
        if m["device"] == device:
            found.setdefault(m["stage"], []).append(path)
    out = {}
    for stage, paths in found.items():
        if len(paths) > 1:
            raise ValueError(f"stage {stage!r} has {len(paths)} result files {[p.name for p in paths]}: keep the "
                             "newest only (git keeps the others)")
        data = json.loads(paths[0].read_text())
        missing = [k for k in STAMP if k not in data]
        if missing or data["stage"] != stage:
            raise ValueError(f"{paths[0]}: missing keys {missing} or stage {data.get('stage')!r} != {stage!r}")
        data["_file"] = paths[0].relative_to(ROOT).as_posix()
        out[stage] = data
    return out


def check_commands(results: dict[str, dict[str, Any]]) -> None:
    """Every `bash bench/run_h200.sh STAGE` a result names is a stage of bench/stages.py that feeds its section."""
    for name, r in results.items():
        for called in re.findall(r"bash bench/run_h200\.sh ([\w-]+)", r.get("command") or ""):
            feeds = stage_table.stage(called).section
            if feeds != name:
                raise ValueError(f"{r['_file']}: its command runs stage {called!r}, which feeds section {feeds!r}, "
                                 f"not {name!r} (bench/stages.py)")


# ------------------------------------------------------------------------------------------------ page

HEADER = """# Performance

Current results only, generated by `bench/report.py` from the one kept JSON per stage in `bench/results/`
(do not edit by hand: `python bench/report.py` rewrites this page, and a test checks it). Each section names the
run (date, device, versions, commit), the command that reproduces it, the same-run peer and the floor. What was
tried and did not work, with its measurements: [FINDINGS.md](FINDINGS.md). Older runs are in git history.

Unless a section says otherwise, the bench scripts check correctness first, time with CUDA events around
CUDA-graph replays, and report medians.
"""

WORKLOADS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("End to end", ("e2e", "ttft", "forward", "coldstart", "stream")),
    ("MoE experts", ("moe", "moe-vllm-peer", "moe-bounds", "moe-backward")),
    ("Dense linears", ("dense",)),
    ("Decode attention", ("attention",)),
    ("Fusions", ("fusions",)),
    ("Sampling", ("sampler",)),
    ("Offload", ("offload",)),
)


def render(results: dict[str, dict[str, Any]], others: dict[str, dict[str, dict[str, Any]]] | None = None) -> str:
    """docs/PERFORMANCE.md from the kept results of the main device, then each other device's (`others`: device
    slug -> its results) under a heading of its own; ValueError when a stage has no section or names a wrong stage."""
    unplaced = sorted(set(SECTIONS) - {s for _, group in WORKLOADS for s in group})
    if unplaced:
        raise ValueError(f"sections {unplaced} have no place in bench/report.py's WORKLOADS")
    parts = [HEADER]
    for title, group in WORKLOADS:
        got = _sections(results, group)
        parts.append(f"## {title}\n\n" + ("\n".join(got) if got else "No kept result yet.\n"))
    for kept in (others or {}).values():
        device = next(iter(kept.values()))["device"]
        got = [section for _, group in WORKLOADS for section in _sections(kept, group)]
        parts.append(f"## On the {device}\n\nEvery number here was measured on this device, its peer in the same "
                     "run; compare it with the sections above only through the ratios to their peers.\n\n"
                     + "\n".join(got))
    return "\n".join(parts).rstrip() + "\n"


def _sections(results: dict[str, dict[str, Any]], group: tuple[str, ...]) -> list[str]:
    unknown = sorted(set(results) - set(SECTIONS))
    if unknown:
        raise ValueError(f"no section renders stages {unknown}; add one to bench/sections/")
    check_commands(results)
    return [SECTIONS[s].markdown(results) for s in group if s in results]


def render_all(folder: Path = RESULTS) -> str:
    """The page from every device's kept results."""
    slugs = devices(folder)
    others = {d: load_results(folder, d) for d in slugs if d != DEVICE}
    return render(load_results(folder), others)


def headline(results: dict[str, dict[str, Any]]) -> list[str]:
    """The README's measured lines, end to end first, from the same data as the page."""
    return [line for lines in HEADLINES for line in lines(results)]


# ------------------------------------------------------------------------------------------------ ingest


def stage_outputs() -> dict[str, list[str]]:
    """section -> the files its run_h200.sh stage leaves in the results folder (bench/stages.py's `keeps`)."""
    return {s.section: list(s.keeps) for s in stage_table.STAGES if s.keeps and s.section}


def merge_e2e(paths: list[Path]) -> dict[str, Any]:
    """One e2e result from the files its stages write (`e2e_<layers>l<tag>.json`, one per depth and batch set)."""
    runs_ = [json.loads(p.read_text()) for p in paths]
    first = runs_[0]
    return {**first, "decode": [row for r in runs_ for row in r["decode"]],
            "prefill": [row for r in runs_ for row in r.get("prefill") or []],
            "ttft": [row for r in runs_ for row in r.get("ttft") or []],
            "forward": [row for r in runs_ for row in r.get("forward") or []],
            "train": [row for r in runs_ for row in r.get("train") or []],
            "extra": _merged_extra(runs_),
            "commit": ", ".join(dict.fromkeys(str(r.get("commit")) for r in runs_)),
            "command": " and ".join(dict.fromkeys(r["command"] for r in runs_))}


def _merged_extra(runs_: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs' `extra`, the first run's winning; per-shape forward checks of every run kept together."""
    merged: dict[str, Any] = {}
    for r in reversed(runs_):
        merged.update(r.get("extra") or {})
    errs = {k: v for r in runs_ for k, v in ((r.get("extra") or {}).get("forward_logits_rel_err") or {}).items()}
    if errs:
        merged["forward_logits_rel_err"] = errs
    return merged


def _coldstart_stage(path: Path) -> tuple[int, str]:
    """coldstart_<layers>l[_<tag>].json -> (layers, its run_h200.sh stage: coldstart, coldstart-48[-b16])."""
    m = re.fullmatch(r"coldstart_(\d+)l(?:_(\w+))?", path.stem)
    layers, tag = (int(m[1]), m[2]) if m else (0, None)
    return layers, "coldstart" + ("" if layers == 8 else f"-{layers}") + (f"-{tag}" if tag else "")


def _stage_command(stage: str, paths: list[Path]) -> str:
    """The run_h200.sh call(s) that wrote these files."""
    if stage == "coldstart":
        return " and ".join(f"bash bench/run_h200.sh {_coldstart_stage(p)[1]}" for p in paths)
    if stage == "stream" and paths[0].stem.endswith("_cached"):
        return "bash bench/run_h200.sh stream-prime and bash bench/run_h200.sh stream-cached (the next call)"
    return f"bash bench/run_h200.sh {stage}"


def ingest(folder: Path, commit: str | None, day: str | None) -> list[Path]:
    """Keep each stage's output from an unpacked run_h200.sh results folder; returns the files written."""
    vt = (folder / "versions.txt").read_text().split()
    vers = {vt[i]: vt[i + 1] for i in range(0, 6, 2)}
    device = " ".join(vt[6:]) or "unknown device"
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower().replace("nvidia", "")).strip("-") or "device"
    day = day or _date.today().isoformat()
    written = []
    stages: dict[str, list[Path]] = {stage: [folder / f for f in files] for stage, files in stage_outputs().items()}
    # TTFT runs (`--tag _ttft`) and forward runs (`--tag _forward...`) are kept apart from the decode runs: a stage's
    # kept result replaces the last one.
    e2e_files = sorted(folder.glob("e2e_*.json"))
    stages["ttft"] = [p for p in e2e_files if p.stem.endswith("_ttft")]
    stages["forward"] = [p for p in e2e_files if "_forward" in p.stem]
    stages["e2e"] = [p for p in e2e_files if not p.stem.endswith("_ttft") and "_forward" not in p.stem]
    stages["coldstart"] = sorted(folder.glob("coldstart_*.json"), key=_coldstart_stage)  # by depth
    # stream-prime only fills the compile caches for stream-cached: the kept run is the whole stream
    stages["stream"] = [p for p in sorted(folder.glob("stream_*.json")) if not p.stem.endswith("_prime")][:1]
    for stage, paths in stages.items():
        if not paths or not all(p.exists() for p in paths):
            continue
        if stage in ("e2e", "ttft", "forward"):
            data = merge_e2e(paths)
        elif stage == "coldstart":
            runs_ = [json.loads(p.read_text()) for p in paths]
            data = {**runs_[0], "runs": runs_, "command": " and ".join(r["command"] for r in runs_)}
        elif stage == "moe-bounds":
            data = {"probe_read": json.loads(paths[0].read_text()), "probe_ceilings": json.loads(paths[1].read_text())}
        else:
            data = json.loads(paths[0].read_text())
        command = data["command"] if stage in ("e2e", "ttft", "forward") else _stage_command(stage, paths)
        data = {**data, "stage": stage, "date": day, "device": device, "versions": vers,
                "commit": commit or data.get("commit"), "command": command}
        for old in RESULTS.glob(f"{stage}_{slug}_*.json"):  # this device's older file; other devices keep theirs
            old.unlink()
        out = RESULTS / f"{stage}_{slug}_{day}.json"
        out.write_text(json.dumps(data, indent=1) + "\n")
        written.append(out)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if docs/PERFORMANCE.md is not up to date")
    p.add_argument("--ingest", type=Path, help="an unpacked run_h200.sh results folder")
    p.add_argument("--commit", help="the commit the ingested run measured")
    p.add_argument("--date", help="the ingested run's date (default: today)")
    args = p.parse_args(argv)
    if args.ingest:
        for path in ingest(args.ingest, args.commit, args.date):
            print(f"kept {path.relative_to(ROOT)}")
    page = render_all()
    if args.check:
        if PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is not what bench/report.py generates: run `python bench/report.py`")
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
