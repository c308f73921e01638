#!/usr/bin/env python3
"""Background incremental checkpoints: sampling throughput during one, and the bytes a second one writes.

A replay of ``--gb`` GB (in all ranks; image-like steps of ``--step-bytes`` bytes) is filled, then:

1. sampling alone for ``--seconds`` (batches of ``--batch`` one-step windows): the baseline rate;
2. the first checkpoint (``handle.now()``: everything is new; what the sample that starts it copies or
   writes itself, past ``copy_limit``, is timed), waited for;
3. ``--grow`` (a fraction, default 0.01) more steps inserted; the second checkpoint started, and sampling
   measured while its thread writes (from the start until the thread is done), then for as long again
   without one;
4. the second checkpoint's bytes: copied and written by the thread, linked from the first, and the new
   blocks on disk (files of one link only).

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
    while True:
        replay.sample(batch, 1)
        n += 1
        more = (time.perf_counter() - t0 < seconds) if until is None else until()
        if not comm.allreduce(int(more), MPI.MIN):  # every rank stops at the same call
            break
    dt = time.perf_counter() - t0
    return n * batch / dt, n, dt


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
    ap.add_argument("--grow", type=float, default=0.01, help="fraction inserted between the two checkpoints")
    ap.add_argument("--step-bytes", type=int, default=4096, help="bytes per step (one uint8 column)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=5.0, help="baseline sampling time")
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
    replay = gm.Replay(spec, steps + grow + 1024, gm.Uniform(), seed=1, timeout=120.0)
    chunk = 4096
    block = np.random.default_rng(rank).integers(0, 256, (chunk, args.step_bytes), dtype=np.uint8)
    t0 = time.perf_counter()
    for lo in range(0, steps, chunk):
        n = min(chunk, steps - lo)
        replay.insert_packed({"obs": block[:n]}, np.ones(n, np.int64))
    fill_s = time.perf_counter() - t0
    comm.Barrier()
    base_rate, _, _ = rate(replay, args.batch, args.seconds)
    handle = replay.checkpoint_every(args.dir, seconds=None, keep=2)
    t0 = time.perf_counter()
    handle.now()
    first_loop = handle.last["loop_seconds"]
    handle.wait()
    first_s = time.perf_counter() - t0
    first = dict(handle.last)
    for lo in range(0, grow, chunk):
        n = min(chunk, grow - lo)
        replay.insert_packed({"obs": block[:n]}, np.ones(n, np.int64))
    comm.Barrier()
    t0 = time.perf_counter()
    handle.now()
    second_loop = handle.last["loop_seconds"]
    during_rate, calls, during_s = rate(replay, args.batch, 0.0, until=lambda: not handle.idle)
    path = handle.wait()
    second_s = time.perf_counter() - t0
    after_rate, _, _ = rate(replay, args.batch, max(during_s, 1.0))
    second = dict(handle.last)
    fig = comm.gather({"copied": second["copied"], "linked": second["linked"], "to_write": second["to_write"],
                       "in_loop": second["written_in_loop"]}, 0)
    if rank == 0:
        total = steps * size * args.step_bytes
        out = {"bench": "checkpoint", "ranks": size, "replay_bytes": total, "grown_bytes": grow * size * args.step_bytes,
               "fill_s": round(fill_s, 2),
               "first": {"seconds": round(first_s, 2), "loop_seconds": round(first_loop, 3),
                         "written_in_loop": first["written_in_loop"], "copied": first["copied"]},
               "second": {"seconds": round(second_s, 2), "loop_seconds": round(second_loop, 4),
                          "written": sum(f["to_write"] + f["in_loop"] for f in fig),
                          "linked": sum(f["linked"] for f in fig), "new_blocks_on_disk": new_bytes(str(path))},
               "rate": {"before": round(base_rate), "during": round(during_rate), "after": round(after_rate),
                        "during_calls": calls, "during_s": round(during_s, 2),
                        "during_over_without": round(during_rate / ((base_rate + after_rate) / 2), 3)},
               "path": str(path)}
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
