"""The latency-vs-M PNG that `moefx calibrate` draws next to its table (needs matplotlib, the `plot` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(path: Path, title: str, results: dict[str, dict[str, dict[int, float]]], ranges: dict[str, Any]) -> bool:
    """Draw the latency-vs-M PNG; False when matplotlib (the `plot` extra) is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for ax, (mode, timings) in zip(axes[0], results.items()):
        for name, ts in sorted(timings.items()):
            ms = sorted(ts)
            ax.plot(ms, [ts[m] for m in ms], marker="o", markersize=3, label=name)
        for r in ranges[mode][:-1]:
            ax.axvline(r.max_m + 0.5, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (token rows per call)")
        ax.set_ylabel("latency, µs (median)")
        ax.set_title(f"{mode}: " + ", ".join(r.text() for r in ranges[mode]), fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


