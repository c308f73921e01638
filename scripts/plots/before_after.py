#!/usr/bin/env python
"""Before/after tables (Markdown) from the JSON lines of the benchmarks, run on two library versions.

    python -m scripts.plots.before_after before:b1.jsonl before:b2.jsonl after:a1.jsonl after:a2.jsonl

Each argument is ``SIDE:FILE`` (SIDE ``before`` or ``after``); one file is one run (one invocation)
of ``scripts/bench/compare_peers.py --raw --save``, ``scripts/bench/bench_replay.py --json`` or
``scripts/bench/bench_shard.py --json`` (the kind of each line is recognised from its fields; other
lines are skipped). For every case measured on both sides the table gives the median over the runs of
each side, the min-max over those runs, and after / before (times: below 1 is faster after). A row is
flagged ``SLOWER`` when after's fastest run is slower than before's slowest (the two spreads do not
overlap; only with at least two runs a side) and ``faster`` in the mirror case.

``--merge-peers OUT FILE...`` instead joins several compare_peers ``--raw --save`` files of one side (one
repetition each, run in turn with other work between them) into one file as compare_peers would have
written for all those repetitions at once: medians, spreads, ratios and targets over every run row,
the first file's meta with the load average at the first start and the last end. That file is what
``scripts/plots/plot_results.py`` reads; the table compare_peers prints goes to stdout.

Per run the figure is: compare_peers, the median call of that repetition (``ms_per_call``, one
sample + update step for W2/W3); bench_replay, the median call of the slowest rank (``ms_per_call``,
and ``ms_per_update`` in its own table); bench_shard, the best of the run's timed repetitions
(``time_us`` / ``time_ms``, and ``cpprb_ms`` for its cpprb rows).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from scripts.bench.json_lines import json_rows


def _n(x) -> str:
    if x is None:
        return "-"
    return f"{float(x):.0e}".replace("e+0", "e") if isinstance(x, (int, float)) and x >= 1e5 else str(x)


def figures(row: dict) -> list[tuple[str, tuple, float]]:
    """(table, case key, time) for one JSON row; [] for rows that are not a measured case."""
    if row.get("kind") == "run" and row.get("status") != "failed" and "ms_per_call" in row:
        thr = row.get("threads")
        key = (row["workload"], row["peer"], row["variant"], f"{thr} thr" if thr else "-",
               f"B={row.get('B')}", f"N={_n(row.get('N'))}" if row["workload"] == "W3" else
               (f"K={row.get('clients')}" if row["workload"] == "W1" else ""))
        return [(f"compare_peers {row['workload']} (ms per step, median call)", key, row["ms_per_call"])]
    if "ranks" in row and "mode" in row and "ms_per_call" in row:
        key = (f"{row['ranks']} ranks", row["workload"], row["mode"], row["path"], row.get("sampler", ""))
        out = [("bench_replay sample (ms per call, median of the slowest rank)", key, row["ms_per_call"])]
        if "ms_per_update" in row:
            out.append(("bench_replay update_priorities (ms per call)", key, row["ms_per_update"]))
        return out
    if "case" in row and ("time_us" in row or "time_ms" in row) and row.get("section") != "storage":
        if row.get("section") == "memcpy":
            return [("bench_shard memcpy (ms per 1 GiB copy, best of the run)", (row["case"],), row["time_ms"])]
        if "time_us" in row:
            return [("bench_shard window (us per call, best of the run)",
                     (row["case"], f"B={row['B']}", f"W={row['W']}"), row["time_us"])]
        key = (row["case"], f"B={row['B']}", f"N={_n(row['N'])}")
        out = [("bench_shard priority (ms per step, best of the run)", key + ("gear_mpi",), row["time_ms"])]
        if row.get("full_ms") is not None:
            out.append(("bench_shard priority (ms per step, best of the run)", key[:1] + ("+IS weights",)
                        + key[1:] + ("gear_mpi",), row["full_ms"]))
        if row.get("cpprb_ms") is not None:
            out.append(("bench_shard priority (ms per step, best of the run)", key + ("cpprb",), row["cpprb_ms"]))
        return out
    return []


def collect(specs: list[str]) -> dict:
    data: dict = {}  # table -> key -> side -> [values]
    for spec in specs:
        side, _, name = spec.partition(":")
        if side not in ("before", "after") or not name:
            raise SystemExit(f"expected before:FILE or after:FILE, got {spec!r}")
        for row in json_rows(Path(name).read_text()):
            for table, key, value in figures(row):
                data.setdefault(table, {}).setdefault(key, {"before": [], "after": []})[side].append(value)
    return data


def _cell(vs: list[float]) -> str:
    if not vs:
        return "-"
    med = statistics.median(vs)
    fmt = "{:.3f}" if med < 10 else "{:.1f}"
    spread = f" ({fmt.format(min(vs))}–{fmt.format(max(vs))})" if len(vs) > 1 else ""
    return fmt.format(med) + spread


def table(name: str, cases: dict) -> str:
    lines = [f"#### {name}", "", "| case | before | after | after/before | |", "|---|---:|---:|---:|---|"]
    for key, sides in cases.items():
        b, a = sides["before"], sides["after"]
        if not b or not a:
            continue
        ratio = statistics.median(a) / statistics.median(b)
        flag = ""
        if len(a) > 1 and len(b) > 1:  # one run a side has no spread to be beyond
            flag = "SLOWER" if min(a) > max(b) else ("faster" if max(a) < min(b) else "")
        case = ", ".join(str(k) for k in key if k)
        lines.append(f"| {case} | {_cell(b)} | {_cell(a)} | {ratio:.2f} | {flag} |")
    return "\n".join(lines) + "\n"


def merge_peers(out: Path, files: list[Path]) -> None:
    """Re-summarize the run rows of several compare_peers --raw --save files into ``out`` (see above)."""
    from scripts.bench import compare_peers as cp

    metas, runs = [], []
    for f in files:
        rows = json_rows(f.read_text())
        metas += [r for r in rows if r.get("kind") == "meta"]
        for r in (r for r in rows if r.get("kind") == "run"):
            runs.append({**{k: v for k, v in r.items() if k != "kind"}, "file": f.name})
    meta = dict(metas[0])
    memcpy = [m for x in metas for m in x.get("memcpy_runs", [])]
    meta.update(reps=len(metas), memcpy_runs=memcpy, memcpy_gbps=statistics.median(memcpy),
                load_average_end=metas[-1].get("load_average_end"), finished=metas[-1].get("finished"),
                files=[f.name for f in files])
    rows = cp.summarize(runs, memcpy)
    sizes = meta.get("sizes", {})
    ns = argparse.Namespace(workloads=sorted({r["workload"] for r in rows}), clients=sizes.get("clients") or [1],
                            w2_batches=sizes.get("w2_batches") or [256], w3_b=sizes.get("w3_b") or 65536,
                            w3_ns=sizes.get("w3_ns") or [1e7])
    setup = {s["peer"]: s for s in meta.get("setup", [])}
    tg = cp.targets(rows, setup, ns)
    lines = [json.dumps(meta)] + [json.dumps({"kind": "result", **r}) for r in rows] + [json.dumps(t) for t in tg]
    lines += [json.dumps({"kind": "run", **r}) for r in runs]
    out.write_text("\n".join(lines) + "\n")
    print(f"# {len(files)} runs merged; memcpy median {meta['memcpy_gbps']:.2f} GB/s; load average start "
          f"{meta['load_average_start'][0]:.2f}, end {(meta['load_average_end'] or [float('nan')])[0]:.2f}")
    cp.print_table(rows)
    for t in tg:
        state = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT met")
        val = "-" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        print(f"#   {t['target']}: {val} -> {state}" + (f" ({t['basis']})" if t["basis"] else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="before:FILE or after:FILE, one run each (with --merge-peers: FILE)")
    ap.add_argument("--merge-peers", type=Path, metavar="OUT", help="join compare_peers runs into OUT (see above)")
    args = ap.parse_args(argv)
    if args.merge_peers:
        merge_peers(args.merge_peers, [Path(f) for f in args.files])
        return 0
    data = collect(args.files)
    for name in sorted(data):
        print(table(name, data[name]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
