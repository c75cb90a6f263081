"""The MoE experts sections: bench/moe.py's table (stage `moe`), the cited vLLM check (`moe-vllm-peer`) and the
lower bounds of bench/probe_read.py and bench/probe_ceilings.py (`moe-bounds`); the README's MoE line."""

from __future__ import annotations

from typing import Any

from bench.sections.markdown import Section, num, ratio, runs, section, span, table

# Qwen3-30B-A3B experts, the geometry of bench/moe.py and the probes.
E, H, I, TOP_K = 128, 2048, 768, 8


BF16_EXPERT_BYTES = 2 * (2 * I * H + H * I)


def _moe_ceilings(c: dict[str, float]) -> str:
    return (f"copy {c['copy_Bps'] / 1e12:.2f} TB/s, bf16 matmul {c['bf16_flops'] / 1e12:.0f} TFLOP/s, fp8 "
            f"{c['fp8_flops'] / 1e12:.0f} TFLOP/s")


def moe_summary(r: dict[str, Any]) -> dict[str, Any]:
    """Ratios the page and the README quote: auto vs peers, the points within / over 1.3× of the floor."""
    rows = r["rows"]
    out: dict[str, Any] = {"grid": {}, "within": {}, "over": {}, "vs_triton": {}, "vs_hf": {}}
    for dt in dict.fromkeys(x["dtype"] for x in rows):
        sub = [x for x in rows if x["dtype"] == dt]
        out["grid"][dt] = [x["M"] for x in sub]
        out["within"][dt] = [x["M"] for x in sub if x["auto"] / x["floor_us"] <= 1.3]
        out["over"][dt] = [(x["M"], x["auto"] / x["floor_us"]) for x in sub if x["auto"] / x["floor_us"] > 1.3]
        out["vs_triton"][dt] = [x["auto"] / x["peer_triton_us"] for x in sub if x.get("peer_triton_us")]
        out["vs_hf"][dt] = [x["hf_grouped_mm_compiled"] / x["auto"] for x in sub if x.get("hf_grouped_mm_compiled")]
    return out


def render_moe(r: dict[str, Any]) -> str:
    rows = []
    for x in r["rows"]:
        hf = x.get("hf_grouped_mm_compiled")
        rows.append((x["dtype"], x["M"], num(x["floor_us"]), num(x.get("peer_triton_us")), num(hf),
                     num(x.get("gemv")), num(x.get("grouped")), num(x.get("torch_grouped")),
                     f"**{num(x['auto'])}** ({x['auto_backend']})", ratio(x["auto"], x["floor_us"]),
                     ratio(x["auto"], x.get("peer_triton_us")), ratio(hf, x["auto"])))
    s = moe_summary(r)
    checks = r.get("check") or []
    worst: dict[str, float] = {}
    for c in checks:
        key = f"{c['dtype']} `{c['backend']}`"
        worst[key] = max(worst.get(key, 0.0), c["relerr"])
    failed = sum(1 for c in checks if not c["ok"])
    ms = sorted({c["M"] for c in checks})
    lines = [
        f"- `auto` takes {span(v)}× the Triton fused-MoE peer's time in {dt}" for dt, v in s["vs_triton"].items() if v]
    lines += [f"- `auto` is {span(v, 1)}× faster than transformers' compiled grouped_mm in {dt} (same run)"
              for dt, v in s["vs_hf"].items() if v]
    lines += [f"- within 1.3× of the floor: {dt} M = {runs(v, s['grid'][dt])}" for dt, v in s["within"].items() if v]
    lines += ["- over 1.3×: " + "; ".join(f"{dt} M={m} ({q:.2f})" for dt, v in s["over"].items() for m, q in v)
              + " — the lower bounds below and [FINDINGS.md](FINDINGS.md) say how far each can go"]
    body = table(["dtype", "M", "floor µs", "peer Triton", "HF grouped_mm+compile", "gemv", "grouped",
                  "torch_grouped", "**auto** (pick)", "auto/floor", "auto/peer", "HF/auto"], rows)
    body += ("\n\n" + "\n".join(lines) + f"\n\nCorrectness first, on the GPU against `reference`: {len(checks)} "
             f"backend/input pairs (M = {', '.join(map(str, ms))}), {failed} failed; largest relative error "
             + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()) + ".")
    geo = r.get("geometry", {})
    return section(
        "Experts op `moefx::moe_experts`", r,
        what=f"Qwen3-30B-A3B experts (E={geo.get('E', E)}, H={geo.get('H', H)}, I={geo.get('I', I)}, "
             f"top-{geo.get('top_k', TOP_K)}), random weights and routing, µs per call, CUDA-graph replay of four "
             "rotating input sets (weights come from HBM). `auto` = the capture-mode policy from the calibration "
             "rows that `bench/moe.py --calibrate` wrote in the same run (the shipped ones are in "
             "`moefx/backends/tables/nvidia-h200.yaml`); `gemv`, `grouped`, `torch_grouped` = each backend forced. "
             f"Ceilings measured in the run: {_moe_ceilings(r['ceilings'])}.",
        peer="transformers' `grouped_mm` experts under `torch.compile`, graph-replayed, same run (HF). "
             "\"peer Triton\" = a tuned Triton fused-MoE kernel timed on this machine kind on 2026-11-29 "
             "(`shared/anchors/h200_peers_2026-11-29.json`, kernels only; not re-run in this run; a same-run "
             "comparison with vLLM's Triton kernel follows)",
        floor="max(experts touched × bytes per expert / measured copy rate, 6·M·top_k·H·I FLOP / measured matmul "
              "rate)", body=body)


def render_moe_vllm_peer(r: dict[str, Any]) -> str:
    """A cited measurement, not a table: no command in this repository reproduces it (a harness with vLLM, outside
    this repository, measured it; the H200 machine has no vLLM)."""
    spans = "; ".join(f"{span(x['moefx_over_peer'] for x in r['rows'] if x['dtype'] == dt)}× its time in {dt}"
                      for dt in dict.fromkeys(x["dtype"] for x in r["rows"]))
    ms = sorted({x["M"] for x in r["rows"]})
    return (f"#### A check against vLLM's Triton fused-MoE kernel (not reproducible here)\n\n"
            f"On {r['date']} ({r['device']}, torch {r['versions']['torch']}, moefx at `{r['commit']}`) a harness "
            f"outside this repository timed moefx's experts op and vLLM's Triton fused-MoE kernel in one run at the "
            f"same geometry, M = {ms[0]}–{ms[-1]}: moefx took {spans}. The H200 machine has no vLLM, so no command "
            f"here reproduces it; the numbers are in `{r['_file']}` ({r.get('source', 'source not recorded')}).")


def _pair(rows: list[dict[str, Any]], name: str, m: int) -> tuple[float, float] | None:
    got = {x["name"]: x for x in rows if x["M"] == m}
    a, b = got.get(f"{name} gemm1"), got.get(f"{name} gemm2")
    return (a["us"], b["us"]) if a and b else None


def render_moe_bounds(r: dict[str, Any], moe: dict[str, Any] | None) -> str:
    pr, pc = r["probe_read"], r["probe_ceilings"]
    read = {x["name"]: x for x in pr["rows"]}
    auto = {(x["dtype"], x["M"]): x["auto"] for x in (moe or {}).get("rows", [])}
    cols = [("fp8", 1), ("bf16", 1), ("fp8", 1024), ("bf16", 1024)]

    def cell(name: str) -> str:
        x = read.get(name)
        return "–" if x is None else f"{x['us']:.2f} ({x['us'] / x['floor_us']:.2f})"

    names = {(dt, m): f"{dt} M={m} ({8 if m == 1 else 128} experts)" for dt, m in cols}
    t1 = [("floor (bytes / copy rate)", *(num(read[names[c]]["floor_us"], 2) for c in cols)),
          ("one read-only kernel over those bytes", *(cell(names[c]) for c in cols)),
          ("two dependent read-only kernels (stage-1 bytes, then stage-2 bytes)",
           *(cell(f"{dt} M=1 two dependent reads") if m == 1 else "–" for dt, m in cols))]
    if auto:
        t1.append(("moefx `auto` (the `moe` table: another run)",
                   *(f"{auto[c]:.1f} ({auto[c] / read[names[c]]['floor_us']:.2f})" for c in cols)))
    body = table(["µs (× floor)", *(f"{dt} M={m}" for dt, m in cols)], t1)

    c = pc["ceilings"]
    kinds = [("cuBLAS dense bf16", "cublas bf16", "bf16"),
             ("Triton dense bf16 (TMA, best tile)", "triton dense bf16", "bf16"),
             ("CUTLASS grouped bf16 (`torch._grouped_mm`), real routing", "cutlass grouped bf16", "bf16"),
             ("ours bf16, dense-like routing", "ours dense-like bf16", "bf16"),
             ("ours bf16, real routing", "ours bf16", "bf16"),
             ("cuBLAS dense FP8, block-128 scales", "cublas fp8 block128", "fp8"),
             ("cuBLAS dense FP8, rowwise scales", "cublas fp8 rowwise", "fp8"),
             ("Triton dense FP8, no scales", "triton dense fp8", "fp8"),
             ("ours FP8, dense-like routing", "ours dense-like fp8", "fp8"),
             ("ours FP8, real routing", "ours fp8", "fp8")]

    def floor(dt: str, m: int) -> float:
        bytes_ = E * BF16_EXPERT_BYTES / (2 if dt == "fp8" else 1)
        flops = 6 * m * TOP_K * H * I
        return 1e6 * max(bytes_ / c["copy_Bps"], flops / c[f"{dt}_flops"])

    t2 = []
    for label, key, dt in kinds:
        p1, p4 = _pair(pc["rows"], key, 1024), _pair(pc["rows"], key, 4096)
        if not p4:
            continue
        both1 = f"{sum(p1):.1f} ({sum(p1) / floor(dt, 1024):.2f})" if p1 else "–"
        t2.append((label, both1, f"{p4[0]:.1f}", f"{p4[1]:.1f}", f"{sum(p4):.1f} ({sum(p4) / floor(dt, 4096):.2f})"))
    body += "\n\n" + table(["GEMM 1 + GEMM 2, µs (× floor)", "M=1024 both", "M=4096 GEMM 1", "M=4096 GEMM 2",
                            "M=4096 both"], t2)
    body += (f"\n\nFloors in the second table, from this run's ceilings ({_moe_ceilings(c)}): bf16 M=1024 "
             f"{floor('bf16', 1024):.1f} / M=4096 {floor('bf16', 4096):.1f} µs, FP8 {floor('fp8', 1024):.1f} / "
             f"{floor('fp8', 4096):.1f} µs; at M=1024 a dense GEMM reads one weight matrix, not 128 experts' "
             "weights, so it runs below the MoE's bytes floor. \"Dense-like\" = 8 experts with every token routed "
             "to all 8 (full blocks, weights reused from L2). What these bounds mean for each unmet point: "
             "[FINDINGS.md](FINDINGS.md#moe-experts).")
    return section(
        "Experts op: lower bounds at the unmet points", r,
        what="How low the points over 1.3× can go on this GPU: `bench/probe_read.py` times a read-only Triton kernel "
             "over exactly the bytes a call must read (best of 12 grids, rotating over buffers larger than L2), once "
             "and as two dependent launches; `bench/probe_ceilings.py` times library GEMMs at the same shapes and "
             "FLOPs as GEMM 1 (`[8M, 2048] x [2048, 1536]`) and GEMM 2 (`[8M, 768] x [768, 2048]`), next to ours.",
        peer="cuBLAS dense and CUTLASS grouped (`torch._grouped_mm` on rows pre-sorted by expert, sort untimed), "
             "same run", floor="as in the experts table, with this run's ceilings (its copy rate for the read-only "
                               "probe)", body=body)


def headline(results: dict[str, dict[str, Any]]) -> list[str]:
    """The README's MoE line: `auto` against transformers, the grid points within 1.3× of the floor."""
    moe = results.get("moe")
    if not moe:
        return []
    s = moe_summary(moe)
    return ["MoE experts op (Qwen3-30B-A3B shapes, M = 1–4096): bf16 " + ", ".join(
        f"{span(v, 1)}×" for v in s["vs_hf"].values() if v) + " faster than transformers' compiled "
        "grouped_mm (same run); within 1.3× of the bandwidth/FLOP floor at " + " and ".join(
            f"{dt} M = {runs(v, s['grid'][dt])}" for dt, v in s["within"].items() if v) + "."]


SECTIONS = (Section("moe", render_moe), Section("moe-vllm-peer", render_moe_vllm_peer),
            Section("moe-bounds", render_moe_bounds, reads="moe"))
