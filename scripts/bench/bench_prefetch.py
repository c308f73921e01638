#!/usr/bin/env python
"""How much sampling time ``replay.batches(prefetch=...)`` hides behind a training step.

    mpiexec -n 2 python -m mpi4py -m scripts.bench.bench_prefetch            # 2 ranks, ~1 min
    mpiexec -n 1 python -m mpi4py -m scripts.bench.bench_prefetch --quick
    python -m mpi4py -m scripts.bench.bench_prefetch --json                  # JSON lines on rank 0

A training loop whose step costs about as much as one sample: the step is a torch
matmul loop on one thread (``torch.set_num_threads(1)``), sized at start-up so that it
takes about ``--compute-ratio`` times the measured sample time. Measured per case, over
``--steps`` steps after ``--warmup`` untimed ones, medians of ``--reps`` repetitions with
their spread (cases alternate):

- ``sample``  the sample alone (``replay.sample`` in a loop);
- ``compute`` the step alone;
- ``plain``   sample then step, in the training thread;
- ``prefetch`` ``for batch in replay.batches(..., prefetch=P)``: step, and a priority update
  of the batch's keys through the iterator every step (the same in ``plain``).

hidden = 1 - (prefetch - compute) / sample: the share of the sampling time the step hid
(target >= 0.8, i.e. prefetch <= compute + 20% of sample); ``plain`` shows what the loop
costs without it. Workload: W1's hopper
trajectories, whole windows of 1000 steps, batch 32 per rank, uniform (or
``--sampler prioritized``). On a machine with fewer free cores than ranks x 2 threads
the sampling thread competes with the step for a core: the load average is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np


def log(comm, *a) -> None:
    if comm.rank == 0:
        print(*a, file=sys.stderr, flush=True)


def timed(comm, fn, steps: int) -> float:
    """Seconds per step of ``fn`` over ``steps`` calls, every rank started together (max over ranks)."""
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    dt = (time.perf_counter() - t) / steps
    return comm.allreduce(dt, op=_mpi().MAX)


def _mpi():
    from mpi4py import MPI
    return MPI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=256, help="hopper trajectories per rank")
    p.add_argument("--batch", type=int, default=32, help="windows per rank per step")
    p.add_argument("--window", type=int, default=1000)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prefetch", default="1,2")
    p.add_argument("--compute-ratio", type=float, default=1.0)
    p.add_argument("--sampler", default="uniform", choices=["uniform", "prioritized"])
    p.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.reps, args.items = 25, 2, 96
    import torch
    torch.set_num_threads(1)
    import gear_mpi as gm
    from scripts.peers._common import HOPPER, HOPPER_T, hopper_trajectory
    MPI = _mpi()
    comm = MPI.COMM_WORLD
    spec = gm.TrajectorySpec({k: (s, np.dtype(d)) for k, (s, d) in HOPPER.items()}, max_length=HOPPER_T)
    sampler = gm.Uniform() if args.sampler == "uniform" else gm.Prioritized(0.6, 0.4)
    replay = gm.Replay(spec, args.items * HOPPER_T, sampler, seed=3)
    base = hopper_trajectory(comm.rank)
    for i in range(args.items):
        replay.insert(base, 1.0 + (i % 7))
    B, W = args.batch, args.window

    def sample():
        return replay.sample(B, W, "head")

    for _ in range(args.warmup):
        sample()
    t_sample = timed(comm, sample, args.steps)
    # a step of about compute_ratio * t_sample: n matmuls of 256 x 256 on one thread
    a = torch.randn(256, 256)
    t_mm = timed(comm, lambda: a @ a, 200)
    n_mm = max(1, int(round(args.compute_ratio * t_sample / t_mm)))

    def compute(batch=None):
        x = a
        for _ in range(n_mm):
            x = a @ a
        return x

    def plain_step():
        b = sample()
        compute(b)
        replay.update_priorities(b.keys, np.ones(B))

    rows = []
    prefetches = [int(x) for x in args.prefetch.split(",")]
    log(comm, f"# {comm.size} ranks, load average {os.getloadavg()}, sample {t_sample * 1e3:.2f} ms, "
              f"step = {n_mm} matmuls")
    for rep in range(args.reps):
        res = {"sample": timed(comm, sample, args.steps), "compute": timed(comm, compute, args.steps)}
        for _ in range(args.warmup):
            plain_step()
        res["plain"] = timed(comm, plain_step, args.steps)
        for pf in prefetches:
            with replay.batches(B, W, "head", prefetch=pf) as it:
                for _ in range(args.warmup):
                    b = next(it)
                    compute(b)
                    it.update_priorities(b.keys, np.ones(B))

                def step():
                    b = next(it)
                    compute(b)
                    it.update_priorities(b.keys, np.ones(B))
                res[f"prefetch{pf}"] = timed(comm, step, args.steps)
        rows.append(res)
    if comm.rank == 0:
        med = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
        spread = {k: (min(r[k] for r in rows), max(r[k] for r in rows)) for k in rows[0]}
        print(f"# bench_prefetch: {comm.size} rank(s), {platform.node()}, load average now {os.getloadavg()}, "
              f"W1 hopper, B={B}/rank, W={W}, {args.sampler}, {args.steps} steps x {args.reps} reps (median, min-max)")
        print(f"{'case':>10} {'ms/step':>9} {'min-max':>17}  hidden")
        for k in med:
            lo, hi = spread[k]
            hidden = ""
            if k.startswith("prefetch"):
                h = 1.0 - max(0.0, med[k] - med["compute"]) / med["sample"]
                hidden = f"{h:6.0%}  (target >= 80%: {'met' if h >= 0.8 else 'not met'})"
            print(f"{k:>10} {med[k] * 1e3:9.2f} {lo * 1e3:8.2f}-{hi * 1e3:<8.2f}  {hidden}")
        if args.json:
            print(json.dumps({"bench": "prefetch", "ranks": comm.size, "median_s": med, "spread_s": spread,
                              "sampler": args.sampler, "batch": B, "window": W}))
    replay.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
