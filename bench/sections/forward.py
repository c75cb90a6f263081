"""The forward section of bench/e2e.py's kept results (stage `forward`): the optimized model's own forward against
`torch.compile(model.forward, dynamic=True)` and the engine's time to first token, and the training step."""

from __future__ import annotations

from typing import Any

from bench.sections.e2e import ROUTING_NOTE, routing_cell
from bench.sections.markdown import Section, num, ratio, section, table

FORWARD_ARMS = {
    "hf_compiled": "`torch.compile(model.forward, dynamic=True)` on the plain model, `logits_to_keep=1` (the peer)",
    "moefx_forward": "`model(input_ids=ids, logits_to_keep=1)` after `moefx.optimize(model)`: the engine's padded "
                     "prefill, replayed from a CUDA graph per bucket key (moefx/engine/forward.py)",
    "moefx_ttft": "`generate(ids, max_new_tokens=1)` on the same optimized model (the engine's time to first token)",
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
    return "\n" + section(
        "Forward", r, what="The optimized model's own forward over a prompt of B × tokens (`logits_to_keep=1`: "
        "scoring, evaluation, a user's loop), median of 3 after a warm-up call, all arms in one process; `× TTFT` = "
        "the forward's time over the engine's time to first token at that size.",
        peer="`hf_compiled` in the same run", body=body,
        floor=f"as for time to first token: the larger of the prefill's FLOPs / "
              f"{num(ceil.get('bf16_matmul_TFLOPs'), 0)} TFLOP/s and the weight bytes it reads / "
              f"{num(ceil.get('hbm_copy_TBps'), 2)} TB/s")


SECTIONS = (Section("forward", render_forward),)
