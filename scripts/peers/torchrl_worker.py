#!/usr/bin/env python
"""TorchRL worker for scripts/bench/compare_peers.py (runs in TorchRL's own virtual environment).

    python torchrl_worker.py '{"workload": "W2", "N": 100000, "batches": [256], "seconds": 2}'
    python torchrl_worker.py '{"workload": "W3", "Ns": [100000, 10000000], "B": 65536, "seconds": 2}'

Two ways of using TorchRL's prioritized replay, both over a LazyTensorStorage:
  TDPRB -- TensorDictPrioritizedReplayBuffer: sample(), write the new priorities into the
           sampled TensorDict, update_tensordict_priority(sample);
  PrioritizedSampler -- ReplayBuffer(storage, PrioritizedSampler): sample(return_info=True),
           update_priority(info["index"], new priorities).
W2: N transitions (obs uint8[4096], action, reward). W3: N one-float items, B draws + B
updates per step. Prints one JSON object per case.
"""
from __future__ import annotations

import gc
import time

import numpy as np

from scripts.peers._common import (
    ALPHA, BETA, TRANSITION, available_bytes, emit, fail, initial_priorities, parse_config, step_bytes,
    steady_loop, transitions)


PEER = "torchrl"


def version() -> str:
    import torch
    from importlib.metadata import version as v
    return f"torchrl {v('torchrl')}, tensordict {v('tensordict')}, torch {torch.__version__}"


def set_threads(cfg: dict) -> None:
    import torch
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))


def build(kind: str, n: int, data: dict, p0: np.ndarray, batch: int):
    import torch
    from tensordict import TensorDict
    import torchrl  # noqa: F401
    from torchrl.data import LazyTensorStorage, PrioritizedSampler, ReplayBuffer, TensorDictPrioritizedReplayBuffer

    td = TensorDict({k: torch.from_numpy(v) for k, v in data.items()}, batch_size=[n])
    if kind == "TDPRB":
        rb = TensorDictPrioritizedReplayBuffer(alpha=ALPHA, beta=BETA, storage=LazyTensorStorage(n),
                                               batch_size=batch, priority_key="td_error")
    else:
        rb = ReplayBuffer(storage=LazyTensorStorage(n), sampler=PrioritizedSampler(n, ALPHA, BETA),
                          batch_size=batch)
    chunk = 1_000_000
    for lo in range(0, n, chunk):
        rb.extend(td[lo:min(n, lo + chunk)])
    rb.update_priority(torch.arange(n), torch.from_numpy(p0.astype(np.float32)))  # its priorities are float32
    assert len(rb) == n
    return rb


def make_step(kind: str, rb, b: int, new_p):
    if kind == "TDPRB":
        def step():
            s = rb.sample(b)
            s.set("td_error", new_p)
            rb.update_tensordict_priority(s)
    else:
        def step():
            _, info = rb.sample(b, return_info=True)
            rb.update_priority(info["index"], new_p)
    return step


def w2(cfg: dict) -> None:
    import torch

    n = int(cfg["N"])
    data = transitions(n)
    p0 = initial_priorities(n)
    for kind in cfg.get("kinds", ["TDPRB", "PrioritizedSampler"]):
        t0 = time.perf_counter()
        try:
            rb = build(kind, n, data, p0, cfg["batches"][0])
        except Exception as e:  # reported, not dropped
            fail("W2", PEER, f"{kind}: {type(e).__name__}: {e}", variant=kind, N=n)
            continue
        fill_s = time.perf_counter() - t0
        rng = np.random.default_rng(3)
        for b in cfg["batches"]:
            new_p = torch.from_numpy((rng.random(b) + 0.01).astype(np.float32))
            r = steady_loop(make_step(kind, rb, b, new_p), cfg["seconds"], warmup_s=cfg.get("warmup_s", 0.5))
            emit({"workload": "W2", "peer": PEER, "variant": kind, "sampler": "prioritized",
                  "threads": cfg.get("threads"), "clients": 1, "B": b,
                  "N": n, "step_bytes": step_bytes(TRANSITION), **r, "bytes_per_call": b * step_bytes(TRANSITION),
                  "fill_s": fill_s, "version": version()})
        rb = None  # free before the next N
        gc.collect()


def w3(cfg: dict) -> None:
    import torch

    b = int(cfg["B"])
    for n in cfg["Ns"]:
        need = 4 * n + 2 * 16 * (1 << max(0, int(n - 1).bit_length())) + 24 * n
        if available_bytes() and need * 1.3 > available_bytes():
            fail("W3", PEER, f"skipped: needs about {need / 2**30:.1f} GiB", B=b, N=n)
            continue
        data = {"obs": np.zeros((n, 1), np.float32)}
        p0 = initial_priorities(n)
        for kind in cfg.get("kinds", ["PrioritizedSampler"]):
            t0 = time.perf_counter()
            try:
                rb = build(kind, n, data, p0, b)
            except Exception as e:
                fail("W3", PEER, f"{kind}: {type(e).__name__}: {e}", variant=kind, B=b, N=n)
                continue
            fill_s = time.perf_counter() - t0
            new_p = torch.from_numpy((np.random.default_rng(3).random(b) + 0.01).astype(np.float32))
            r = steady_loop(make_step(kind, rb, b, new_p), cfg["seconds"], min_calls=3, warmup=1,
                            warmup_s=cfg.get("warmup_s", 0.5))
            emit({"workload": "W3", "peer": PEER, "variant": f"{kind} sample+update_priority",
                  "sampler": "prioritized", "threads": cfg.get("threads"), "clients": 1, "B": b, "N": n,
                  "step_bytes": 4, **r,
                  "bytes_per_call": 4 * b, "fill_s": fill_s, "version": version()})
            rb = None  # free before the next variant
            gc.collect()
        del data, p0


def main() -> None:
    cfg = parse_config()
    set_threads(cfg)
    {"W2": w2, "W3": w3}[cfg["workload"]](cfg)


if __name__ == "__main__":
    main()
