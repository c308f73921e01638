#!/usr/bin/env python
"""cpprb worker for scripts/bench/compare_peers.py (runs in cpprb's own virtual environment).

    python cpprb_worker.py '{"workload": "W2", "N": 100000, "batches": [256], "seconds": 2}'
    python cpprb_worker.py '{"workload": "W3", "Ns": [100000, 10000000], "B": 65536, "seconds": 2}'

W2: cpprb.PrioritizedReplayBuffer holding N transitions (obs uint8[4096], action, reward);
one step = sample(B, beta) + update_priorities(indexes, new priorities).
W3: the same buffer with a one-float column, N items, B draws + B updates per step.
Prints one JSON object per case.
"""
from __future__ import annotations

import gc
import time

import numpy as np

from scripts.peers._common import (
    ALPHA, BETA, TRANSITION, available_bytes, emit, fail, initial_priorities, parse_config, step_bytes,
    steady_loop, transitions)


PEER = "cpprb"


def version() -> str:
    from importlib.metadata import version as v
    return f"cpprb {v('cpprb')}, numpy {np.__version__}"


def w2(cfg: dict) -> None:
    import cpprb

    n = int(cfg["N"])
    data = transitions(n)
    t0 = time.perf_counter()
    rb = cpprb.PrioritizedReplayBuffer(n, {"obs": {"shape": 4096, "dtype": np.uint8}, "action": {}, "reward": {}},
                                       alpha=ALPHA)
    p0 = initial_priorities(n)
    chunk = 10_000
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        rb.add(obs=data["obs"][lo:hi], action=data["action"][lo:hi], reward=data["reward"][lo:hi],
               priorities=p0[lo:hi])
    fill_s = time.perf_counter() - t0
    del data
    assert rb.get_stored_size() == n
    rng = np.random.default_rng(3)
    for b in cfg["batches"]:
        new_p = rng.random(b) + 0.01

        def step():
            s = rb.sample(b, beta=BETA)
            rb.update_priorities(s["indexes"], new_p)

        r = steady_loop(step, cfg["seconds"], warmup_s=cfg.get("warmup_s", 0.5))
        emit({"workload": "W2", "peer": PEER, "variant": "PrioritizedReplayBuffer", "sampler": "prioritized",
              "threads": 1, "clients": 1, "B": b, "N": n, "step_bytes": step_bytes(TRANSITION), **r,
              "bytes_per_call": b * step_bytes(TRANSITION), "fill_s": fill_s, "version": version()})


def w3(cfg: dict) -> None:
    import cpprb

    b = int(cfg["B"])
    for n in cfg["Ns"]:
        need = 4 * n + 16 * (1 << max(0, int(n - 1).bit_length())) + 16 * n
        if available_bytes() and need * 1.3 > available_bytes():
            fail("W3", PEER, f"skipped: needs about {need / 2**30:.1f} GiB", B=b, N=n)
            continue
        t0 = time.perf_counter()
        rb = cpprb.PrioritizedReplayBuffer(n, {"obs": {"shape": 1}}, alpha=ALPHA)
        p0 = initial_priorities(n)
        chunk = 1_000_000
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            rb.add(obs=np.zeros((hi - lo, 1), np.float32), priorities=p0[lo:hi])
        fill_s = time.perf_counter() - t0
        del p0
        new_p = np.random.default_rng(3).random(b) + 0.01

        def step():
            s = rb.sample(b, beta=BETA)
            rb.update_priorities(s["indexes"], new_p)

        r = steady_loop(step, cfg["seconds"], min_calls=3, warmup=1, warmup_s=cfg.get("warmup_s", 0.5))
        emit({"workload": "W3", "peer": PEER, "variant": "PrioritizedReplayBuffer sample+update_priorities",
              "sampler": "prioritized", "threads": 1, "clients": 1, "B": b, "N": n, "step_bytes": 4, **r,
              "bytes_per_call": 4 * b, "fill_s": fill_s, "version": version()})
        rb = None  # free before the next N
        gc.collect()


def main() -> None:
    cfg = parse_config()
    {"W2": w2, "W3": w3}[cfg["workload"]](cfg)


if __name__ == "__main__":
    main()
