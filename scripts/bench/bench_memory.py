#!/usr/bin/env python
"""Bytes per item of a prioritized replay: gear_mpi against cpprb and TorchRL, side by side in one run.

    python -m scripts.bench.bench_memory                     # N = 1e7, 3 repetitions, every system
    python -m scripts.bench.bench_memory --n 1000000 --reps 1 --systems gear,cpprb
    python -m scripts.bench.bench_memory --json              # JSON lines instead of the table

Workload (issue 16, part 5): N one-step items of one float32 (4 bytes), each with a random
priority, prioritized sampling (alpha 0.6, beta 0.4); nothing is sampled. Each system fills in
chunks of 1e6 items:
  gear     gm.Shard(spec, N, gm.Prioritized(0.6, 0.4)), insert_packed(columns, lengths, priorities)
  cpprb    cpprb.PrioritizedReplayBuffer(N, {"obs": {"dtype": float32}}, alpha=0.6), add(obs, priorities)
  torchrl  ReplayBuffer(LazyTensorStorage(N), PrioritizedSampler(N, 0.6, 0.4)), extend(TensorDict) and
           update_priority(indices, priorities)

Measurement: every system runs in its own fresh process (the peers in their environments under
--cache, default ~/.cache/gear_mpi_peers/<peer>/venv, as scripts/bench/compare_peers.py makes them;
cpprb may sit in the cpprb or the reverb environment). The process imports its library and warms
it up on a tiny buffer (numba compiles, torch initialises), then reads its resident set (VmRSS of
/proc/self/status), builds and fills the buffer, frees the chunk arrays and reads it again:
B/item = (RSS after - RSS before) / N. The C heap keeps memory freed by the fill's temporaries
(glibc raises its mmap threshold after the first big free, so later ones up to 32 MB come from the
heap and stay resident): the table gives B/item as left and after ``malloc_trim(0)`` (every
system alike; the "before" reading is taken after one too). The systems' order rotates between repetitions; the table
gives the median and the spread (min-max) over repetitions. A system whose environment is missing is
reported, not dropped.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ALPHA, BETA = 0.6, 0.4
CHUNK = 1_000_000
SYSTEMS = ("gear", "cpprb", "torchrl")
ROOT = Path(__file__).resolve().parents[2]


def trim() -> None:
    """Give the C heap's free memory back to the system (glibc ``malloc_trim(0)``; nothing elsewhere)."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int:
    """This process's resident set (VmRSS), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# ---- workers (run in the system's own interpreter) ----------------------------------------------
def _chunks(n: int):
    import numpy as np
    rng = np.random.default_rng(0)
    for lo in range(0, n, CHUNK):
        k = min(CHUNK, n - lo)
        yield rng.standard_normal(k).astype(np.float32), rng.uniform(0.1, 2.0, k)


def fill_gear(n: int):
    import numpy as np

    import gear_mpi as gm
    spec = gm.TrajectorySpec({"obs": ((), np.float32)}, max_length=1)
    # both index paths of an insert (8 of 64 slots rewrites the leaves, 8 of 1024 updates them one by
    # one, the path of the fill's chunks): numba loads a kernel at its first call, and a load during the
    # fill would leave its C-heap garbage (about 2.5 B/item at 1e7) in the "as left" figure
    for slots in (64, 1024):
        warm = gm.Shard(spec, slots, gm.Prioritized(ALPHA, BETA), seed=0)
        warm.insert_packed({"obs": np.zeros(8, np.float32)}, np.ones(8, np.int64), np.ones(8))
        warm.close()
    gc.collect()
    trim()
    before = rss_bytes()
    shard = gm.Shard(spec, n, gm.Prioritized(ALPHA, BETA), seed=0)
    for obs, pr in _chunks(n):
        shard.insert_packed({"obs": obs}, np.ones(len(obs), np.int64), pr)
    del obs, pr
    gc.collect()
    assert len(shard) == n
    return before, rss_bytes(), shard


def fill_cpprb(n: int):
    import numpy as np

    import cpprb
    env = {"obs": {"dtype": np.float32}}
    warm = cpprb.PrioritizedReplayBuffer(64, env, alpha=ALPHA)
    warm.add(obs=np.zeros(8, np.float32), priorities=np.ones(8))
    del warm
    gc.collect()
    trim()
    before = rss_bytes()
    rb = cpprb.PrioritizedReplayBuffer(n, env, alpha=ALPHA)
    for obs, pr in _chunks(n):
        rb.add(obs=obs, priorities=pr)
    del obs, pr
    gc.collect()
    assert rb.get_stored_size() == n
    return before, rss_bytes(), rb


def fill_torchrl(n: int):
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, PrioritizedSampler, ReplayBuffer

    def build(size):
        return ReplayBuffer(storage=LazyTensorStorage(size), sampler=PrioritizedSampler(size, ALPHA, BETA),
                            batch_size=8)
    warm = build(64)
    idx = warm.extend(TensorDict({"obs": torch.zeros(8)}, batch_size=[8]))
    warm.update_priority(idx, torch.ones(8))
    del warm, idx
    gc.collect()
    trim()
    before = rss_bytes()
    rb = build(n)
    for obs, pr in _chunks(n):
        idx = rb.extend(TensorDict({"obs": torch.from_numpy(obs)}, batch_size=[len(obs)]))
        rb.update_priority(idx, torch.from_numpy(pr.astype("float32")))
    del obs, pr, idx
    gc.collect()
    assert len(rb) == n
    return before, rss_bytes(), rb


def worker(system: str, n: int) -> None:
    t0 = time.perf_counter()
    before, after, keep = {"gear": fill_gear, "cpprb": fill_cpprb, "torchrl": fill_torchrl}[system](n)
    fill_s = time.perf_counter() - t0
    trim()
    trimmed = rss_bytes()
    print(json.dumps({"system": system, "n": n, "rss_before": before, "rss_after": after, "rss_trimmed": trimmed,
                      "bytes_per_item": (after - before) / n, "bytes_per_item_trimmed": (trimmed - before) / n,
                      "fill_s": fill_s}), flush=True)
    del keep


# ---- driver ---------------------------------------------------------------------------------------
def interpreter(system: str, cache: Path) -> tuple[str | None, str]:
    """(the Python to run ``system`` with, or None; why not)."""
    if system == "gear":
        return sys.executable, ""
    names = {"cpprb": ("cpprb", "reverb"), "torchrl": ("torchrl",)}[system]
    module = {"cpprb": "cpprb", "torchrl": "torchrl"}[system]
    for name in names:
        py = cache / name / "venv" / "bin" / "python"
        if py.exists() and subprocess.run([str(py), "-c", f"import {module}"], capture_output=True).returncode == 0:
            return str(py), ""
    return None, f"no environment under {cache} imports {module} (python -m scripts.bench.compare_peers --setup-only)"


def run_one(system: str, py: str, n: int, timeout: float) -> dict:
    env = dict(os.environ)
    if system == "gear":
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([py, str(Path(__file__).resolve()), "--worker", system, "--n", str(n)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    from scripts.bench.json_lines import json_rows  # the driver's side only: workers run in peers' venvs
    rows = json_rows(proc.stdout)
    if proc.returncode != 0 or not rows:
        return {"system": system, "n": n, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return rows[-1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=10_000_000, help="items (default 1e7)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "gear_mpi_peers"))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for one system's process")
    ap.add_argument("--json", action="store_true", help="JSON lines instead of the table")
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.n)
        return
    systems = [s for s in args.systems.split(",") if s]
    pythons = {s: interpreter(s, Path(args.cache)) for s in systems}
    results: dict[str, list] = {s: [] for s in systems}
    for rep in range(args.reps):
        for s in systems[rep % len(systems):] + systems[:rep % len(systems)]:
            py, why = pythons[s]
            r = run_one(s, py, args.n, args.timeout) if py else {"system": s, "n": args.n, "error": why}
            r["rep"] = rep
            results[s].append(r)
            if args.json:
                print(json.dumps(r), flush=True)
    if args.json:
        return
    print(f"bytes per item, N={args.n:.0e} one-step float32 items, prioritized: RSS after filling minus before, "
          f"as left and after malloc_trim(0); median [min-max] of {args.reps}")
    for s in systems:
        ok = [r for r in results[s] if "bytes_per_item" in r]
        if not ok:
            print(f"  {s:8s} not measured: {results[s][-1].get('error')}")
            continue
        cells = []
        for field in ("bytes_per_item", "bytes_per_item_trimmed"):
            vals = sorted(r[field] for r in ok)
            cells.append(f"{_median(vals):6.1f} B/item [{vals[0]:.1f}-{vals[-1]:.1f}]")
        print(f"  {s:8s} as left {cells[0]}   trimmed {cells[1]}   fill {_median([r['fill_s'] for r in ok]):.1f} s")


def _median(vals: list) -> float:
    vals = sorted(vals)
    k = len(vals) // 2
    return vals[k] if len(vals) % 2 else (vals[k - 1] + vals[k]) / 2


if __name__ == "__main__":
    main()
