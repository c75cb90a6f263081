"""The forward section of bench/e2e.py's kept results (stage `forward`): the optimized model's own forward against
`torch.compile(model.forward, dynamic=True)` and the engine's time to first token, and the training step."""

from __future__ import annotations

from typing import Any

from bench.sections import kernel_kinds as kinds
from bench.sections.e2e import ROUTING_NOTE, routing_cell
from bench.sections.markdown import Section, num, ratio, section, table

FORWARD_ARMS = {
    "hf_compiled": "`torch.compile(model.forward, dynamic=True)` on the plain model, `logits_to_keep=1` (the peer)",
    "moefx_forward": "`model(input_ids=ids, logits_to_keep=1)` after `moefx.optimize(model)`: the engine's padded "
                     "prefill, replayed from a CUDA graph per bucket key (moefx/engine/forward.py)",
    "moefx_ttft": "`generate(ids, max_new_tokens=1)` on the same optimized model (the engine's time to first token)",
    "moefx_ttft_in_layers": "as `moefx_ttft`, the prompt's keys and values written into the cache by the padded "
                            "prefill's layer bodies instead of copied there after its forward (`write_in_layers` on, "
                            "buckets up to `IN_LAYERS_MAX_BUCKET`; its graphs captured again in the same process)",
    "moefx_ttft_copies": "as `moefx_ttft`, the prompt's keys and values copied into the cache after the padded "
                         "prefill's forward (`write_in_layers` off; its graphs captured again in the same process)",
}
TRAIN_ARMS = {
    "hf_compiled": "`torch.compile(model.forward, dynamic=True)`, then `loss.backward()` and an AdamW step (the peer)",
    "moefx": "`moefx.optimize(model)`, then the model's forward (a call with gradients runs the compiled forward), "
             "`loss.backward()` and an AdamW step",
}


def render_forward(r: dict[str, Any]) -> str:
    """The forward table (each shape: the peer, moefx's forward, the engine's TTFT) and the training-step table."""
    rows_in = r.get("forward") or []
    if not rows_in:
        return ""
    key = lambda t: (t["layers"], t["B"], t["tokens"])  # noqa: E731
    peer = {key(t): t["ms"] for t in rows_in if t["arm"] == "hf_compiled"}
    ttft = {key(t): t["ms"] for t in rows_in if t["arm"] == "moefx_ttft"}
    rows = [(t["layers"], f"{t['B']} × {t['tokens']}", f"`{t['arm']}`", num(t.get("ms"), 1),
             ratio(t.get("ms"), peer.get(key(t))) if t["arm"] != "hf_compiled" else "–",
             ratio(t.get("ms"), ttft.get(key(t))) if t["arm"] == "moefx_forward" else "–",
             num(t.get("flop_floor_ms"), 1), num(t.get("bytes_floor_ms"), 1), num(t.get("x_floor"), 2),
             num(t.get("kernel_ms"), 1), t.get("kernels", "–"), routing_cell(t), num(t.get("first_call_s"), 1))
            for t in sorted(rows_in, key=lambda t: (*key(t), list(FORWARD_ARMS).index(t["arm"])
                                                    if t["arm"] in FORWARD_ARMS else 9))]
    body = table(["layers", "B × tokens", "arm", "ms", "× peer", "× TTFT", "FLOP floor ms", "bytes floor ms",
                  "× floor", "kernel ms", "kernels", "experts hit / layer", "first call s"], rows)
    body += "\n\nArms:\n" + "\n".join(f"- `{a}`: {FORWARD_ARMS.get(a, a)}"
                                       for a in dict.fromkeys(t["arm"] for t in rows_in))
    extra = r.get("extra") or {}
    errs = extra.get("forward_logits_rel_err")
    if errs:
        body += ("\n\nmoefx forward's last-position logits against the peer's (relative error, bf16): "
                 + ", ".join(f"{k} {v:.3g}" for k, v in errs.items()) + ".")
    train = r.get("train") or []
    if train:
        tpeer = {(t["layers"], t["B"], t["tokens"]): t["ms"] for t in train if t["arm"] == "hf_compiled"}
        trows = [(t["layers"], f"{t['B']} × {t['tokens']}", t.get("dtype", "–"), f"`{t['arm']}`", num(t["ms"], 1),
                  ratio(t["ms"], tpeer.get((t["layers"], t["B"], t["tokens"]))) if t["arm"] != "hf_compiled"
                  else "–", f"{t['loss']:.5f}", num(t.get("first_call_s"), 1)) for t in train]
        body += ("\n\nTraining step (AdamW on the experts' weights, the rest frozen; the loss of the first step, same "
                 "weights and tokens in every arm):\n\n"
                 + table(["layers", "B × tokens", "dtype", "arm", "ms per step", "× peer", "loss", "first step s"],
                         trows))
        body += "\n\nArms:\n" + "\n".join(f"- `{a}`: {TRAIN_ARMS.get(a, a)}"
                                           for a in dict.fromkeys(t["arm"] for t in train))
        checks = [f"{what} {extra[key]:.3g}" for key, what in (
            ("train_loss_rel_diff", "first-step losses apart by (relative)"),
            ("train_grad_norm_max_rel_diff", "first-step gradient norms of the expert weights apart by at most "
                                             "(relative)")) if extra.get(key) is not None]
        if checks:
            body += "\n\nSame weights and tokens in both arms: " + "; ".join(checks) + "."
    body += "\n\n" + ROUTING_NOTE
    ceil = r.get("ceilings") or {}
    prefill = render_prefill_tables(r)
    if prefill:
        body += "\n\n" + prefill
    return "\n" + section(
        "Forward", r, what="The optimized model's own forward over a prompt of B × tokens (`logits_to_keep=1`: "
        "scoring, evaluation, a user's loop), median of 3 after a warm-up call, all arms in one process; `× TTFT` = "
        "the forward's time over the engine's time to first token at that size.",
        peer="`hf_compiled` in the same run", body=body,
        floor=f"as for time to first token: the larger of the prefill's FLOPs / "
              f"{num(ceil.get('bf16_matmul_TFLOPs'), 0)} TFLOP/s and the weight bytes it reads / "
              f"{num(ceil.get('hbm_copy_TBps'), 2)} TB/s")


PREFILL_ONCE = "once per forward (embedding, LM head, sampling)"
PREFILL_OTHER = "other (copies, memsets, torch's elementwise kernels)"


def render_prefill_tables(r: dict[str, Any]) -> str:
    """The prefill step tables (bench/e2e.py --prefill-table): per depth and shape, the optimized forward's kernels
    by kind against each kind's bytes and FLOP floors, the gaps, the host time before the first kernel."""
    extra = r.get("extra") or {}
    ceil = r.get("ceilings") or {}
    copy_bps, flops = (ceil.get("hbm_copy_TBps") or 0) * 1e12, (ceil.get("bf16_matmul_TFLOPs") or 0) * 1e12
    out = []
    for key in sorted(k for k in extra if k.startswith("prefill_profile_")):
        layers = int(key.rsplit("_", 1)[1])
        arms = extra[key]
        main = arms.get("moefx_forward") or next(iter(arms.values()))
        arm = "moefx_forward" if "moefx_forward" in arms else next(iter(arms))
        rows, losses = [], []
        for shape, prof in main.items():
            b, t = (int(x) for x in shape.split("x"))
            part_rows, loss = _prefill_rows(prof, layers, b, t, copy_bps, flops)
            rows += [(f"{b} × {t}", *cells) for cells in part_rows]
            losses.append((shape, loss))
        notes = [f"{shape}: the largest loss is {name}, {num(ms, 2)} ms over its floor" for shape, (name, ms)
                 in losses if name]
        host = [f"`{a}` {shape}: {num(p.get('host_before_first_kernel_us'), 0)} µs from the call to the first "
                f"kernel, {num(p.get('host_us'), 0)} µs on the host" for a, shapes in arms.items()
                for shape, p in shapes.items() if a != arm]
        out.append(f"Where the {layers}-layer prefill goes (`{arm}`, one call of each shape under torch.profiler after "
                   "the timed runs; kernels by kind as in bench/sections/kernel_kinds.py; floors: the bytes each part "
                   f"must move / {num(ceil.get('hbm_copy_TBps'), 2)} TB/s and its FLOPs / "
                   f"{num(ceil.get('bf16_matmul_TFLOPs'), 0)} TFLOP/s, the kinds' shapes at Qwen3-30B-A3B widths; "
                   "gaps = the span from the first kernel's start to the last one's end less the time a kernel ran; "
                   "host before the first kernel = the call's start on the host to the first kernel's start):\n\n"
                   + table(["B × tokens", "part", "ms", "kernels", "bytes floor ms", "FLOP floor ms", "× floor"], rows)
                   + ("\n\n" + "\n".join(f"- {n}" for n in notes) if notes else "")
                   + ("\n\nThe same for the other profiled arms: " + "; ".join(host) + "." if host else ""))
    return "\n\n".join(out)


def _prefill_rows(prof: dict[str, Any], layers: int, batch: int, tokens: int, copy_bps: float,
                  flops: float) -> tuple[list[tuple], tuple[str | None, float]]:
    """One shape's rows (part, ms, kernels, bytes floor ms, FLOP floor ms, x floor) and its largest loss."""
    parts: dict[str, list[float]] = {}
    for name, us, count in prof.get("kernels") or []:
        kind = kinds.classify(name)
        if kind != kinds.OTHER and count % layers:
            kind = kinds.ONCE
        d = parts.setdefault(kind, [0.0, 0])
        d[0] += us / 1e3
        d[1] += count
    floors = kinds.prefill_floors(batch, tokens, layers, float(prof.get("experts_hit") or 8.0))
    rows, loss = [], (None, 0.0)
    order = [k.key for k in kinds.KINDS] + [kinds.ONCE, kinds.OTHER]
    for kind in [k for k in order if k in parts or k in floors]:
        ms, count = parts.get(kind, (0.0, 0))
        nbytes, nflops = floors.get(kind, (0.0, 0.0))
        bytes_ms = 1e3 * nbytes / copy_bps if copy_bps and nbytes else None
        flop_ms = 1e3 * nflops / flops if flops and nflops else None
        floor = max(bytes_ms or 0.0, flop_ms or 0.0)
        label = (kinds.BY_KEY[kind].short if kind in kinds.BY_KEY
                 else PREFILL_ONCE if kind == kinds.ONCE else PREFILL_OTHER)
        if ms - floor > loss[1]:
            loss = (label, ms - floor)
        rows.append((label, num(ms, 2), count, num(bytes_ms, 2), num(flop_ms, 2),
                     num(ms / floor, 1) if floor and count else "–"))  # no kernel: fused into another part
    span, busy = prof.get("kernel_span_us"), prof.get("kernel_busy_us")
    gaps = None if span is None or busy is None else (span - busy) / 1e3
    if gaps is not None and gaps > loss[1]:
        loss = ("the gaps between kernels", gaps)
    rows.append(("all kernels (busy)", num(busy / 1e3 if busy is not None else None, 2),
                 sum(c for _, c in parts.values()), "–", "–", "–"))
    rows.append(("gaps between kernels", num(gaps, 2), "–", "–", "–", "–"))
    before = prof.get("host_before_first_kernel_us")
    rows.append(("host before the first kernel", num(before / 1e3 if before is not None else None, 2), "–", "–", "–",
                 "–"))
    rows.append(("the timed call (median)", num(prof.get("ms"), 2), "–", "–", "–", "–"))
    return rows, loss


SECTIONS = (Section("forward", render_forward),)
