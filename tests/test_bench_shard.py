"""``python -m scripts.bench.bench_shard`` runs: --help, and a tiny --quick --json run whose lines are JSON objects."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    # from the repository root, as the README says: the checkout's gear_mpi and scripts package
    return subprocess.run([sys.executable, "-m", "scripts.bench.bench_shard", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_help():
    proc = run("--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stdout and "--json" in proc.stdout


def test_quick_json_lines():
    proc = run("--quick", "--json", "--reps", "1", "--no-cpprb")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    sections = {r["section"] for r in rows}
    assert {"memcpy", "window", "priority", "storage", "percall", "targets"} <= sections, sections
    percall = {(r["case"], r["B"]) for r in rows if r["section"] == "percall"}
    for b in (32, 64, 256):
        assert {("Shard.sample(B, 1), new batch", b), ("SB3 ReplayBuffer.sample(B)", b),
                ("GearReplayBuffer.sample(B)", b), ("Shard(Prioritized) sample+update", b)} <= percall
    assert all(r["us"] > 0 for r in rows if r["section"] == "percall")
    window = [r for r in rows if r["section"] == "window"]
    assert all(r["GBps"] > 0 and r["batch_bytes"] > 0 and r["pct_memcpy"] > 0 for r in window)
    prio = [r for r in rows if r["section"] == "priority" and r["case"] == "PriorityIndex draw+set"]
    assert {(r["B"], r["N"]) for r in prio} == {(256, 100_000), (8192, 1_000_000)}
    storage = [r for r in rows if r["section"] == "storage"]
    assert all(r["stored_bytes"] >= r["raw_bytes"] > 0 for r in storage)
