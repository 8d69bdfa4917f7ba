"""The comparison report: Markdown tables and PNG plots from simulator and fidelity results.

Inputs are the JSON files ``kvgate bench sim`` and ``kvgate bench fidelity`` write (any number,
any mix). Runs are grouped by (scheduler, policy) and plotted against their offered request rate:

* SLO attainment vs rate and p99 TTFT vs rate, one line per router policy (the default local
  scheduler) and one line per local scheduler (the default policy);
* prefix hit rate and load spread (max/mean of requests per engine) per policy;
* the fidelity table: live vs simulated p50/p99 TTFT and their relative error.

Pure apart from reading the inputs and writing the outputs; matplotlib is imported only to plot
(the tables are written without it).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import read_json

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Run:
    """One (policy, scheduler, rate) cell of a sweep, flattened from a result file."""

    source: str
    workload: str
    policy: str
    scheduler: str
    rate_scale: float
    offered_rps: float
    summary: dict
    wall_s: float | None


def load_runs(paths: Sequence[Path]) -> tuple[list[Run], list[dict]]:
    """Runs from simulator results and fidelity records from fidelity results."""
    runs: list[Run] = []
    fidelity: list[dict] = []
    for path in paths:
        data = read_json(path)
        kind = data.get("kind") if isinstance(data, dict) else None
        if kind == "kvgate-fidelity":
            fidelity.append(data)
            continue
        if kind != "kvgate-sim":
            log.warning("report: %s is not a kvgate result file, skipped", path)
            continue
        wl = data.get("workload", {}).get("name", "?")
        for r in data.get("runs", []):
            s = r["summary"]
            runs.append(
                Run(
                    source=str(path),
                    workload=wl,
                    policy=r["policy"],
                    scheduler=r["scheduler"],
                    rate_scale=float(r["rate_scale"]),
                    offered_rps=float(s.get("offered_rps") or 0.0),
                    summary=s,
                    wall_s=r.get("sim", {}).get("wall_s"),
                )
            )
    return runs, fidelity


def _fmt(v: object, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out.extend("| " + " | ".join(r) + " |" for r in rows)
    return "\n".join(out)


def runs_table(runs: Sequence[Run]) -> str:
    """One row per run: the headline figures."""
    rows = []
    for r in sorted(runs, key=lambda r: (r.workload, r.scheduler, r.rate_scale, r.policy)):
        s = r.summary
        rows.append(
            [
                r.workload,
                r.policy,
                r.scheduler,
                f"{r.rate_scale:g}",
                _fmt(r.offered_rps, 2),
                _pct(s.get("slo_attainment")),
                _fmt(s.get("goodput_rps"), 2),
                _fmt(s["ttft_ms"]["p50"], 0),
                _fmt(s["ttft_ms"]["p99"], 0),
                _fmt(s["tpot_ms"]["p99"], 1),
                _pct(s.get("prefix_hit_rate")),
                _fmt(s["load_spread_requests"]["max_over_mean"], 2),
                _fmt(s["load_spread_requests"]["cv"], 2),
            ]
        )
    header = [
        "workload",
        "policy",
        "scheduler",
        "rate x",
        "req/s",
        "SLO att.",
        "goodput req/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TPOT p99 ms",
        "prefix hit",
        "load max/mean",
        "load CV",
    ]
    return _table(header, rows)


def fidelity_table(records: Sequence[dict]) -> str:
    rows = []
    for f in records:
        tol = f.get("tolerance", 0.1)
        sources = [("", f["live"]["ttft_ms"], f["sim"]["ttft_ms"], f["error"])]
        common = f.get("common")
        if common:
            label = f" (the {common['requests']} requests OK in both)"
            sources.append((label, common["live"], common["sim"], common["error"]))
        for suffix, live, sim, errs in sources:
            for q in ("p50", "p99"):
                err = errs[f"ttft_{q}"]
                rows.append(
                    [
                        f.get("label", "fidelity"),
                        f"TTFT {q}{suffix}",
                        _fmt(live[q], 1),
                        _fmt(sim[q], 1),
                        "-" if err is None else f"{100 * err:+.1f}%",
                        "yes" if err is not None and abs(err) <= tol else "NO",
                    ]
                )
    return _table(["run", "metric", "live ms", "sim ms", "sim vs live", "within 10%"], rows)


def _series(runs: Sequence[Run], by: str) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        out[getattr(r, by)].append(r)
    for v in out.values():
        v.sort(key=lambda r: r.offered_rps)
    return dict(sorted(out.items()))


def _default_of(runs: Sequence[Run], attr: str, preferred: str) -> str | None:
    values = {getattr(r, attr) for r in runs}
    if preferred in values:
        return preferred
    return sorted(values)[0] if values else None


def plot(runs: Sequence[Run], out_dir: Path, prefix: str = "") -> list[Path]:
    """PNG plots per workload (see the module docstring); returns the files written."""
    written: list[Path] = []
    for wl in sorted({r.workload for r in runs}):
        name = Path(wl).stem.replace(" ", "_")
        written += _plot_workload(
            [r for r in runs if r.workload == wl], out_dir, f"{prefix}{name}_"
        )
    return written


def _plot_workload(runs: Sequence[Run], out_dir: Path, prefix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    sched = _default_of(runs, "scheduler", "slo")
    pol = _default_of(runs, "policy", "e2")
    groups = {
        "policies": ("policy", [r for r in runs if r.scheduler == sched]),
        "schedulers": ("scheduler", [r for r in runs if r.policy == pol]),
    }
    for name, (attr, subset) in groups.items():
        series = _series(subset, attr)
        if len(series) < 2 and name == "schedulers":
            continue
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for label, rs in series.items():
            xs = [r.offered_rps for r in rs]
            axes[0].plot(xs, [100 * r.summary["slo_attainment"] for r in rs], "o-", label=label)
            axes[1].plot(
                xs,
                [(r.summary["ttft_ms"]["p99"] or float("nan")) / 1000 for r in rs],
                "o-",
                label=label,
            )
        axes[0].set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(0, 102))
        axes[1].set(xlabel="request rate (req/s)", ylabel="p99 TTFT (s)", yscale="log")
        title = (
            f"router policies (scheduler {sched})"
            if name == "policies"
            else (f"local schedulers (policy {pol})")
        )
        fig.suptitle(f"{runs[0].workload}: {title}")
        for ax in axes:
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{prefix}{name}_slo_ttft.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    # prefix hit rate and load spread per policy, at every rate
    subset = [r for r in runs if r.scheduler == sched]
    series = _series(subset, "policy")
    if series:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for label, rs in series.items():
            xs = [r.offered_rps for r in rs]
            axes[0].plot(
                xs, [100 * (r.summary["prefix_hit_rate"] or 0) for r in rs], "o-", label=label
            )
            axes[1].plot(
                xs,
                [r.summary["load_spread_requests"]["max_over_mean"] or float("nan") for r in rs],
                "o-",
                label=label,
            )
        axes[0].set(xlabel="request rate (req/s)", ylabel="prefix hit rate (%)")
        axes[1].set(xlabel="request rate (req/s)", ylabel="requests per engine, max / mean")
        for ax in axes:
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{runs[0].workload}: cache reuse and load spread (scheduler {sched})")
        fig.tight_layout()
        path = out_dir / f"{prefix}policies_hit_spread.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def render(
    runs: Sequence[Run], fidelity: Sequence[dict], images: Sequence[Path], base: Path
) -> str:
    """The Markdown report; image links are relative to ``base`` (the report's folder)."""
    parts = ["# kvgate benchmark report", ""]
    if runs:
        parts += ["## Simulated runs", "", runs_table(runs), ""]
        walls = [r for r in runs if r.wall_s is not None]
        if walls:
            parts += [
                f"Simulator wall time per run: {min(r.wall_s for r in walls):.1f} to "
                f"{max(r.wall_s for r in walls):.1f} s.",
                "",
            ]
    if fidelity:
        parts += ["## Fidelity: live vs simulated", "", fidelity_table(fidelity), ""]
        for f in fidelity:
            parts.append(f"- {f.get('label', 'fidelity')}: {f.get('description', '')}")
        parts.append("")
    if images:
        parts += ["## Plots", ""]
        for img in images:
            rel = img.relative_to(base) if img.is_relative_to(base) else img
            parts.append(f"![{img.stem}]({rel.as_posix()})")
            parts.append("")
    return "\n".join(parts)


def build_report(
    inputs: Sequence[Path], out: Path, *, plots: bool = True
) -> tuple[Path, list[Path]]:
    """Write ``out`` (Markdown) and its PNGs beside it; returns both."""
    runs, fidelity = load_runs(inputs)
    images: list[Path] = []
    if plots and runs:
        try:
            images = plot(runs, out.parent, prefix=out.stem + "_")
        except ImportError:
            log.warning("report: matplotlib is not installed; tables only")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(runs, fidelity, images, out.parent))
    return out, images
