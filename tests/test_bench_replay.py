"""``python -m scripts.bench.bench_replay`` runs under mpiexec (the README's main job), one JSON row per case."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from mpi_util import mpiexec_path

from mpi_util import ROOT


def test_bench_replay_prints_a_row_per_case():
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    proc = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "scripts.bench.bench_replay",
                           "--quick", "--json", "--workloads", "hopper,image", "--modes", "decentralized,local",
                           "--items", "3", "--seconds", "0.05"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    cases = {(r["workload"], r["mode"], r["path"]) for r in rows}
    assert cases == {(w, "decentralized", p) for w in ("hopper", "image") for p in ("shm", "alltoallv")} | \
        {("hopper", "local", "shm"), ("image", "local", "shm")}, cases
    for r in rows:
        assert r["ranks"] == 2 and r["gbps"] > 0 and r["memcpy_gbps"] > 0 and r["ms_per_update"] > 0
        per_rank = {"hopper": 32 * 1000 * (11 * 4 + 3 * 4 + 4 + 1), "image": 64 * 32 * (84 * 84 * 4 + 4 + 4)}
        # bytes of the returned tensors: columns, mask (1 B/step), keys, probabilities, lengths (8 B), weights (4 B)
        steps = {"hopper": 32 * 1000, "image": 64 * 32}[r["workload"]]
        items = {"hopper": 32, "image": 64}[r["workload"]]
        assert r["bytes_per_call"] == 2 * (per_rank[r["workload"]] + steps + 28 * items), r
