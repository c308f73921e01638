#!/usr/bin/env python3
"""Background incremental checkpoints: sampling throughput during one, and the bytes a second one writes.

A replay of ``--gb`` GB (in all ranks; image-like steps of ``--step-bytes`` bytes) is filled, then:

1. sampling alone for ``--seconds`` (batches of ``--batch`` one-step windows): the baseline rate;
2. the first checkpoint (``handle.now()``: everything is new; the time the call takes in the loop),
   sampling measured while its thread writes, then for as long again (at most ``--seconds``) without one;
3. ``--repeat`` times: ``--grow`` (a fraction, default 0.01) more steps inserted; the next checkpoint started,
   and sampling measured while its thread writes (from the start until the thread is done), then for as
   long again (at least 1 s) without one: the ratio of the two, each time, and their median;
4. the second checkpoint's bytes: written by the thread (and by inserts, past ``copy_limit``), linked from
   the first, and the new blocks on disk (files of one link only).

``--write-rate``, ``--cpu-share`` and ``--priority`` are ``checkpoint_every``'s (0: no limit).

One JSON line per rank 0 on stdout (``--json FILE`` appends it there too)::

    mpiexec -n 2 python -m mpi4py scripts/bench/bench_checkpoint.py --gb 2 --dir /scratch/ckbench
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import numpy as np
from mpi4py import MPI

import gear_mpi as gm


def rate(replay: gm.Replay, batch: int, seconds: float, until=None) -> tuple[float, int, float]:
    """Samples per second over ``seconds`` (or while ``until()`` is true): (rate, calls, elapsed)."""
    comm = MPI.COMM_WORLD
    n, t0 = 0, time.perf_counter()
    calls = []
    while True:
        t = time.perf_counter()
        replay.sample(batch, 1)
        calls.append(time.perf_counter() - t)
        n += 1
        more = (time.perf_counter() - t0 < seconds) if until is None else until()
        if not comm.allreduce(int(more), MPI.MIN):  # every rank stops at the same call
            break
    dt = time.perf_counter() - t0
    STALLS.append(stalls(calls))
    return n * batch / dt, n, dt


STALLS: list[dict] = []


def stalls(calls: list[float]) -> dict:
    """Where a window's time went: the median call, and the calls over 5 times it (their excess, the worst)."""
    a = np.asarray(calls)
    med = float(np.median(a))
    slow = a > 5 * med
    return {"median_ms": round(med * 1e3, 3), "slow_calls": int(slow.sum()),
            "slow_excess_s": round(float((a[slow] - med).sum()), 3), "worst_ms": round(float(a.max()) * 1e3, 1),
            "worst_at": int(a.argmax()), "total_s": round(float(a.sum()), 3)}


def new_bytes(path: str) -> int:
    """Bytes of the files under ``path`` with a single link (written by this checkpoint, not shared)."""
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            st = os.stat(os.path.join(root, n))
            if st.st_nlink == 1:
                total += st.st_blocks * 512
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="replay size in all ranks, GB")
    ap.add_argument("--grow", type=float, default=0.01, help="fraction inserted between two checkpoints")
    ap.add_argument("--step-bytes", type=int, default=4096, help="bytes per step (one uint8 column)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=5.0, help="baseline sampling time")
    ap.add_argument("--repeat", type=int, default=3, help="incremental checkpoints after the first (medians)")
    ap.add_argument("--write-rate", type=float, default=-1.0,
                    help="bytes/s of each rank's writer (0: unpaced; default: checkpoint_every's default)")
    ap.add_argument("--cpu-share", type=float, default=-1.0,
                    help="share of a core for each rank's writer (0: no limit; default: checkpoint_every's default)")
    ap.add_argument("--priority", default="low", choices=("low", "nice", "normal"))
    ap.add_argument("--segment-bytes", type=int, default=0,
                    help="bytes per ring segment file (0: checkpoint_every's default)")
    ap.add_argument("--dir", default="/tmp/gear_bench_checkpoint", help="checkpoint directory (removed first)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    comm.Barrier()
    spec = gm.TrajectorySpec({"obs": ((args.step_bytes,), "uint8")}, max_length=1)
    steps = int(args.gb * 1e9 / args.step_bytes / size)
    grow = int(steps * args.grow)
    replay = gm.Replay(spec, steps + grow * args.repeat + 1024, gm.Uniform(), seed=1, timeout=120.0)
    chunk = 4096
    block = np.random.default_rng(rank).integers(0, 256, (chunk, args.step_bytes), dtype=np.uint8)
    t0 = time.perf_counter()
    for lo in range(0, steps, chunk):
        n = min(chunk, steps - lo)
        replay.insert_packed({"obs": block[:n]}, np.ones(n, np.int64))
    fill_s = time.perf_counter() - t0
    comm.Barrier()
    base_rate, _, _ = rate(replay, args.batch, args.seconds)
    options = {} if args.write_rate < 0 else {"write_rate": args.write_rate or None}
    if args.cpu_share >= 0:
        options["cpu_share"] = args.cpu_share or None
    if args.segment_bytes:
        options["segment_bytes"] = args.segment_bytes
    handle = replay.checkpoint_every(args.dir, seconds=None, keep=2, priority=args.priority, **options)
    t0 = time.perf_counter()
    handle.now()
    first_loop = handle.last["loop_seconds"]
    first_during, first_calls, first_during_s = rate(replay, args.batch, 0.0, until=lambda: not handle.idle)
    handle.wait()
    first_s = time.perf_counter() - t0
    first_after, _, _ = rate(replay, args.batch, min(max(first_during_s, 1.0), args.seconds))
    first = dict(handle.last)
    rounds = []
    for _ in range(args.repeat):
        for lo in range(0, grow, chunk):
            n = min(chunk, grow - lo)
            replay.insert_packed({"obs": block[:n]}, np.ones(n, np.int64))
        comm.Barrier()
        t0 = time.perf_counter()
        handle.now()
        loop_s = handle.last["loop_seconds"]
        during, calls, during_s = rate(replay, args.batch, 0.0, until=lambda: not handle.idle)
        path = handle.wait()
        total_s = time.perf_counter() - t0
        after, _, _ = rate(replay, args.batch, max(during_s, 1.0))
        rounds.append({"stalls": STALLS[-2:], "seconds": total_s, "loop_seconds": loop_s, "during": during, "after": after,
                       "calls": calls, "during_s": during_s, "ratio": during / after, "last": dict(handle.last),
                       "path": str(path), "new_blocks": new_bytes(str(path)) if rank == 0 else 0})
    second = rounds[0]["last"]
    fig = comm.gather({"changed": second["changed"], "linked": second["linked"], "to_write": second["to_write"],
                       "in_loop": second.get("written_in_loop", 0), "table_written": second.get("table_written"),
                       "table_linked": second.get("table_linked"), "thread_s": first.get("thread_seconds")}, 0)
    if rank == 0:
        total = steps * size * args.step_bytes
        ratios = [r["ratio"] for r in rounds]
        out = {"bench": "checkpoint", "ranks": size, "replay_bytes": total,
               "grown_bytes": grow * size * args.step_bytes, "fill_s": round(fill_s, 2),
               "write_rate": handle.write_rate, "cpu_share": handle.cpu_share, "priority": handle.priority,
               "first": {"seconds": round(first_s, 2), "loop_seconds": round(first_loop, 3),
                         "written_in_loop": first.get("written_in_loop"), "copied_in_loop": first.get("copied_in_loop"),
                         "rate_during": round(first_during), "rate_after": round(first_after),
                         "during_s": round(first_during_s, 2), "during_calls": first_calls,
                         "during_over_without": round(first_during / first_after, 3)},
               "second": {"seconds": round(rounds[0]["seconds"], 2), "loop_seconds": round(rounds[0]["loop_seconds"], 4),
                          "written": sum(f["changed"] + (f["to_write"] - f["changed"] if f["table_written"] is None
                                                         else f["table_written"]) for f in fig),
                          "table_written": sum(f["table_written"] or 0 for f in fig),
                          "table_linked": sum(f["table_linked"] or 0 for f in fig),
                          "linked": sum(f["linked"] for f in fig), "new_blocks_on_disk": rounds[0]["new_blocks"]},
               "rate": {"before": round(base_rate), "during": [round(r["during"]) for r in rounds],
                        "after": [round(r["after"]) for r in rounds], "during_s": [round(r["during_s"], 2) for r in rounds],
                        "during_calls": [r["calls"] for r in rounds],
                        "loop_seconds": [round(r["loop_seconds"], 4) for r in rounds],
                        "during_over_without": [round(x, 3) for x in ratios],
                        "median_during_over_without": round(float(np.median(ratios)), 3)},
               "stalls": [r["stalls"] for r in rounds] if os.environ.get("BENCH_STALLS") else None,
               "path": rounds[-1]["path"]}
        line = json.dumps(out)
        print(line, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")
    handle.stop()
    replay.close()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
