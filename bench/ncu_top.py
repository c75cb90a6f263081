"""Summarize an Nsight Compute report for the moe-ncu-stalls stage: per kernel, warp stall reasons (cycles per issued
instruction) and the SASS lines with the most stall samples (--page source needs SourceCounters in the report).
Usage: python3 bench/ncu_top.py REPORT.ncu-rep [lines]"""

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
    if not src:
        print("no source page")
        return
    head = src[0]
    print("source page columns:", head[:14])
    col = next((i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All")), None)
    if col is None:
        return
    body = [r for r in src[1:] if len(r) == len(head) and r[col].replace(",", "").replace(".", "").isdigit()]
    total = sum(float(r[col].replace(",", "")) for r in body) or 1.0
    print(f"== top {top} SASS lines by stall samples (of {total:.0f})")
    for r in sorted(body, key=lambda r: -float(r[col].replace(",", "")))[:top]:
        print(f"  {100 * float(r[col].replace(',', '')) / total:5.1f}%  {r[0][:10]}  {r[1][:90]}")


if __name__ == "__main__":
    main()
