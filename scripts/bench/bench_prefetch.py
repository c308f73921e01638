#!/usr/bin/env python
"""How much sampling time ``replay.batches(prefetch=...)`` hides behind a training step.

    mpiexec -n 2 python -m mpi4py -m scripts.bench.bench_prefetch                 # 2 ranks, ~2 min
    mpiexec -n 2 python -m mpi4py -m scripts.bench.bench_prefetch --quick         # ~30 s
    mpiexec -n 2 python -m mpi4py -m scripts.bench.bench_prefetch --compute wait,matmul --json

A training loop whose step costs about as much as the replay's work of a step
(``--compute-ratio`` times the time of one sample plus one priority update, measured at
the start of each repetition: the replay's speed drifts between repetitions on a shared
machine, and a step calibrated once could end up shorter than the replay's work). What the step is (``--compute``):

- ``wait`` (default): the step runs on an accelerator; the host thread only waits for it,
  without the GIL and without a core (a calibrated ``time.sleep``, which releases the GIL
  as ``torch.cuda.synchronize`` does). This is a training job's situation, and the only
  fair one when cores < 2 x ranks: a CPU step would take the core the sampling thread needs.
- ``matmul``: 256 x 256 torch matmuls on the host, ``torch.set_num_threads`` = the cores
  per rank left after one for the sampling thread (at least 1). With fewer than
  2 x ranks free cores the step and the sampling thread time-share a core, and the
  hidden share can only be what the spare cores allow: the run says so.

Cases, measured over ``--steps`` steps in every one of ``--reps`` repetitions, each
repetition in ``--chunks`` chunks (of at least 20 steps; 1 if ``--steps`` < 40) in which
every case runs once, in turn, after ``--warmup`` untimed steps (a new iterator each chunk);
a case's time in a repetition is its mean over the chunks; medians and min-max over
repetitions; the time of a step is the slowest rank's:

- ``sample``   ``replay.sample`` alone (for reference);
- ``replay``   ``replay.sample`` and ``replay.update_priorities`` of the batch's keys: the replay's
  work of a training step, all of which ``batches()`` moves to its thread;
- ``compute``  the step alone;
- ``plain``    sample, step, update, all in the training thread (about replay + compute);
- ``prefetchP`` ``replay.batches(..., prefetch=P)``: next(), step, the update through the iterator;
- ``prefetchP`` is ``recycle=False`` (a new batch per step); ``prefetchPr`` is ``recycle=True``:
  the thread refills a ring of P + 2 batches instead of allocating a new one per step;
  ``prefetchPa`` is ``recycle="auto"``, the default: the ring's batches are refilled when
  nothing outside the iterator holds them, as here (``--recycle``: no, yes, auto, both = no
  and yes, all = the three). ``recycledP..`` is the share of steps whose batch was refilled.

What costs in the thread (2 ranks x 1 core, W1 hopper, B=32): a fresh 2 MB batch costs it
tens of page faults per step (the training thread's own samples reuse the batch it just
freed and take none): with new batches prefetch=2 hid ~70 %, with a refilled ring ~85-95 %.
The update of step k runs while the step runs (after sample k + P, before k + P + 1), not in
front of the sample. The thread's own work costs what the training thread's does (the same
sample + update back to back in either thread: equal, phase by phase); what makes it slower
in this loop is waiting in its collectives: each is a rendezvous of the ranks' threads, and
with 2 x ranks threads on ranks cores every rank's training thread (0.10-0.15 ms of CPU a
step, right after its wake-up) and every other process preempt one of them. Fewer
rendezvous (the thread's updates: one allgather, not four collectives) and a lighter training-thread
side help; with compute ~= replay there is still no slack to absorb the rest.

Why chunks (2026-12-02, h14d): this VM's speed drifts by 10-40 % from one fraction of a
second to the next, with no other process running and under 2 % steal (the training thread's
own sample + update, timed 100 steps at a time, took 1.62-2.39 ms in one launch and 1.79-3.03
in another). With each case timed in one stretch (``--chunks 1``, the earlier scheme), a
repetition whose replay was timed in a fast stretch and its prefetch case in a slow one hid
59-78 %: the same replay work timed right after the prefetch case was as slow as the
prefetch thread (1.80 ms before, 2.24 after, thread 2.22; 1.79 before, 2.50 after; over 20
repetitions hidden and after/before correlate at -0.78), while the sleep step does not slow
down with the machine. The thread itself was not the cause: no garbage collection ran in it
(0 collections in the timed steps), numba ran its kernels on one thread (threading layer omp,
no pool threads), page faults were 0-2 a step, and its CPU time was 85-95 % of its wall time
(waiting by sleeping instead of sched_yield in the collectives changed nothing). Chunks make
every case share the machine's slow and fast stretches.

hidden = 1 - (prefetchP - compute) / replay: the share of the replay's time the step hid
(target >= 0.8, i.e. step with prefetch <= compute + 20 % of the sampling time), from the medians
over repetitions; "per rep" computes it in each repetition from that repetition's own times (the
step is calibrated per repetition, and the machine's speed drifts between them: medians of
different repetitions can pair a fast compute with a slow prefetch), then gives its median and range. ``thread``
and ``blocked`` are the iterator's ``sample_seconds`` and ``wait_seconds`` per step (slowest
rank): the thread's own time (sample + update), and how long the loop still waited for it.
When the thread's time exceeds the step's, the thread is the bottleneck and cannot be hidden.

Workload: W1 hopper trajectories (T=1000, 61 bytes per step), ``--batch`` whole windows of
``--window`` steps per rank, decentralized, uniform (``--sampler prioritized``); windows of
the other ranks travel through MPI (``--transport mpi``: ``force_alltoallv``, as between
hosts) or are read from node shared memory (``--transport shm``).
"""
from __future__ import annotations

import argparse
import collections
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
    from mpi4py import MPI
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    dt = (time.perf_counter() - t) / steps
    return comm.allreduce(dt, op=MPI.MAX)


def _overslept(seconds: float) -> float:
    t = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - t - seconds


class Compute:
    """A step of about ``seconds`` (:meth:`set`): ``wait`` sleeps (GIL and core free), ``matmul`` multiplies
    on the host. Calibrated once (the sleep's overshoot, a matmul's time); :meth:`set` is then free."""

    def __init__(self, kind: str, seconds: float, comm, torch_threads: int):
        self.kind = kind
        if kind == "wait":  # time.sleep oversleeps by tens of microseconds: ask for that much less
            self.over = float(np.median([_overslept(seconds) for _ in range(50)]))
        else:
            import torch
            torch.set_num_threads(torch_threads)
            self.a, self.threads = torch.randn(256, 256), torch_threads
            self.t_mm = timed(comm, lambda: self.a @ self.a, 200)
        self.set(seconds)

    def set(self, seconds: float) -> None:
        """Make the step last about ``seconds``."""
        if self.kind == "wait":
            self.s = max(0.0, seconds - self.over)
            self.what = f"sleep {self.s * 1e3:.2f} ms for {seconds * 1e3:.2f} ms (an accelerator step)"
        else:
            self.n = max(1, int(round(seconds / self.t_mm)))
            self.what = f"{self.n} torch matmuls 256x256 on {self.threads} thread(s)"

    def __call__(self) -> None:
        if self.kind == "wait":
            time.sleep(self.s)
        else:
            for _ in range(self.n):
                self.a @ self.a


RECYCLE_SUFFIX = {False: "", True: "r", "auto": "a"}  # batches(recycle=...) -> case name suffix


def run_kind(comm, replay, sample, kind, args, prefetches, recycles, B, W) -> dict:
    from mpi4py import MPI
    cores = os.cpu_count() or 1
    threads = max(1, cores // comm.size - 1)

    def replay_work():
        b = sample()
        replay.update_priorities(b.keys, np.ones(B))

    def plain_step():
        b = sample()
        compute()
        replay.update_priorities(b.keys, np.ones(B))

    # each repetition's steps run in chunks, every case once per chunk, so that every case sees the same
    # stretches of the machine: its speed drifts by 10-40 % within a second, and a case timed alone in a
    # slow stretch (or the replay in a fast one) skews that repetition (see the module docstring)
    chunks = max(1, min(args.chunks, args.steps // 20))
    per = [args.steps // chunks + (c < args.steps % chunks) for c in range(chunks)]
    rows = []
    for rep in range(args.reps):
        acc: dict = collections.defaultdict(float)
        replay_chunks = []
        # the step costs --compute-ratio x the replay's time, measured at the start of each repetition (a
        # step calibrated once per launch could end up shorter than the replay's work), and stays the same
        # through the repetition, as an accelerator's step would: calibrated per chunk, on fewer steps, its
        # noise would cost every case (a step the thread outlasts shows; one it outlasts is not credited).
        # The median of chunk-sized timings: a slow stretch during the calibration would make the step
        # of that repetition several times the replay's work
        cal = float(np.median([timed(comm, replay_work, n) for n in per]))
        compute = Compute(kind, args.compute_ratio * cal, comm, threads)
        for n in per:
            t_sample, t_replay = timed(comm, sample, n), timed(comm, replay_work, n)
            replay_chunks.append(t_replay)
            acc["sample"] += t_sample * n
            acc["replay"] += t_replay * n
            acc["compute"] += timed(comm, compute, n) * n
            for _ in range(args.warmup):
                plain_step()
            acc["plain"] += timed(comm, plain_step, n) * n
            for pf, r in ((pf, r) for pf in prefetches for r in recycles):
                name = f"{pf}{RECYCLE_SUFFIX[r]}"
                with replay.batches(B, W, "head", prefetch=pf, recycle=r) as it:
                    def step():
                        b = next(it)
                        compute()
                        it.update_priorities(b.keys, np.ones(B))
                    for _ in range(args.warmup):
                        step()
                    s0, w0, r0 = it.sample_seconds, it.wait_seconds, it.recycled
                    acc[f"prefetch{name}"] += timed(comm, step, n) * n
                    acc[f"recycled{name}"] += comm.allreduce(it.recycled - r0, op=MPI.MIN)
                    acc[f"thread{name}"] += comm.allreduce(it.sample_seconds - s0, op=MPI.MAX)
                    acc[f"blocked{name}"] += comm.allreduce(it.wait_seconds - w0, op=MPI.MAX)
        res = {k: v / args.steps for k, v in acc.items()}
        rows.append(res)
        drift = f" (replay by chunk {min(replay_chunks) * 1e3:.2f}-{max(replay_chunks) * 1e3:.2f} ms)" if chunks > 1 else ""
        log(comm, f"#   {kind} rep {rep + 1}/{args.reps}{drift}: " +
            ", ".join(f"{k} {v:.2f}" if k.startswith("recycled") else f"{k} {v * 1e3:.2f} ms"
                      for k, v in res.items()))
    what = compute.what
    med = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
    spread = {k: (min(r[k] for r in rows), max(r[k] for r in rows)) for k in rows[0]}
    out = {"compute_kind": kind, "step": what, "median_s": med, "spread_s": spread, "hidden": {}, "hidden_per_rep": {}}
    if comm.rank == 0:
        oversubscribed = kind == "matmul" and cores < 2 * comm.size
        print(f"\n## compute = {kind}: {what}" +
              (f"  [{cores} cores < 2 x {comm.size} ranks: step and sampling thread share a core]"
               if oversubscribed else ""))
        print(f"{'case':>10} {'ms/step':>9} {'min-max':>17}  {'thread':>7} {'blocked':>7}  hidden"
              f"{'':40}per rep: median (min-max)")
        for k in ("sample", "replay", "compute", "plain") + tuple(k for k in med if k.startswith("prefetch")):
            lo, hi = spread[k]
            extra = ""
            if k.startswith("prefetch"):
                p = k[len("prefetch"):]
                h = 1.0 - max(0.0, med[k] - med["compute"]) / med["replay"]
                out["hidden"][k] = h
                # each repetition's own compute and replay times (they drift between repetitions)
                per = sorted(1.0 - max(0.0, r[k] - r["compute"]) / r["replay"] for r in rows)
                out["hidden_per_rep"][k] = per
                extra = (f"  {med['thread' + p] * 1e3:7.2f} {med['blocked' + p] * 1e3:7.2f}  {h:5.0%}"
                         f"  (target >= 80%: {'met' if h >= 0.8 else 'not met'})"
                         f"{'':5}{float(np.median(per)):5.0%} ({per[0]:.0%}-{per[-1]:.0%})")
            print(f"{k:>10} {med[k] * 1e3:9.2f} {lo * 1e3:8.2f}-{hi * 1e3:<8.2f}{extra}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=128, help="hopper trajectories per rank")
    p.add_argument("--batch", type=int, default=32, help="windows per rank per step")
    p.add_argument("--window", type=int, default=1000)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--chunks", type=int, default=5,
                   help="run each repetition's steps in this many chunks (at least 20 steps each), every case "
                        "once per chunk, so that the cases share the machine's slow and fast stretches "
                        "(1: each case's steps in one run, as before)")
    p.add_argument("--prefetch", default="1,2")
    p.add_argument("--recycle", default="all", choices=["no", "yes", "auto", "both", "all"],
                   help="batches(recycle=...): False, new batches (prefetchP); True, a ring refilled "
                        "(prefetchPr); 'auto' (the default), refilled when nothing holds them (prefetchPa); "
                        "both: no and yes; all: the three")
    p.add_argument("--compute", default="wait", help="comma list of: wait, matmul")
    p.add_argument("--compute-ratio", type=float, default=1.0)
    p.add_argument("--sampler", default="uniform", choices=["uniform", "prioritized"])
    p.add_argument("--transport", default="mpi", choices=["mpi", "shm"])
    p.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.reps = 40, 3
    kinds = args.compute.split(",")
    if not set(kinds) <= {"wait", "matmul"}:
        p.error(f"--compute: wait and/or matmul, got {args.compute}")
    import gear_mpi as gm
    from mpi4py import MPI

    from scripts.peers._common import HOPPER, HOPPER_T, hopper_trajectory
    comm = MPI.COMM_WORLD
    spec = gm.TrajectorySpec({k: (s, np.dtype(d)) for k, (s, d) in HOPPER.items()}, max_length=HOPPER_T)
    sampler = gm.Uniform() if args.sampler == "uniform" else gm.Prioritized(0.6, 0.4)
    replay = gm.Replay(spec, args.items * HOPPER_T, sampler, seed=3, force_alltoallv=args.transport == "mpi")
    base = hopper_trajectory(comm.rank)
    for i in range(args.items):
        replay.insert(base, 1.0 + (i % 7))
    B, W = args.batch, args.window

    def sample():
        return replay.sample(B, W, "head")

    def replay_work():
        b = sample()
        replay.update_priorities(b.keys, np.ones(B))

    for _ in range(args.warmup):
        replay_work()
    t_replay = timed(comm, replay_work, args.steps)
    load0 = os.getloadavg()
    log(comm, f"# {comm.size} ranks, load average {load0}, sample + update {t_replay * 1e3:.2f} ms")
    prefetches = [int(x) for x in args.prefetch.split(",")]
    recycles = {"no": [False], "yes": [True], "auto": ["auto"], "both": [False, True],
                "all": [False, True, "auto"]}[args.recycle]
    results = [run_kind(comm, replay, sample, k, args, prefetches, recycles, B, W) for k in kinds]
    if comm.rank == 0:
        load1 = os.getloadavg()
        print(f"\n# bench_prefetch: {comm.size} rank(s), {os.cpu_count()} cores, {platform.node()}, MPI "
              f"thread level {MPI.Query_thread()}, W1 hopper, B={B}/rank, W={W}, {args.sampler}, transport "
              f"{args.transport}, {args.steps} steps x {args.reps} reps (median, min-max over reps); "
              f"load average before {tuple(round(x, 2) for x in load0)}, after {tuple(round(x, 2) for x in load1)}")
        if args.json:
            print(json.dumps({"bench": "prefetch", "ranks": comm.size, "cores": os.cpu_count(), "batch": B,
                              "window": W, "sampler": args.sampler, "transport": args.transport,
                              "load_before": load0, "load_after": load1, "results": results}))
    replay.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
