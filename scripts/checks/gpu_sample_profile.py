#!/usr/bin/env python3
"""Where one rank's ``Replay.sample`` on the GPU spends its time (a GPU node; about 30 s).

Builds the replay of ``gpu_check``'s ``sample`` row (one rank, ``mode="local"``, ``device="cuda"``,
1e6 steps of 292 bytes in 1000 trajectories of 500-1000 steps, Prioritized), then prints:

- the median time of ``sample(B, W)`` and the bytes it delivers per second;
- cProfile's top functions by their own time over ``--reps`` samples (host-side cost);
- torch.profiler's table of device kernels and copies over the same samples (numba's kernels
  included: CUPTI sees every kernel in the process), so host time and device time can be compared.

    python -m scripts.checks.gpu_sample_profile [--batch 4096] [--window 64] [--reps 20]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("gpu_sample_profile: torch sees no GPU; nothing to profile")
        return 0
    from mpi4py import MPI
    import gear_mpi as gm
    spec = gm.TrajectorySpec({"obs": ((64,), "float32"), "action": ((6,), "float32"), "reward": ((), "float32"),
                              "t": ((), "int64")}, max_length=1000)
    replay = gm.Replay(spec, 1_000_000, gm.Prioritized(0.6, 0.4), mode="local", comm=MPI.COMM_SELF, device="cuda",
                       seed=0)
    rng = np.random.default_rng(0)
    trajs = []
    for i in range(1000):
        n = int(rng.integers(500, 1001))
        trajs.append({"obs": rng.standard_normal((n, 64), dtype=np.float32),
                      "action": rng.standard_normal((n, 6), dtype=np.float32),
                      "reward": rng.standard_normal(n, dtype=np.float32), "t": np.arange(n, dtype=np.int64)})
    for lo in range(0, 1000, 250):
        replay.insert_many(trajs[lo:lo + 250], rng.random(250) + 0.01)
    b, w = args.batch, args.window

    def one():
        batch = replay.sample(b, w)
        torch.cuda.synchronize()
        return batch

    nbytes = one().nbytes
    ts = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        one()
        ts.append(time.perf_counter() - t0)
    t = float(np.median(ts))
    print(f"Replay.sample({b}, {w}) on {torch.cuda.get_device_name(0)}: median {t * 1e3:.3f} ms "
          f"(min {min(ts) * 1e3:.3f}, max {max(ts) * 1e3:.3f}) over {args.reps}; {nbytes / 2 ** 20:.1f} MiB, "
          f"{nbytes / t / 1e9:.2f} GB/s delivered")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.reps):
        one()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    print(out.getvalue())
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        for _ in range(args.reps):
            one()
    print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
    replay.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
