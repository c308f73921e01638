#!/usr/bin/env python
"""PNG plots from the JSON output of scripts/bench/compare_peers.py and scripts/bench/bench_replay.py.

    python -m scripts.bench.compare_peers --save peers.jsonl
    python -m scripts.bench.bench_replay --ranks 1,2,4 --json > replay.jsonl
    python -m scripts.plots.plot_results peers.jsonl replay.jsonl --out docs/img

Reads JSON lines (other lines are skipped) and writes, for what the files hold:
  peers_w1_clients.png   W1: delivered GB/s against clients (1 panel per sampler), log scale,
                         with the same run's memcpy rate as a dashed line
  peers_w2_batch.png     W2: delivered GB/s against batch size (when several were measured)
  peers_w3_selection.png W3: time of one prioritized sample+update step against N (log-log; gear_mpi's
                         internal PriorityIndex rows, information only, drawn faint)
  replay_ranks.png       bench_replay: delivered GB/s against ranks, per mode and window path
Needs matplotlib (the project's ``bench`` extra).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scripts.bench.json_lines import json_rows

COLORS = {"gear_mpi": "tab:blue", "reverb": "tab:red", "cpprb": "tab:green", "torchrl": "tab:orange"}
STYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D", "v", "P", "X"]


def load(paths: list[Path]) -> tuple[list[dict], list[dict], list[dict]]:
    """(compare_peers result rows, compare_peers meta rows, bench_replay rows)."""
    peers, metas, replay = [], [], []
    for p in paths:
        for row in json_rows(p.read_text()):
            if row.get("kind") == "result" and row.get("status") == "ok":
                peers.append(row)
            elif row.get("kind") == "meta":
                metas.append(row)
            elif "ranks" in row and "mode" in row and "gbps" in row:
                replay.append(row)
    return peers, metas, replay


def label(r: dict) -> str:
    thr = r.get("threads")
    extra = f", {thr} thr" if thr and r["workload"] != "W1" else ""
    return f"{r['peer']}: {r['variant']}{extra}"


def series(rows: list[dict], x: str, y: str, keyf) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        out.setdefault(keyf(r), []).append((r[x], r[y]))
    return {k: sorted(v) for k, v in out.items()}


def _style(i: int, name: str) -> dict:
    peer = name.split(":")[0]
    return {"color": COLORS.get(peer, f"C{i % 10}"), "linestyle": STYLES[i % len(STYLES)],
            "marker": MARKERS[i % len(MARKERS)], "markersize": 5, "linewidth": 1.6}


def _legend(ax, n: int) -> None:
    """Outside the axes, on the right: the lines stay visible."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9, ncol=1 if n <= 14 else 2)


def _finish_one_axes(fig, ax, n_series: int, metas: list[dict]) -> None:
    """Grid, legend and footer of a one-panel figure, then its layout."""
    ax.grid(True, which="both", alpha=0.3)
    _legend(ax, n_series)
    _footer(fig, metas)
    fig.tight_layout(rect=(0, 0.02, 1, 1))


def _save(plt, fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _footer(fig, metas: list[dict]) -> None:
    if metas:
        m = metas[-1]
        fig.text(0.01, 0.005, f"{m.get('host', '?')}: {m.get('cpus', '?')} CPUs; {m.get('reps', '?')} reps, medians; "
                 f"memcpy {m.get('memcpy_gbps', float('nan')):.1f} GB/s; {m.get('finished', '')}",
                 fontsize=7, color="0.35")


def plot_w1(plt, rows, metas, out: Path) -> Path | None:
    rows = [r for r in rows if r["workload"] == "W1"]
    if not rows:
        return None
    samplers = sorted({r["sampler"] for r in rows}, key=lambda s: s != "uniform")
    kmax = max(r["clients"] for r in rows)
    fig, axes = plt.subplots(1, len(samplers), figsize=(6.2 * len(samplers), 6.0), squeeze=False, sharey=True)
    for ax, s in zip(axes[0], samplers):
        sub = [r for r in rows if r["sampler"] == s and (r["peer"] != "gear_mpi" or (r.get("threads") or 1) == 1)]
        ss = series(sub, "clients", "gbps", label)
        for i, (name, pts) in enumerate(sorted(ss.items())):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **_style(i, name))
        if sub and sub[0].get("memcpy_gbps"):
            ax.axhline(sub[0]["memcpy_gbps"], color="0.3", linestyle="--", linewidth=1)
            ax.text(1, sub[0]["memcpy_gbps"] * 1.08, "memcpy, 1 thread (same run)", fontsize=7, color="0.3")
        ax.set_yscale("log")
        ax.set_xticks(sorted({r["clients"] for r in sub}))
        ax.set_xlim(0.8, kmax + 0.2)
        ax.set_xlabel("clients (gear_mpi: MPI ranks, 1 numba thread each; Reverb: client processes)")
        ax.set_title(f"W1 hopper T=1000, whole trajectories, batch 32/client: {s}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 0.03), ncol=3, framealpha=0.9)
    axes[0][0].set_ylabel("delivered GB/s (all clients, log scale)")
    _footer(fig, metas)
    fig.tight_layout(rect=(0, 0.06 + 0.045 * ((len(labels) + 2) // 3), 1, 1))
    return _save(plt, fig, out / "peers_w1_clients.png")


def plot_w2(plt, rows, metas, out: Path) -> Path | None:
    rows = [r for r in rows if r["workload"] == "W2"]
    if len({r["B"] for r in rows}) < 2:
        return None
    fig, ax = plt.subplots(figsize=(10.5, 5.0))
    ss = series(rows, "B", "gbps", label)
    for i, (name, pts) in enumerate(sorted(ss.items())):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **_style(i, name))
    if rows[0].get("memcpy_gbps"):
        ax.axhline(rows[0]["memcpy_gbps"], color="0.3", linestyle="--", linewidth=1)
        ax.text(min(r["B"] for r in rows), rows[0]["memcpy_gbps"] * 1.08, "memcpy, 1 thread (same run)", fontsize=7,
                color="0.3")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["B"] for r in rows}))
    ax.set_xticklabels([str(b) for b in sorted({r["B"] for r in rows})])
    ax.set_xlabel("batch size B")
    ax.set_ylabel("delivered GB/s (log scale)")
    ax.set_title(f"W2: 4 KiB transitions, N={rows[0]['N']:,}, prioritized sample + priority update", fontsize=9)
    _finish_one_axes(fig, ax, len(ss), metas)
    return _save(plt, fig, out / "peers_w2_batch.png")


def plot_w3(plt, rows, metas, out: Path) -> Path | None:
    rows = [r for r in rows if r["workload"] == "W3"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(10.5, 5.0))
    ss = series(rows, "N", "ms_per_call", label)
    for i, (name, pts) in enumerate(sorted(ss.items())):
        st = _style(i, name)
        if "PriorityIndex" in name:  # the internal index alone: information, drawn faint
            st.update(alpha=0.45, linewidth=1.0)
            name = name + " (index alone)"
        elif name.startswith("gear_mpi"):
            st.update(linewidth=2.4)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **st)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("items N")
    ax.set_ylabel("ms per step (median): sample B + update B priorities")
    ax.set_title(f"W3: prioritized selection, B={rows[0]['B']:,} per step", fontsize=9)
    _finish_one_axes(fig, ax, len(ss), metas)
    return _save(plt, fig, out / "peers_w3_selection.png")


def plot_replay(plt, rows, out: Path) -> Path | None:
    if not rows:
        return None
    panels = sorted({(r["workload"], r.get("sampler", "uniform")) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(8.0 * len(panels), 4.8), squeeze=False)
    for ax, (wl, s) in zip(axes[0], panels):
        sub = [r for r in rows if r["workload"] == wl and r.get("sampler", "uniform") == s]
        ss = series(sub, "ranks", "gbps", lambda r: f"{r['mode']} ({r['path']})")
        for i, (name, pts) in enumerate(sorted(ss.items())):
            st = _style(i, name)
            st["color"] = f"C{i % 10}"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **st)
        copy = sub[0].get("memcpy_gbps")
        if copy:
            ax.axhline(copy, color="0.3", linestyle="--", linewidth=1)
            ax.text(min(r["ranks"] for r in sub), copy * 1.03, "memcpy, 1 thread (same run)", fontsize=7, color="0.3")
        ax.set_xticks(sorted({r["ranks"] for r in sub}))
        ax.set_xlabel("ranks")
        ax.set_ylabel("delivered GB/s (all ranks)")
        b, w = sub[0].get("batch_per_rank"), sub[0].get("window")
        ax.set_title(f"bench_replay {wl}, {s}: batch {b}/rank, window {w}", fontsize=9)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        _legend(ax, len(ss))
    fig.tight_layout()
    return _save(plt, fig, out / "replay_ranks.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path, help="JSON-lines outputs of compare_peers.py / bench_replay.py")
    ap.add_argument("--out", type=Path, default=Path("."), help="folder for the PNG files (default: here)")
    args = ap.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_results.py needs matplotlib: pip install matplotlib (or the project's 'bench' extra)",
              file=sys.stderr)
        return 2
    peers, metas, replay = load(args.files)
    if not peers and not replay:
        print("no compare_peers.py results or bench_replay.py rows in the given files", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    made = [plot_w1(plt, peers, metas, args.out), plot_w2(plt, peers, metas, args.out),
            plot_w3(plt, peers, metas, args.out), plot_replay(plt, replay, args.out)]
    for p in made:
        if p is not None:
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
