#!/usr/bin/env python
"""Soak test of gm.Replay: inserts, samples and priority updates on K ranks for a while, with
throughput over time and a check that resident memory stays flat once the replay is full.

    mpiexec -n 4 python -m mpi4py -m scripts.checks.soak --seconds 600   # on the ranks it was started with
    python -m scripts.checks.soak --ranks 2 --seconds 10                 # starts mpiexec -n 2 itself

Every iteration, on every rank: ``insert_many`` of ``--inserts`` trajectories (random lengths
up to ``--length``), one collective ``sample(--batch, --window)``, one collective
``update_priorities`` of the sampled keys (one such iteration runs untimed before the clock starts: kernel
loads and torch's import are start-up). The replay holds ``--capacity`` steps per rank, so
FIFO eviction starts after a few seconds and the replay stays full from then on.

Output (rank 0): one row per ``--interval`` seconds, summed over ranks -- inserts/s, samples/s
(sampled windows), updates/s (priorities applied), delivered MB/s (bytes of the returned batch
tensors), the largest rank's resident set (RSS, from /proc/self/statm) and the live items.
Then the RSS of the largest rank at start, when capacity was reached (measured one interval
later, so that pages touched once by the first gathers of node peers' windows are counted),
and at the end; the growth after capacity; and ``memory: flat`` or ``memory: GROWING``.

Exit status: 0 when the RSS of every rank grew by at most ``--tolerance-mb`` after capacity
was reached; 1 when it grew more; 2 when capacity was never reached (run longer).
``--json`` prints each row and the summary as JSON objects instead.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from scripts.bench.bench_memory import rss_bytes

ROOT = Path(__file__).resolve().parents[2]   # the repository: run as modules from there



def rss_mb() -> float:
    """Resident set size of this process (VmRSS, :func:`scripts.bench.bench_memory.rss_bytes`), in MiB."""
    return rss_bytes() / 2**20


def worker(args) -> int:
    from mpi4py import MPI

    import gear_mpi as gm

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    spec = gm.TrajectorySpec({"obs": ((args.obs,), "float32"), "action": ((4,), "float32"),
                              "reward": ((), "float32"), "done": ((), "bool")}, max_length=args.length)
    sampler = gm.Prioritized(0.6, 0.4) if args.sampler == "prioritized" else gm.Uniform()
    replay = gm.Replay(spec, args.capacity, sampler, mode=args.mode, seed=0, timeout=args.timeout,
                       force_alltoallv=args.force_alltoallv)
    rng = np.random.default_rng(1000 + rank)
    # a pool of trajectories reused in turn: the soak measures the replay, not the generator
    pool = []
    for i in range(64):
        n = int(rng.integers(1, args.length + 1))
        pool.append({"obs": rng.standard_normal((n, args.obs)).astype(np.float32),
                     "action": rng.standard_normal((n, 4)).astype(np.float32),
                     "reward": rng.standard_normal(n).astype(np.float32), "done": np.arange(n) == n - 1})
    rss_start = rss_mb()
    out = sys.stdout
    if rank == 0 and not args.json:
        print(f"# soak: ranks={size} capacity_steps/rank={args.capacity} step_bytes={spec.step_bytes} "
              f"inserts/iter/rank={args.inserts} batch/rank={args.batch} window={args.window} mode={args.mode} "
              f"sampler={args.sampler} seconds={args.seconds:g} interval={args.interval:g}", flush=True)
        print(f"# {'time_s':>7} {'inserts/s':>10} {'samples/s':>10} {'updates/s':>10} {'MB/s':>9} "
              f"{'rss_max_MB':>10} {'items':>9} {'full':>5}", flush=True)
    # one untimed iteration first: the kernels' first load and torch's import (at the first tensor read) are
    # start-up, not the loop (they took 2.5 s of a 3 s run on a loaded machine, leaving no interval at capacity)
    replay.insert_many(pool[:args.inserts], rng.uniform(0.1, 2.0, args.inserts))
    b = replay.sample(args.batch, args.window)
    replay.update_priorities(b.keys, rng.uniform(0.1, 2.0, len(b)))
    b.data  # noqa: B018 -- the tensors made (torch imported), as the loop reads them
    del b
    t0 = time.perf_counter()
    next_row = t0 + args.interval
    counts = np.zeros(4)  # inserts, samples, updates, delivered bytes (this rank, this interval)
    full_at = None  # time capacity was reached on every rank
    rss_cap = None  # RSS (per rank) one interval after that
    rows = []
    j = 0
    done = False
    while not done:
        batch_in = [pool[(j * args.inserts + k) % len(pool)] for k in range(args.inserts)]
        replay.insert_many(batch_in, rng.uniform(0.1, 2.0, args.inserts))
        b = replay.sample(args.batch, args.window)
        applied = replay.update_priorities(b.keys, rng.uniform(0.1, 2.0, len(b)))
        counts += (args.inserts, len(b), applied, sum(t.numel() * t.element_size() for t in b.data.values()))
        j += 1
        now = time.perf_counter()
        # every rank decides together: end of an interval, end of the run
        flags = np.zeros(2, np.int64)
        comm.Allreduce(np.array([now >= next_row, now - t0 >= args.seconds], np.int64), flags, op=MPI.MAX)
        if not flags[0] and not flags[1]:
            continue
        done = bool(flags[1])
        st = replay.stats()
        full = all(e > 0 for e in st["per_rank"]["evicted"])
        elapsed = max(now - (next_row - args.interval), 1e-9)
        tot = np.zeros(4)
        comm.Allreduce(counts, tot, op=MPI.SUM)
        rss = rss_mb()
        rss_all = comm.allgather(rss)
        row = dict(time_s=round(now - t0, 2), inserts_per_s=tot[0] / elapsed, samples_per_s=tot[1] / elapsed,
                   updates_per_s=tot[2] / elapsed, mb_per_s=tot[3] / elapsed / 1e6, rss_max_mb=max(rss_all),
                   items=st["total"]["items"], full=full)
        rows.append(row)
        if rank == 0:
            if args.json:
                print(json.dumps(row), file=out, flush=True)
            else:
                print(f"  {row['time_s']:>7.1f} {row['inserts_per_s']:>10.0f} {row['samples_per_s']:>10.0f} "
                      f"{row['updates_per_s']:>10.0f} {row['mb_per_s']:>9.1f} {row['rss_max_mb']:>10.1f} "
                      f"{row['items']:>9} {'yes' if full else 'no':>5}", flush=True)
        if full and full_at is None:
            full_at = now - t0
        elif full_at is not None and rss_cap is None:
            rss_cap = rss  # one interval after capacity was reached
        counts[:] = 0
        next_row = now + args.interval
    rss_end = rss_mb()
    growth = comm.allgather((rss_end - rss_cap) if rss_cap is not None else float("nan"))
    starts, caps, ends = comm.allgather(rss_start), comm.allgather(rss_cap), comm.allgather(rss_end)
    replay.close()
    status = 0
    if rss_cap is None:
        status = 2
        verdict = "capacity not reached (or reached in the last interval): run longer"
    else:
        worst = max(growth)
        status = 0 if worst <= args.tolerance_mb else 1
        verdict = "flat" if status == 0 else "GROWING"
    if rank == 0:
        summary = dict(rss_start_mb=max(starts), rss_at_capacity_mb=max(c for c in caps if c is not None)
                       if rss_cap is not None else None, rss_end_mb=max(ends),
                       growth_after_capacity_mb=max(growth) if rss_cap is not None else None,
                       tolerance_mb=args.tolerance_mb, capacity_reached_s=full_at, iterations=j, memory=verdict)
        if args.json:
            print(json.dumps(summary), flush=True)
        else:
            cap_txt = f"{summary['rss_at_capacity_mb']:.1f}" if rss_cap is not None else "n/a"
            reached = f"{full_at:.1f}" if full_at is not None else "never"
            print(f"# rss (largest rank, MiB): start {summary['rss_start_mb']:.1f}, at capacity {cap_txt} "
                  f"(full after {reached} s), end {summary['rss_end_mb']:.1f}", flush=True)
            if rss_cap is not None:
                print(f"# growth after capacity: {max(growth):+.2f} MiB (per rank: "
                      f"{', '.join(f'{g:+.2f}' for g in growth)}; tolerance {args.tolerance_mb:g} MiB)", flush=True)
            print(f"# memory: {verdict}", flush=True)
    return status


def driver(args, argv: list[str]) -> int:
    """Start ``mpiexec -n K`` on this script and relay its output and exit status."""
    here = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(here) if here.exists() else "mpiexec"
    i = argv.index("--ranks") if "--ranks" in argv else None
    passthrough = argv[:i] + argv[i + 2:] if i is not None else [a for a in argv if not a.startswith("--ranks=")]
    env = dict(os.environ)
    env.setdefault("NUMBA_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.ranks)))
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        # -m mpi4py: an exception on one rank aborts every rank at once
        proc = subprocess.run([mpiexec, "-n", str(args.ranks), sys.executable, "-m", "mpi4py", "-m",
                               "scripts.checks.soak", *passthrough], env=env, timeout=args.seconds + args.timeout + 120, cwd=ROOT)
    except subprocess.TimeoutExpired:
        print("# soak: mpiexec did not finish in time", file=sys.stderr)
        return 3
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, help="start mpiexec -n RANKS on this script")
    p.add_argument("--seconds", type=float, default=60.0, help="how long to run (default 60)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds per output row (default 1)")
    p.add_argument("--capacity", type=int, default=100_000, help="capacity in steps per rank (default 100000)")
    p.add_argument("--length", type=int, default=64, help="longest trajectory, in steps (default 64)")
    p.add_argument("--obs", type=int, default=32, help="floats per observation (default 32)")
    p.add_argument("--inserts", type=int, default=32, help="trajectories inserted per iteration per rank")
    p.add_argument("--batch", type=int, default=64, help="windows sampled per iteration per rank")
    p.add_argument("--window", type=int, default=16, help="steps per window")
    p.add_argument("--mode", default="decentralized", choices=["decentralized", "centralized", "local"])
    p.add_argument("--sampler", default="prioritized", choices=["prioritized", "uniform"])
    p.add_argument("--force-alltoallv", action="store_true", help="send every remote window through MPI")
    p.add_argument("--tolerance-mb", type=float, default=16.0,
                   help="allowed RSS growth per rank after capacity is reached, MiB (default 16)")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of each collective, seconds")
    p.add_argument("--json", action="store_true", help="JSON rows and summary")
    args = p.parse_args(argv)
    if args.ranks:
        return driver(args, argv)
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
