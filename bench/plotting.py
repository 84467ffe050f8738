"""Latency timeline plots in the layout of the Megaphone paper's figures (log latency axis).

``plot_timelines(panels, path)``: one panel per configuration, stacked with a shared time axis; each
panel draws the per-bucket p50 / p99 / max lines of a :func:`bench.latency.timeline`, optional
shaded spans (e.g. a migration window) and horizontal reference lines. matplotlib (the ``bench``
extra) is imported only when plotting, with the non-interactive Agg backend.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

LINES = (("max", "max", "tab:red"), ("p99", "p99", "tab:orange"), ("p50", "p50", "tab:blue"))


def plot_timelines(panels: Sequence[dict[str, Any]], path: str, title: str = "",
                   ylabel: str = "latency [ms]", xlabel: str = "scheduled time [s]") -> str:
    """Draw ``panels`` to ``path`` (PNG); return ``path``.

    A panel is ``{"label": str, "timeline": {"start", "p50", "p99", "max"} (seconds),
    "spans": [(lo, hi, label), ...], "hlines": [(y_seconds, label), ...], "note": str}``.
    Latencies are plotted in milliseconds on a log axis shared by all panels.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    n = len(panels)
    fig, axes = plt.subplots(n, 1, figsize=(10, 2.3 * n + 0.8), sharex=True, sharey=True, squeeze=False)
    lo_y, hi_y = np.inf, 0.0
    for ax, panel in zip(axes[:, 0], panels):
        tl = panel["timeline"]
        x = np.asarray(tl["start"]) + 0.5 * (tl["start"][1] - tl["start"][0] if len(tl["start"]) > 1 else 0.25)
        for key, label, color in LINES:
            y = np.asarray(tl[key]) * 1e3
            ax.plot(x, y, label=label, color=color, lw=1.2, drawstyle="steps-mid")
            finite = y[np.isfinite(y) & (y > 0)]
            if len(finite):
                lo_y, hi_y = min(lo_y, finite.min()), max(hi_y, finite.max())
        for i, (a, b, label) in enumerate(panel.get("spans", [])):
            ax.axvspan(a, b, color="0.85" if i == 0 else "0.92", zorder=0, label=label)
        for y, label in panel.get("hlines", []):
            ax.axhline(y * 1e3, color="k", ls="--", lw=0.8, label=label)
        ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.set_title(panel["label"] + (f"  ({panel['note']})" if panel.get("note") else ""), fontsize=9, loc="left")
        ax.grid(True, which="major", axis="y", alpha=0.3)
        ax.legend(loc="upper left", fontsize=7, ncol=6)
    if np.isfinite(lo_y):
        axes[0, 0].set_ylim(max(lo_y / 2, 1e-2), hi_y * 3)
    axes[-1, 0].set_xlabel(xlabel)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
