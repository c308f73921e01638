"""Helpers shared by the peer workers of scripts/bench/compare_peers.py (stdlib + numpy only).

Each worker runs in its own virtual environment (Reverb brings numpy<2, TorchRL its own
torch), so nothing here may import gear_mpi or any peer. Every worker prints one JSON
object per measured case on its own line; anything else it prints is ignored.

The workloads (the same arrays for every system):

- W1 -- hopper-like trajectories: T=1000 steps of obs float32[11], action float32[3],
  reward float32, done bool (61 bytes per step); whole trajectories, batch 32 per client.
- W2 -- transitions: obs uint8[4096], action float32, reward float32 (4104 bytes per
  item); prioritized sample of B=256 plus a priority update of the sampled items per step.
- W3 -- prioritized selection at scale: sample B=65536 indices over N=1e7 priorities and
  set B new priorities, per step (no payload worth counting: a float32 per item).

Delivered bytes are the bytes of the returned data columns only (``B x W x step bytes``):
masks, keys, probabilities and importance weights are not counted for anybody.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

ALPHA, BETA = 0.6, 0.4

HOPPER = {"obs": ((11,), "float32"), "action": ((3,), "float32"), "reward": ((), "float32"), "done": ((), "bool")}
HOPPER_T = 1000
W1_BATCH = 32

TRANSITION = {"obs": ((4096,), "uint8"), "action": ((), "float32"), "reward": ((), "float32")}
# gear_worker's W2 information row (the gather alone) and the name compare_peers finds it by
W2_FLOOR = "bare gather of B rows (floor)"


def step_bytes(columns: dict) -> int:
    return int(sum(np.prod(shape, dtype=np.int64) * np.dtype(dt).itemsize for shape, dt in columns.values()))


def hopper_trajectory(seed: int, length: int = HOPPER_T) -> dict:
    """One hopper-like trajectory (numpy arrays, leading dimension ``length``)."""
    rng = np.random.default_rng(seed)
    done = np.zeros(length, np.bool_)
    done[-1] = True
    return {"obs": rng.standard_normal((length, 11)).astype(np.float32),
            "action": rng.standard_normal((length, 3)).astype(np.float32),
            "reward": rng.standard_normal(length).astype(np.float32),
            "done": done}


def hopper_priorities(n: int, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.5, 2.0, n)


def transitions(n: int, seed: int = 0) -> dict:
    """``n`` W2 transitions (obs bytes are cheap to make: a row pattern, not random)."""
    rng = np.random.default_rng(seed)
    obs = np.empty((n, 4096), np.uint8)
    obs[:] = (np.arange(4096, dtype=np.uint32) % 251).astype(np.uint8)
    obs[:, 0] = (np.arange(n) % 256).astype(np.uint8)
    return {"obs": obs, "action": rng.standard_normal(n).astype(np.float32),
            "reward": rng.standard_normal(n).astype(np.float32)}


def initial_priorities(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).random(n) + 0.01


def steady_loop(step, seconds: float, min_calls: int = 5, warmup: int = 2, warmup_s: float = 0.5,
                max_calls: int = 10 ** 9) -> dict:
    """Warm up (``warmup`` calls and at least ``warmup_s`` seconds), then call ``step()``
    repeatedly for ``seconds`` (at least ``min_calls`` times).

    Returns the number of timed calls, the elapsed wall time and the median and best call times (s).
    """
    t_end = time.perf_counter() + warmup_s
    n = 0
    while n < warmup or time.perf_counter() < t_end:
        step()
        n += 1
    times = []
    t_start = time.perf_counter()
    deadline = t_start + seconds
    while True:
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        if (t1 > deadline and len(times) >= min_calls) or len(times) >= max_calls:
            break
    return {"calls": len(times), "elapsed_s": time.perf_counter() - t_start,
            "median_call_s": float(np.median(times)), "best_call_s": float(np.min(times))}


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def fail(workload: str, peer: str, reason: str, **extra) -> None:
    """A case that could not be measured: reported, never dropped."""
    emit({"workload": workload, "peer": peer, "status": "failed", "reason": reason, **extra})


def available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def quit_workers(procs: list, timeout: float = 20.0) -> None:
    """Ask each worker process (a ``subprocess.Popen`` reading JSON commands on stdin) to quit, wait up
    to ``timeout`` seconds for each, and kill those that do not end."""
    for p in procs:
        try:
            p.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            p.stdin.flush()
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def parse_config(argv=None) -> dict:
    """Workers take one argument: a JSON object (the driver's config for this run)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit(f"usage: {os.path.basename(sys.argv[0])} '<json config>'")
    return json.loads(argv[0])
