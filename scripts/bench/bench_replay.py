#!/usr/bin/env python
"""Delivered throughput of gm.Replay.sample: the GEAR paper's workloads, every mode and window path.

Two ways to run it:

    mpiexec -n 4 python -m mpi4py -m scripts.bench.bench_replay --quick   # on the ranks it was started with
    python -m scripts.bench.bench_replay --ranks 1,2,4                    # starts mpiexec -n K itself for each K

(``-m mpi4py``: an exception on one rank aborts every rank at once instead of leaving the
others waiting in a collective.)

Workloads (``--workloads``):
  hopper -- trajectories of T=1000 steps (obs 11 float32, action 3 float32, reward float32,
            done bool), whole trajectories (window 1000), batch 32 per rank;
  image  -- 84x84x4 uint8 observations, window 32, batch 64 per rank (trajectories of 200 steps);
  transitions -- hopper columns, one-step items (100k per rank), batch 256: selection-bound.

Each sampled batch's priorities are then updated (collective ``update_priorities``), timed
apart. Before timing, each case runs 3 untimed sample + update rounds (kernels compiled or
loaded from numba's cache, pages faulted in), and the timed loop refills one batch with
``sample(..., out=batch)`` as a training loop would (``--fresh-batches``: a new batch per call). For each case the table gives: ranks, workload, mode, window path (``shm``: windows of
node peers copied straight from their shared memory; ``alltoallv``: every window owned
by another rank sent through MPI), batch per rank, window, delivered bytes per call
(summed over ranks: bytes of the returned batch tensors), time per call (median over
calls of the slowest rank), delivered GB/s, that as a percentage of this
machine's memcpy rate measured in the same run, and the time of the priority update. ``--json`` prints one JSON object per case.

The memcpy reference is one large ``np.copyto`` (256 MiB; 64 MiB with ``--quick``), best of 5,
on rank 0, before the cases, while every other rank sleeps: they wait in an ``Ibarrier``
polled with ``time.sleep``, so they take no core from it (a blocking MPI wait would spin).
The line ``# memcpy reference: ...`` gives the rate and the CPU the waiting ranks used
meanwhile (``memcpy_peers_cpu`` in the JSON rows: the largest fraction of the wall time).

``--quick`` is a demo, not a measurement: 24 trajectories per rank (a few MB, so the
copies run from cache and ``%memcpy`` can pass 100%) and 0.5 s per case. The figures
quoted in README.md use ``--items 512`` (rings larger than the L3 cache) and longer cases.
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

from scripts.bench.json_lines import json_rows

ROOT = Path(__file__).resolve().parents[2]   # the repository: run as modules from there

WORKLOADS = {
    "hopper": dict(columns={"obs": ((11,), "float32"), "action": ((3,), "float32"), "reward": ((), "float32"),
                            "done": ((), "bool")}, length=1000, window=1000, batch=32),
    "image": dict(columns={"obs": ((84, 84, 4), "uint8"), "action": ((), "int32"), "reward": ((), "float32")},
                  length=200, window=32, batch=64),
    # one-step items (transitions), many of them: where centralized selection's O(N) gather shows
    "transitions": dict(columns={"obs": ((11,), "float32"), "action": ((3,), "float32"), "reward": ((), "float32"),
                                 "done": ((), "bool")}, length=1, window=1, batch=256, items=100_000),
}


def memcpy_gbps(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Best-of-``repeats`` rate of one large np.copyto (bytes copied per second / 1e9)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)  # fault every page in before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def wait_asleep(comm, poll_s: float = 0.002) -> None:
    """A barrier that sleeps between polls, so a waiting rank leaves its core free (a blocking
    ``comm.Barrier()`` or ``bcast`` spins in MPI's progress loop)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll_s)


def reference_memcpy(comm, nbytes: int) -> tuple[float, float]:
    """Measure memcpy on rank 0 while every other rank sleeps. Collective.

    Returns:
        (rate in GB/s, the largest fraction of the wall time that a waiting rank spent on CPU
        meanwhile; 0.0 on one rank), the same on every rank.
    """
    wait_asleep(comm)                       # every rank has started (imports done) before timing
    wall, cpu = time.perf_counter(), time.process_time()
    rate = memcpy_gbps(nbytes) if comm.rank == 0 else 0.0
    wait_asleep(comm)                       # the others sleep here until rank 0 has measured
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    busy = comm.allreduce(cpu / wall if comm.rank != 0 and wall > 0 else 0.0, op=_mpi().MAX)
    return comm.bcast(rate), busy


def make_trajectory(rng, spec_columns: dict, length: int) -> dict:
    out = {}
    for name, (shape, dtype) in spec_columns.items():
        dt = np.dtype(dtype)
        if dt.kind == "f":
            out[name] = rng.standard_normal((length,) + tuple(shape)).astype(dt)
        elif dt.kind == "b":
            out[name] = np.zeros((length,) + tuple(shape), dt)
        else:
            out[name] = rng.integers(0, 100, (length,) + tuple(shape)).astype(dt)
    return out


def run_case(comm, gm, workload: str, mode: str, force: bool, items_per_rank: int, seconds: float,
             sampler_name: str, fresh: bool = False) -> dict | None:
    w = WORKLOADS[workload]
    spec = gm.TrajectorySpec(w["columns"], max_length=w["length"])
    sampler = gm.Prioritized(0.6, 0.4) if sampler_name == "prioritized" else gm.Uniform()
    replay = gm.Replay(spec, items_per_rank * w["length"], sampler, mode=mode, comm=comm, seed=0,
                       force_alltoallv=force, timeout=300)
    rng = np.random.default_rng(comm.rank)
    base = make_trajectory(rng, w["columns"], w["length"])
    for lo in range(0, items_per_rank, 4096):
        n = min(4096, items_per_rank - lo)
        replay.insert_many([base] * n, rng.uniform(0.5, 2.0, n))
    items_per_rank = len(replay)
    batch = None
    for _ in range(3):  # warm-up, untimed: compile (or load) every kernel of sample and update, fault pages in
        batch = replay.sample(w["batch"], w["window"], "head")
        replay.update_priorities(batch.keys, rng.uniform(0.5, 2.0, len(batch)))
    out = None if fresh else batch  # steady state: the loop refills one batch (sample(out=)), as a trainer would
    times, update_times, nbytes = [], [], 0
    deadline = time.perf_counter() + seconds
    calls = 0
    while True:
        comm.Barrier()
        t0 = time.perf_counter()
        batch = replay.sample(w["batch"], w["window"], "head", out=out)
        times.append(time.perf_counter() - t0)
        nbytes = batch.nbytes
        t0 = time.perf_counter()  # priority update of what was sampled (not part of the sample time)
        replay.update_priorities(batch.keys, rng.uniform(0.5, 2.0, len(batch)))
        update_times.append(time.perf_counter() - t0)
        calls += 1
        stop = comm.allreduce(time.perf_counter() > deadline and calls >= 3, op=_mpi().LOR)
        if stop:
            break
    replay.close()
    per_call = comm.allreduce(float(np.median(times)), op=_mpi().MAX)
    per_update = comm.allreduce(float(np.median(update_times)), op=_mpi().MAX)
    total_bytes = comm.allreduce(nbytes)
    return dict(ranks=comm.size, workload=workload, items_per_rank=items_per_rank, mode=mode,
                path="alltoallv" if force else "shm",
                sampler=sampler_name, batch_per_rank=w["batch"], window=w["window"], calls=calls,
                bytes_per_call=total_bytes, ms_per_call=per_call * 1e3, gbps=total_bytes / per_call / 1e9,
                ms_per_update=per_update * 1e3)


def default_items(workload: str, quick: bool) -> int:
    """Items per rank without ``--items``: 64 trajectories or 100k transitions; ``--quick``: 24, 10k."""
    if "items" in WORKLOADS[workload]:
        return WORKLOADS[workload]["items"] // (10 if quick else 1)
    return 24 if quick else 64


def _mpi():
    from mpi4py import MPI
    return MPI


def worker(args) -> None:
    """Run every case on the current MPI world; rank 0 prints."""
    MPI = _mpi()
    import gear_mpi as gm
    comm = MPI.COMM_WORLD
    copy_bytes = 1 << (26 if args.quick else 28)
    copy_rate, peers_cpu = reference_memcpy(comm, copy_bytes)
    if comm.rank == 0 and not args.json:
        print(memcpy_line(copy_rate, copy_bytes, comm.size, peers_cpu), flush=True)
    modes = args.modes.split(",")
    paths = [False, True] if comm.size > 1 else [False]
    if args.path != "both":
        paths = [args.path == "alltoallv"]
    rows = []
    for workload in args.workloads.split(","):
        items = args.items or default_items(workload, args.quick)
        for mode in modes:
            for force in (paths if mode != "local" else [False]):
                row = run_case(comm, gm, workload, mode, force, items, args.seconds, args.sampler, args.fresh_batches)
                row["memcpy_gbps"] = copy_rate
                row["memcpy_peers_cpu"] = peers_cpu
                row["pct_memcpy"] = 100.0 * row["gbps"] / copy_rate
                rows.append(row)
                if comm.rank == 0:
                    emit(row, args.json)
    if comm.rank == 0 and not args.json:
        print(f"# memcpy (same run, one process, the other ranks asleep): {copy_rate:.2f} GB/s", flush=True)
        if args.quick:
            print(QUICK_NOTE, flush=True)


QUICK_NOTE = ("# --quick: 24 trajectories per rank, copied from cache, and 0.5 s per case: a demo, not a "
              "measurement (%memcpy can pass 100%); README.md, 'Benchmarks', has the full table's command")


def memcpy_line(rate: float, nbytes: int, ranks: int, peers_cpu: float) -> str:
    """The ``# memcpy reference`` line printed before the table."""
    others = f"while the other {ranks - 1} rank(s) slept (CPU use {100 * peers_cpu:.1f}%)" if ranks > 1 else \
        "on the only rank"
    return f"# memcpy reference: {rate:.2f} GB/s (np.copyto of {nbytes >> 20} MiB on rank 0, before the cases, {others})"


HEADER = (f"{'ranks':>5} {'workload':>11} {'items':>7} {'mode':>13} {'path':>9} {'sampler':>11} {'B/rank':>6} {'W':>5} "
          f"{'bytes/call':>12} {'ms/call':>9} {'GB/s':>7} {'%memcpy':>8} {'ms/update':>9}")
_printed_header = False


def emit(row: dict, as_json: bool) -> None:
    global _printed_header
    if as_json:
        print(json.dumps(row), flush=True)
        return
    if not _printed_header:
        print(HEADER, flush=True)
        _printed_header = True
    print(f"{row['ranks']:>5} {row['workload']:>11} {row['items_per_rank']:>7} {row['mode']:>13} {row['path']:>9} {row['sampler']:>11} "
          f"{row['batch_per_rank']:>6} {row['window']:>5} {row['bytes_per_call']:>12} {row['ms_per_call']:>9.2f} "
          f"{row['gbps']:>7.2f} {row['pct_memcpy']:>7.1f}% {row['ms_per_update']:>9.2f}", flush=True)


def driver(args, argv: list[str]) -> int:
    """Start ``mpiexec -n K`` for each K of --ranks and relay the rows as one table."""
    here = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(here) if here.exists() else "mpiexec"
    passthrough = [a for a in argv if not a.startswith("--ranks")]
    if "--ranks" in argv:
        i = argv.index("--ranks")
        passthrough = argv[:i] + argv[i + 2:]
    status = 0
    copy_rates, peers_cpu = [], [0.0]
    for k in [int(x) for x in args.ranks.split(",")]:
        env = dict(os.environ, NUMBA_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // k)))
        proc = subprocess.run([mpiexec, "-n", str(k), sys.executable, "-m", "mpi4py", "-m", "scripts.bench.bench_replay",
                               "--json",
                               *passthrough], capture_output=True, text=True, env=env, timeout=args.timeout, cwd=ROOT)
        if proc.returncode != 0:
            print(f"# ranks={k}: mpiexec failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
            status = 1
            continue
        for row in json_rows(proc.stdout):
            copy_rates.append(row["memcpy_gbps"])
            peers_cpu.append(row.get("memcpy_peers_cpu", 0.0))
            emit(row, args.json)
    if copy_rates and not args.json:
        print(f"# memcpy (same runs, one process, the other ranks asleep, at most {100 * max(peers_cpu):.1f}% CPU): "
              f"{min(copy_rates):.2f}-{max(copy_rates):.2f} GB/s", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", help="comma-separated rank counts: start mpiexec for each (e.g. 1,2,4)")
    p.add_argument("--workloads", default="hopper,image", help="comma-separated: hopper, image")
    p.add_argument("--modes", default="decentralized,centralized,local", help="comma-separated sample modes")
    p.add_argument("--path", default="both", choices=["both", "shm", "alltoallv"], help="window path(s)")
    p.add_argument("--sampler", default="uniform", choices=["uniform", "prioritized"])
    p.add_argument("--items", type=int, default=0,
                   help="trajectories per rank (default 64, transitions 100000; --quick: 24, 10000)")
    p.add_argument("--seconds", type=float, default=2.0, help="time per case")
    p.add_argument("--fresh-batches", action="store_true",
                   help="a new batch per call (default: refill one with sample(out=), after an untimed warm-up)")
    p.add_argument("--quick", action="store_true", help="small sizes, short cases (the README's demo)")
    p.add_argument("--timeout", type=float, default=900.0, help="per mpiexec launch (driver mode)")
    p.add_argument("--json", action="store_true", help="one JSON object per case")
    args = p.parse_args(argv)
    if args.quick and args.seconds == 2.0:
        args.seconds = 0.5
    if args.ranks:
        return driver(args, argv)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
