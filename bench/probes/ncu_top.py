"""Summarize an Nsight Compute report for the moe-ncu-stalls stage: per kernel, warp stall reasons (cycles per issued
instruction) and the SASS lines with the most stall samples (--page source needs SourceCounters in the report).
Usage: python3 bench/probes/ncu_top.py REPORT.ncu-rep [lines]"""

from __future__ import annotations

import csv
import io
import subprocess
import sys


def ncu_csv(rep: str, *args: str) -> list[list[str]]:
    out = subprocess.run(["ncu", "--import", rep, "--csv", *args], capture_output=True, text=True).stdout
    return list(csv.reader(io.StringIO(out[out.find('"'):])))


def main() -> None:
    rep, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30
    rows = ncu_csv(rep, "--page", "raw")
    if rows:
        head = rows[0]
        keep = [i for i, h in enumerate(head) if h.startswith("smsp__average_warp") and "issue_stalled" in h]
        for r in rows[2:]:
            name = r[head.index("Kernel Name")] if "Kernel Name" in head else r[4]
            vals = sorted(((float(r[i].replace(",", "")), head[i]) for i in keep if r[i] not in ("", "n/a")),
                          reverse=True)
            print(f"== {name[:40]}: warp cycles per issued instruction by stall reason")
            for v, h in vals[:12]:
                print(f"   {v:8.2f}  {h.split('issue_stalled_')[1]}")
    src = ncu_csv(rep, "--page", "source", "--print-source", "sass")
    at = next((i for i, r in enumerate(src) if any(h.startswith("Warp Stall Sampling (All") for h in r)), None)
    if at is None:
        print("no stall samples on the source page; its first rows:", src[:3])
        return
    head = src[at]
    col = next(i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All"))
    text = head.index("Source") if "Source" in head else 1

    def samples(r: list[str]) -> float:
        try:
            return float(r[col].replace(",", ""))
        except (ValueError, IndexError):
            return 0.0

    body = [r for r in src[at + 1:] if len(r) == len(head)]
    total = sum(map(samples, body)) or 1.0
    print(f"== top {top} SASS lines by stall samples (of {total:.0f})")
    for r in sorted(body, key=samples, reverse=True)[:top]:
        print(f"  {100 * samples(r) / total:5.1f}%  {r[0][:10]}  {r[text][:100]}")


if __name__ == "__main__":
    main()
