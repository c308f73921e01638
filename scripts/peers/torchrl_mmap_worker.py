#!/usr/bin/env python
"""TorchRL worker of scripts/bench/bench_mmap.py (runs in TorchRL's own venv, see compare_peers.py).

    python -m scripts.peers.torchrl_mmap_worker '{"dir": "/tmp/x", "items": 53, "T": 1000, "B": 64, "W": 32,
                                                  "cold_reps": 5, "seconds": 3}'

TorchRL's offline replay over files: ``ReplayBuffer(LazyMemmapStorage(N, scratch_dir=dir),
SliceSampler(slice_len=W, traj_key="episode", cache_values=True), batch_size=B * W)`` holding the
same image trajectories as the gear_mpi side (scripts/peers/_offline.py). Prints one JSON row
per case: fill, cold (each sample right after every storage page was evicted) and warm (every
page cached) sampling of B windows of W steps.
"""
from __future__ import annotations

import gc
import time

import numpy as np

from scripts.peers._common import emit, fail, parse_config, steady_loop
from scripts.peers._offline import evict, image_step_bytes, image_trajectory, read_bytes, resident

PEER = "torchrl"


def version() -> str:
    import torch
    from importlib.metadata import version as v
    return f"torchrl {v('torchrl')}, tensordict {v('tensordict')}, torch {torch.__version__}"


def leaves(rb) -> list:
    td = rb._storage._storage
    return [t for t in td.values(include_nested=True, leaves_only=True)]


def main() -> None:
    cfg = parse_config()
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, ReplayBuffer, SliceSampler

    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    n, T, B, W = int(cfg["items"]), int(cfg["T"]), int(cfg["B"]), int(cfg["W"])
    base = {"B": B, "W": W, "T": T, "items": n, "step_bytes": image_step_bytes(), "version": version(),
            "bytes_per_call": B * W * image_step_bytes()}
    try:
        t0 = time.perf_counter()
        rb = ReplayBuffer(storage=LazyMemmapStorage(n * T, scratch_dir=cfg["dir"], existsok=True),
                          sampler=SliceSampler(slice_len=W, traj_key="episode", cache_values=True),
                          batch_size=B * W)
        for i in range(n):
            data = image_trajectory(i, T)
            td = TensorDict({k: torch.from_numpy(v) for k, v in data.items()}, batch_size=[T])
            td["episode"] = torch.full((T,), i, dtype=torch.int64)
            rb.extend(td)
        fill_s = time.perf_counter() - t0
    except Exception as e:  # reported, never dropped
        fail("offline", PEER, f"build: {type(e).__name__}: {e}", **base)
        return
    emit({"workload": "offline", "peer": PEER, "case": "fill", "seconds": fill_s,
          "gbps": n * T * image_step_bytes() / fill_s / 1e9, **base})
    tensors = leaves(rb)

    def check(s) -> None:
        obs, act = s["obs"].reshape(B, W, 84, 84, 4), s["action"].reshape(B, W)
        i = int(act[0, 0]) // T
        assert torch.equal(obs[0], torch.from_numpy(image_trajectory(i, T)["obs"][int(act[0, 0]) % T:][:W]))
        assert bool(((act[:, 1:] - act[:, :-1]) == 1).all()), "each window is consecutive steps"

    check(rb.sample())
    cold, disk = [], []
    for _ in range(int(cfg["cold_reps"])):
        for t in tensors:
            evict(t.data_ptr(), t.numel() * t.element_size())
        left = sum(resident(t.data_ptr(), t.numel() * t.element_size()) for t in tensors)
        d0 = read_bytes()
        t0 = time.perf_counter()
        rb.sample()
        cold.append(time.perf_counter() - t0)
        disk.append(read_bytes() - d0)
    emit({"workload": "offline", "peer": PEER, "case": "cold", "median_call_s": float(np.median(cold)),
          "best_call_s": float(np.min(cold)), "calls": len(cold), "resident_after_evict": left,
          "q25_call_s": float(np.percentile(cold, 25)), "q75_call_s": float(np.percentile(cold, 75)),
          "disk_bytes_per_call": float(np.median(disk)),
          "gbps": base["bytes_per_call"] / float(np.median(cold)) / 1e9, **base})
    with open("/proc/meminfo") as f:
        avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    steady = sum(t.numel() * t.element_size() for t in tensors) > 0.8 * avail  # larger than RAM: stays cold
    for t in ([] if steady else tensors):  # warm: every page read into the page cache
        t.sum() if t.dtype != torch.bool else t.any()
    r = steady_loop(rb.sample, float(cfg["seconds"]), warmup_s=0.3)
    emit({"workload": "offline", "peer": PEER, "case": "warm", **r, "steady_state": steady,
          "gbps": base["bytes_per_call"] / r["median_call_s"] / 1e9, **base})
    del rb, tensors
    gc.collect()


if __name__ == "__main__":
    main()
