"""``python -m scripts.bench.bench_prefetch`` runs under mpiexec: every case of both step kinds, one JSON line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from mpi_util import ROOT, mpiexec_path


def test_bench_prefetch_prints_every_case_and_the_hidden_share():
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "mpi4py", "-m",
                           "scripts.bench.bench_prefetch", "--items", "8", "--batch", "4", "--window", "100",
                           "--steps", "5", "--warmup", "2", "--reps", "2", "--compute", "wait,matmul", "--json",
                           "--recycle", "all"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1 and rows[0]["ranks"] == 2 and len(rows[0]["load_before"]) == 3, proc.stdout[-3000:]
    kinds = {r["compute_kind"]: r for r in rows[0]["results"]}
    assert sorted(kinds) == ["matmul", "wait"], kinds
    for r in kinds.values():
        med = r["median_s"]
        for case in ("sample", "replay", "compute", "plain", "prefetch1", "prefetch2", "thread1", "blocked2",
                     "prefetch1r", "prefetch2r", "thread2r", "blocked1r", "prefetch1a", "prefetch2a"):
            assert med[case] >= 0 and r["spread_s"][case][0] <= med[case] <= r["spread_s"][case][1], (case, r)
        # (no order between the cases' times: 2 repetitions of 5 steps beside another test worker are noise --
        # a matmul step's median once read 3.4 ms alone against 2.3 ms with a sample before it)
        assert med["sample"] > 0 and med["compute"] > 0 and med["plain"] > 0, r
        assert set(r["hidden"]) == {f"prefetch{p}{s}" for p in "12" for s in ("", "r", "a")}, r
        assert all(h <= 1 for h in r["hidden"].values()), r
        assert set(r["hidden_per_rep"]) == set(r["hidden"]) and all(len(v) == 2 for v in r["hidden_per_rep"].values())
        # the loop drops its batches: "auto" refills them as True does (how many fall inside the timed
        # steps depends on how far ahead the thread is), new batches none
        assert med["recycled2a"] > 0 and med["recycled2r"] > 0 and med["recycled1"] == 0, r
    assert "hidden" in proc.stdout and "target >= 80%" in proc.stdout, proc.stdout
