"""Live recovery of a dead rank (``Replay.recover`` under ULFM): what it costs and what it loses, at a size.

Every rank inserts ``--mb`` MB of trajectories, the replay saves a checkpoint, every rank inserts ``--after``
MB more; the last rank SIGKILLs itself before the next ``sample``, which the others enter and leave at its
deadline (``--timeout``). The survivors call ``replay.recover(checkpoint)`` and print, on rank 0: the failing
sample's time, the shrink and rebuild (``Recovery.shrink_seconds``, ``load_seconds``), the next sample, the
trajectories held afterwards and those lost (of every rank's inserted after the checkpoint, and the dead
rank's); and every survivor prints its memory: resident set before ``recover``, its peak (``ru_maxrss``)
before and after, and the bytes of its ring before and after (the peak's growth shows the copy of its own
shard that ``recover`` makes). Only public calls: it runs against any version of ``Replay.recover``.

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 .venv-ompi/bin/mpiexec --oversubscribe \\
        --with-ft ulfm -n 3 .venv-ompi/bin/python -m scripts.bench.bench_recover --mb 64 --after 16 --dir /tmp/rb
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import gear_mpi as gm

STEP_FLOATS = 1024  # 4 KiB a step
LENGTH = 100        # steps a trajectory: 400 KiB


def trajectories(count: int, first: int) -> list[dict[str, np.ndarray]]:
    return [{"obs": np.full((LENGTH, STEP_FLOATS), first + i, np.float32), "id": np.full(LENGTH, first + i, np.int64)}
            for i in range(count)]


def rss_mb() -> float:
    """This process's resident set now, MB (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError, IndexError):
        return 0.0


def peak_mb() -> float:
    """This process's peak resident set so far, MB (``ru_maxrss``: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=64.0, help="MB each rank inserts before the checkpoint")
    ap.add_argument("--after", type=float, default=16.0, help="MB each rank inserts after it")
    ap.add_argument("--timeout", type=float, default=4.0)
    ap.add_argument("--dir", required=True, help="a directory every rank sees (emptied)")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    per = LENGTH * STEP_FLOATS * 4
    before, after = int(args.mb * 1e6 // per), int(args.after * 1e6 // per)
    spec = gm.TrajectorySpec({"obs": ((STEP_FLOATS,), "float32"), "id": ((), "int64")}, max_length=LENGTH)
    capacity = (before + after + 1) * LENGTH
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    comm.barrier()
    replay = gm.Replay(spec, capacity, gm.Prioritized(1.0, 0.4), seed=1, timeout=args.timeout,
                       max_items=before + after + 1)
    ident = 1_000_000 * rank
    for j in range(0, before, 16):
        replay.insert_many(trajectories(min(16, before - j), ident + j))
    path = os.path.join(args.dir, "ck")
    t0 = time.monotonic()
    replay.save(path)
    save_s = time.monotonic() - t0
    for j in range(0, after, 16):
        replay.insert_many(trajectories(min(16, after - j), ident + before + j))
    replay.sample(8, 4)
    comm.barrier()
    if rank == size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        replay.sample(8, 4)
        print(f"WRONG rank={rank}: sample returned", flush=True)
        os._exit(1)
    except gm.CollectiveError:
        failed = time.monotonic() - t0
    ring_before = replay.shard.capacity_steps * spec.step_bytes / 1e6
    rss0, peak0 = rss_mb(), peak_mb()
    t0 = time.monotonic()
    rec = replay.recover(path)
    recover_s = time.monotonic() - t0
    peak1 = peak_mb()
    ring_after = rec.replay.shard.capacity_steps * spec.step_bytes / 1e6
    print(f"memory rank={rank} ring_before={ring_before:.0f}MB ring_after={ring_after:.0f}MB "
          f"rss_before_recover={rss0:.0f}MB peak_before={peak0:.0f}MB peak_after_recover={peak1:.0f}MB "
          f"peak_growth={peak1 - peak0:.0f}MB", flush=True)
    t0 = time.monotonic()
    rec.replay.sample(8, 4)
    first = time.monotonic() - t0
    held = int(rec.replay.stats()["total"]["items"])
    if rank == 0:
        inserted = size * (before + after)
        mb = (before + after) * per / 1e6
        print(f"ranks={size} per_rank={mb:.0f}MB items_before={size * before} inserted_after={size * after} "
              f"save={save_s:.3f}s failed={failed:.2f}s shrink={rec.shrink_seconds * 1e3:.1f}ms "
              f"rebuild={rec.load_seconds:.3f}s recover={recover_s:.3f}s first_sample={first * 1e3:.1f}ms "
              f"held={held} lost={inserted - held} dead_after={after}", flush=True)
    rec.replay.close()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
