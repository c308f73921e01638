"""``python -m scripts.bench.bench_replay`` runs under mpiexec (the README's main job), one JSON row per case."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from mpi_util import mpiexec_path

from mpi_util import ROOT


def test_bench_replay_prints_a_row_per_case():
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    proc = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "scripts.bench.bench_replay",
                           "--quick", "--json", "--workloads", "hopper,image", "--modes", "decentralized,local",
                           "--items", "3", "--seconds", "0.05"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    cases = {(r["workload"], r["mode"], r["path"]) for r in rows}
    assert cases == {(w, "decentralized", p) for w in ("hopper", "image") for p in ("shm", "alltoallv")} | \
        {("hopper", "local", "shm"), ("image", "local", "shm")}, cases
    for r in rows:
        assert r["ranks"] == 2 and r["gbps"] > 0 and r["memcpy_gbps"] > 0 and r["ms_per_update"] > 0
        # the memcpy reference was measured while the other rank slept (a spinning wait would use ~100%)
        assert 0 <= r["memcpy_peers_cpu"] < 0.25, r
        per_rank = {"hopper": 32 * 1000 * (11 * 4 + 3 * 4 + 4 + 1), "image": 64 * 32 * (84 * 84 * 4 + 4 + 4)}
        # bytes of the returned tensors: columns, mask (1 B/step), keys, probabilities, lengths (8 B), weights (4 B)
        steps = {"hopper": 32 * 1000, "image": 64 * 32}[r["workload"]]
        items = {"hopper": 32, "image": 64}[r["workload"]]
        assert r["bytes_per_call"] == 2 * (per_rank[r["workload"]] + steps + 28 * items), r


def test_bench_replay_table_prints_the_memcpy_reference():
    """The table run: the memcpy reference line before the rows (rate, and the other ranks asleep),
    the same rate at the end, and --quick's note that it is a demo."""
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    proc = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "scripts.bench.bench_replay",
                           "--quick", "--workloads", "hopper", "--modes", "local", "--items", "2", "--seconds", "0.05"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    first = re.fullmatch(r"# memcpy reference: ([0-9.]+) GB/s \(np.copyto of 64 MiB on rank 0, before the cases, "
                         r"while the other 1 rank\(s\) slept \(CPU use ([0-9.]+)%\)\)", lines[0])
    assert first, lines[:3]
    assert float(first[1]) > 0 and float(first[2]) < 25, lines[0]
    assert lines[1].split()[:3] == ["ranks", "workload", "items"], lines[1]
    rows = [line for line in lines if line.split() and line.split()[0] == "2"]
    assert len(rows) == 1 and rows[0].split()[1:4] == ["hopper", "2", "local"], lines
    assert f"asleep): {first[1]} GB/s" in proc.stdout
    assert lines[-1].startswith("# --quick: ") and "not a measurement" in lines[-1], lines[-1]


def test_reference_memcpy_waits_asleep():
    """Structure: the ranks that do not measure wait in a sleeping poll of an Ibarrier,
    not in a blocking collective that would spin on the cores rank 0 measures on."""
    import inspect

    from scripts.bench import bench_replay as b
    src = inspect.getsource(b.reference_memcpy)
    assert src.count("wait_asleep(comm)") == 2 and "bcast" not in src.split("memcpy_gbps(")[0]
    wait = inspect.getsource(b.wait_asleep)
    assert "comm.Ibarrier()" in wait and "req.Test()" in wait and "time.sleep(" in wait
    assert b.default_items("hopper", True) == 24 and b.default_items("transitions", False) == 100_000
