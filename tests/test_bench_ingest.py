"""``python -m scripts.bench.bench_ingest --quick --no-peers``: real writer processes, tiny sizes, JSON rows.

One run (two mpiexec jobs: one rank alone with K = 1, 2 writers, two ranks sampling with one writer each), then the
summary's arithmetic on made-up rows (the gear_mpi / Reverb ratio, medians and spread).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from mpi_util import ROOT


def test_bench_ingest_quick_rows_parse_and_are_positive():
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.bench_ingest", "--quick", "--no-peers", "--json",
                           "--ks", "1,2", "--sampling-ks", "1", "--seconds", "0.15", "--warmup", "0.05", "--items", "3",
                           "--capacity-episodes", "6", "--actor-rates", "0", "--timeout", "120"],
                          capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    kinds = [x["kind"] for x in lines]
    assert kinds[0] == "meta" and "failed" not in kinds, lines
    meta = lines[0]
    assert len(meta["load_average_start"]) == 3 and len(meta["load_average_end"]) == 3
    rows = [x for x in lines if x["kind"] == "result"]
    cases = {(r["workload"], r["mode"], r["system"], r["ranks"], r["K"]) for r in rows}
    assert all(r["rate"] == 0 for r in rows), rows
    assert cases == {(w, "alone", "gear_mpi", 1, k) for w in ("hopper", "image") for k in (1, 2)} | \
        {("hopper", "sampling", "gear_mpi", 2, 1)}, cases
    for r in rows:
        assert r["status"] == "ok" and r["reps"] == 1, r
        assert r["steps_per_s"] > 0 and r["us_per_step"] > 0, r
        assert r["step_bytes"] == {"hopper": 61, "image": 4104}[r["workload"]], r
        assert abs(r["gbps"] - r["steps_per_s"] * r["step_bytes"] / 1e9) < 1e-9 * max(1.0, r["gbps"]), r
        assert r["steps_per_s_min"] <= r["steps_per_s"] <= r["steps_per_s_max"], r
        if r["mode"] == "sampling":
            assert r["sample_gbps_alone"] > 0 and r["sample_gbps_during"] > 0 and r["sample_ratio"] > 0, r
    targets = [x for x in lines if x["kind"] == "target"]
    assert len(targets) == 1 and targets[0]["value"] > 0, targets  # sampling K=1 (no Reverb: no ratio)


def test_summary_takes_medians_and_the_ratio_of_medians():
    from scripts.bench.bench_ingest import summarize

    def run(system, sps, rep):
        return {"status": "ok", "workload": "hopper", "mode": "alone", "system": system, "ranks": 1, "K": 2, "rate": 0,
                "steps": sps, "elapsed_s": 1.0, "step_bytes": 61, "writer_cpu_s": 0.5, "us_per_step": 1e6 / sps, "rep": rep}

    rows = summarize([run("gear_mpi", s, i) for i, s in enumerate((900, 1000, 3000))] +
                     [run("reverb", s, i) for i, s in enumerate((40, 50, 60))])
    gear, reverb = rows
    assert (gear["system"], reverb["system"]) == ("gear_mpi", "reverb")
    assert gear["steps_per_s"] == 1000 and (gear["steps_per_s_min"], gear["steps_per_s_max"]) == (900, 3000)
    assert gear["ratio"] == 20.0 and "ratio" not in reverb and gear["reps"] == 3
