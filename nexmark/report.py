"""Summaries, tables, timelines and plots of open-loop runs (``bench/nexmark_bench.py``, ``bench/migration.py``)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .metrics import INTERVAL, Timeline, quantiles


@dataclass
class Summary:
    """The merged result of one run over all workers."""

    label: str
    rate: int
    duration: float
    workers: int
    sent: int
    produced: int
    elapsed: float  # seconds until the last worker saw its output complete
    cpu: float  # CPU seconds used by all workers during the run
    overall: list[float]  # latency quantiles (s): p25 p50 p75 p95 p99 p99.9 max
    timeline: list[tuple[float, float, float, float, int]]  # (t, p50, p99, max, samples) per 250 ms
    acked: list[int]  # records acknowledged per 250 ms of wall time
    peak_rss: list[int]  # per worker, bytes (largest RSS sample)
    steps: list[dict] = field(default_factory=list)
    gc_counts: list[int] = field(default_factory=lambda: [0, 0, 0])  # collections per generation, all workers
    gc_long: list[tuple[int, float, int, float]] = field(default_factory=list)  # (worker, start s, generation, s)
    migration: dict[int, dict[str, Any]] = field(default_factory=dict)  # per migration: migration_metrics
    query: str = ""
    strategy: str | None = None  # the migration strategy, if any

    @property
    def throughput(self) -> float:
        """Records per second from the start until the output was complete."""
        return self.sent / self.elapsed if self.elapsed else 0.0

    @property
    def per_cpu_second(self) -> float:
        """Records per CPU second (all workers): what one fully busy core would sustain at this load."""
        return self.sent / self.cpu if self.cpu else 0.0

    @property
    def drain(self) -> float:
        """Seconds between the end of the input schedule and the end of the output."""
        return max(0.0, self.elapsed - self.duration)

    @property
    def sustained(self) -> bool:
        """The run kept up: the output finished within 1 s of the schedule and p99 stayed under 1 s."""
        return self.drain < 1.0 and not (self.overall[4] > 1.0)


def summarise(label: str, spec: Any, results: list[dict]) -> Summary:
    """Merge the per-worker results of a run."""
    tl = Timeline.merged([r["timeline"] for r in results])
    width = max(len(r["acked_per_interval"]) for r in results)
    acked = [sum(r["acked_per_interval"][i] for r in results if i < len(r["acked_per_interval"])) for i in range(width)]
    s = Summary(label=label, rate=spec.rate, duration=spec.duration, workers=len(results),
                sent=sum(r["sent"] for r in results), produced=sum(r["produced"] for r in results),
                elapsed=max(r["elapsed"] for r in results), cpu=sum(r.get("cpu", 0.0) for r in results),
                overall=quantiles(tl.overall), timeline=tl.rows(),
                acked=acked, peak_rss=[r["peak_rss"] for r in results],
                steps=[st for r in results for st in r["steps"]],
                gc_counts=[sum(r["gc"]["counts"][g] for r in results) for g in range(3)],
                gc_long=sorted((r["worker"], *x) for r in results for x in r["gc"]["long"]))
    s.migration = migration_metrics(s)
    s.query, s.strategy = spec.query, spec.migration
    return s


def migration_metrics(s: Summary) -> dict[int, dict[str, Any]]:
    """Steps, duration (its start to the last completion) and latency around it, per migration:
    ``max_latency`` is the maximum and ``p99_latency`` the worst p99 of the timeline's 250 ms
    buckets of scheduled time that begin from one bucket before its start to one bucket after the
    last completion (so records scheduled up to 0.25 s before and 0.5 s after count). A migration
    starts at its first step's copy ahead, where copied ahead (as ``bench/migration.py``
    counts it), else at its first issue."""
    by_mig: dict[int, list[dict]] = {}
    for st in s.steps:
        by_mig.setdefault(st["migration"], []).append(st)
    out = {}
    for mid, steps in sorted(by_mig.items()):
        issued = [st["issued_rel"] for st in steps if st["issued_rel"] is not None]
        done = [st["completed_rel"] for st in steps if st["completed_rel"] is not None]
        if not issued:
            continue
        start = min(issued + [st["copy_rel"] for st in steps if st.get("copy_rel") is not None])
        end = max(done) if len(done) == len(steps) else None
        hi = (end if end is not None else s.duration) + INTERVAL
        during = [r for r in s.timeline if start - INTERVAL <= r[0] <= hi]
        out[mid] = {
            "steps": len(steps), "bins": sum(len(st["moves"]) for st in steps), "start": start,
            "duration": None if end is None else end - start,
            "max_latency": max((r[3] for r in during), default=float("nan")),
            "p99_latency": max((r[2] for r in during), default=float("nan")),
            "max_step": max((st["duration"] or 0.0 for st in steps), default=0.0),
        }
    return out


def fmt_s(x: float | None) -> str:
    """Seconds as a short human string (us/ms/s)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x < 1e-3:
        return f"{x * 1e6:.0f}us"
    if x < 1:
        return f"{x * 1e3:.1f}ms"
    return f"{x:.2f}s"


def align(lines: list[list[str]]) -> str:
    """Rows of cells as text columns: the first left-aligned, the others right; a rule under the head."""
    widths = [max(len(r[i]) for r in lines) for i in range(len(lines[0]))]
    out = []
    for j, r in enumerate(lines):
        out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def table(rows: list[Summary]) -> str:
    """The summary table of several runs."""
    head = ["run", "workers", "rate/s", "throughput/s", "per worker/s", "per CPU-s", "p50", "p99", "p99.9", "max", "drain",
            "ok", "migr. max", "migr. dur", "peak RSS"]
    lines = [head]
    for s in rows:
        mig = list(s.migration.values())
        lines.append([
            s.label, str(s.workers), f"{s.rate:,}", f"{s.throughput:,.0f}", f"{s.throughput / s.workers:,.0f}",
            f"{s.per_cpu_second:,.0f}",
            fmt_s(s.overall[1]), fmt_s(s.overall[4]), fmt_s(s.overall[5]), fmt_s(s.overall[6]), fmt_s(s.drain),
            "yes" if s.sustained else "NO",
            " / ".join(fmt_s(m["max_latency"]) for m in mig) or "-",
            " / ".join(fmt_s(m["duration"]) for m in mig) or "-",
            f"{max(s.peak_rss) / 2**20:,.0f} MiB",
        ])
    return align(lines)


def median(xs: Sequence[float | None]) -> float:
    """The median of the finite values (NaN if none)."""
    xs = sorted(x for x in xs if x is not None and not math.isnan(x))
    if not xs:
        return float("nan")
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def median_table(groups: list[list[Summary]]) -> str:
    """One line per configuration (a group of repeated runs): the median of each figure over its
    runs, and for a migration the ratio of all-at-once's median maximum latency (same query and
    rate) to this strategy's."""
    def mig(g: list[Summary], key: str) -> float:
        """The median over the runs of ``key`` of their first migration."""
        return median([next(iter(s.migration.values()), {}).get(key) for s in g])

    aao = {(g[0].query, g[0].rate): mig(g, "max_latency") for g in groups if g[0].strategy == "all_at_once"}
    head = ["run", "runs", "rate/s", "throughput/s", "per CPU-s", "p50", "p99", "max", "migr. max", "migr. dur",
            "longest step", "all-at-once / this", "sustained"]
    lines = [head]
    for g in groups:
        s0 = g[0]
        mig_max = mig(g, "max_latency")
        ratio = aao.get((s0.query, s0.rate)) if s0.strategy else None
        lines.append([
            s0.label, str(len(g)), f"{s0.rate:,}", f"{median([s.throughput for s in g]):,.0f}",
            f"{median([s.per_cpu_second for s in g]):,.0f}",
            fmt_s(median([s.overall[1] for s in g])), fmt_s(median([s.overall[4] for s in g])),
            fmt_s(median([s.overall[6] for s in g])),
            fmt_s(mig_max) if s0.strategy else "-", fmt_s(mig(g, "duration")) if s0.strategy else "-",
            fmt_s(mig(g, "max_step")) if s0.strategy else "-",
            f"{ratio / mig_max:.1f}x" if ratio and mig_max and not math.isnan(ratio / mig_max) else "-",
            f"{sum(s.sustained for s in g)}/{len(g)}",
        ])
    return align(lines)


def timeline_text(s: Summary, every: float = INTERVAL) -> str:
    """The per-250 ms timeline (or one line per ``every`` seconds: the worst bucket of each)."""
    lines = ["  t(s)      p50      p99      max   samples"]
    step = max(1, int(round(every / INTERVAL)))
    for i in range(0, len(s.timeline), step):
        chunk = s.timeline[i:i + step]
        lines.append(f"{chunk[0][0]:6.2f} {fmt_s(max(r[1] for r in chunk)):>8} {fmt_s(max(r[2] for r in chunk)):>8} "
                     f"{fmt_s(max(r[3] for r in chunk)):>8} {sum(r[4] for r in chunk):9d}")
    return "\n".join(lines)


def write_csv(s: Summary, path: str) -> None:
    """The per-250 ms timeline as CSV (scheduled time, p50, p99, max, samples; seconds)."""
    with open(path, "w") as f:
        f.write("t,p50,p99,max,samples\n")
        for r in s.timeline:
            f.write(f"{r[0]:.3f},{r[1]:.6f},{r[2]:.6f},{r[3]:.6f},{r[4]}\n")


def plot(s: Summary, path: str, title: str) -> None:
    """A PNG like the paper's timeline figures: latency percentiles per 250 ms (log scale) over the
    records' scheduled time, throughput below, migrations shaded."""
    spans = [(m["start"], m["start"] + (m["duration"] if m["duration"] is not None else INTERVAL), "migration")
             for m in s.migration.values()]
    acked = np.array(s.acked[:int(s.elapsed / INTERVAL) + 2], dtype=float) / INTERVAL
    plot_timelines([{"label": title, "timeline": s.timeline, "spans": spans}], path,
                   throughput=(np.arange(len(acked)) * INTERVAL, acked), xlabel="time [s]")


LINES = (("max", 3, "tab:red"), ("p99", 2, "tab:orange"), ("p50", 1, "tab:blue"))  # (label, row field, colour)


def plot_timelines(panels: Sequence[dict[str, Any]], path: str, title: str = "",
                   throughput: tuple[Any, Any] | None = None, xlabel: str = "scheduled time [s]") -> str:
    """Draw ``panels`` to ``path`` (PNG), stacked with a shared time axis; return ``path``.

    A panel is ``{"label": str, "timeline": rows, "spans": [(lo, hi, label), ...],
    "hlines": [(y seconds, label), ...], "note": str}``; its rows are :meth:`Timeline.rows`
    ``(start s, p50, p99, max, samples)``. Latencies are plotted in milliseconds on a log axis
    shared by all panels. ``throughput`` ``(seconds, records/s)`` adds an axis below, spans shaded.
    matplotlib (the ``bench`` extra) is imported here, with the non-interactive Agg backend.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels) + (throughput is not None)
    ratios = [3] * len(panels) + ([1] if throughput is not None else [])
    fig, axes = plt.subplots(n, 1, figsize=(10, 2.3 * sum(ratios) / 3 + 1.6), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": ratios})
    lo_y, hi_y = np.inf, 0.0
    for ax, panel in zip(axes[:len(panels), 0], panels):
        rows = panel["timeline"]
        x = np.array([r[0] for r in rows]) + INTERVAL / 2
        for label, col, color in LINES:
            y = np.array([r[col] for r in rows], dtype=float) * 1e3
            ax.plot(x, y, label=label, color=color, lw=1.2, drawstyle="steps-mid")
            finite = y[np.isfinite(y) & (y > 0)]
            if len(finite):
                lo_y, hi_y = min(lo_y, finite.min()), max(hi_y, finite.max())
        shades: dict[str, str] = {}  # span label -> grey (the first label darker), labelled once
        for a, b, label in panel.get("spans", []):
            first = label not in shades
            shade = shades.setdefault(label, "0.85" if not shades else "0.92")
            ax.axvspan(a, b, color=shade, zorder=0, label=label if first else None)
        for y, label in panel.get("hlines", []):
            ax.axhline(y * 1e3, color="k", ls="--", lw=0.8, label=label)
        ax.set_yscale("log")
        ax.set_ylabel("latency [ms]")
        ax.set_title(panel["label"] + (f"  ({panel['note']})" if panel.get("note") else ""), fontsize=9, loc="left")
        ax.grid(True, which="major", axis="y", alpha=0.3)
        ax.legend(loc="upper left", fontsize=7, ncol=6)
    if np.isfinite(lo_y):
        for ax in axes[:len(panels), 0]:
            ax.set_ylim(max(lo_y / 2, 1e-2), hi_y * 3)
    if throughput is not None:
        ax = axes[-1, 0]
        ax.plot(throughput[0], np.asarray(throughput[1]) / 1e3, lw=1)
        for a, b, _ in (s for panel in panels for s in panel.get("spans", [])):
            ax.axvspan(a, b, color="0.85", zorder=0)
        ax.set_ylabel("k records/s")
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel(xlabel)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
