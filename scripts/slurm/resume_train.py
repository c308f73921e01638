#!/usr/bin/env python3
"""A training job that survives being killed: background checkpoints, then resume from the newest one.

The payload of slurm/resume_replay.sbatch (and of its CI tests, under Slurm and under plain mpiexec).
Every step, every rank inserts one trajectory (id ``step * 1000 + rank``, written to its ledger file
``DIR/ledger-<run>-rank-R.txt`` right after the insert; ``<run>`` orders the runs of the job) and the
ranks sample a batch; ``replay.checkpoint_every`` checkpoints in the background into ``DIR/checkpoints`` (every ``--every`` steps with ``handle.now()``,
or every ``--seconds`` through ``sample``). Rerun with the same command after a kill (or requeued by
Slurm), the job loads the newest complete checkpoint (``Replay.load_latest``, on any number of ranks),
resumes at the step after the newest one it holds, and reports on rank 0 what was lost: the ids in the
ledgers that the checkpoint does not hold -- exactly those inserted after it began::

    resume: from ckpt-00000003 (steps 0..11, 24 items) on 2 ranks; lost 10 items inserted after it (steps 12..16)
    lost ids: 12000 12001 ...
    done: steps 0..39, 80 items, 1 resume(s)

``--kill-rank R --kill-at S`` makes rank R SIGKILL itself at step S of the first attempt (no checkpoint
in DIR yet, and ``SLURM_RESTART_COUNT`` unset or 0): a rank lost mid-run.

    mpiexec -n 2 python -m mpi4py -m scripts.slurm.resume_train --dir /scratch/run1 --steps 40
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import gear_mpi as gm

SPEC = gm.TrajectorySpec({"id": ((), "int64"), "obs": ((16,), "float32")}, max_length=4)


def trajectory(ident: int) -> dict[str, np.ndarray]:
    return {"id": np.full(2, ident, np.int64), "obs": np.full((2, 16), ident % 997, np.float32)}


def ledger_ids(directory: str) -> set[int]:
    """Every id any rank (of any attempt) recorded as inserted."""
    out: set[int] = set()
    for name in os.listdir(directory):
        if name.startswith("ledger-"):
            with open(os.path.join(directory, name)) as f:
                out.update(int(line.split()[1]) for line in f if line.strip())
    return out


def held_ids(replay: gm.Replay, comm) -> set[int]:
    mine = [int(replay.get(k)["id"][0]) for k in replay.shard.live_keys().tolist()]
    return set().union(*comm.allgather(set(mine)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="the job's directory (checkpoints and ledgers), shared by all ranks")
    ap.add_argument("--steps", type=int, default=40, help="training steps in all")
    ap.add_argument("--every", type=int, default=4, help="checkpoint every N steps (handle.now()); 0: use --seconds")
    ap.add_argument("--seconds", type=float, default=60.0, help="with --every 0: checkpoint every S seconds")
    ap.add_argument("--step-seconds", type=float, default=0.05, help="sleep per step (the training's compute)")
    ap.add_argument("--kill-rank", type=int, default=-1, help="this rank SIGKILLs itself at --kill-at (first attempt)")
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--timeout", type=float, default=10.0, help="the replay's collective timeout")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    ckdir = os.path.join(args.dir, "checkpoints")
    if rank == 0:
        os.makedirs(ckdir, exist_ok=True)
    comm.Barrier()
    capacity = 8 * args.steps + 16  # steps per rank: every insert fits, also resharded onto a quarter of the ranks
    replay, _ = gm.Replay.load_latest(ckdir, comm, timeout=args.timeout, capacity_steps=capacity)
    first_attempt = replay is None and int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) == 0
    start = 0
    resumes = 0
    if replay is None:
        replay = gm.Replay(SPEC, capacity, gm.Uniform(), seed=1, timeout=args.timeout)
        if rank == 0:
            print(f"start: no checkpoint in {ckdir}; {size} ranks, steps 0..{args.steps - 1}", flush=True)
    else:
        held = held_ids(replay, comm)
        recorded = ledger_ids(args.dir)
        start = max(i // 1000 for i in held) + 1 if held else 0
        lost = sorted(recorded - held)
        resumes = 1
        if rank == 0:
            steps = sorted({i // 1000 for i in lost})
            span = f" (steps {steps[0]}..{steps[-1]})" if steps else ""
            print(f"resume: from {replay.loaded_from.name} (steps 0..{start - 1}, {len(held)} items) on {size} "
                  f"ranks; lost {len(lost)} items inserted after it{span}", flush=True)
            print("lost ids: " + " ".join(map(str, lost)), flush=True)
        # the lost steps are trained again: their ids go to the ledger again
    handle = replay.checkpoint_every(ckdir, seconds=None if args.every else args.seconds, keep=2)
    with open(os.path.join(args.dir, f"pid-rank-{rank}"), "w") as f:  # for a test that kills a rank from outside
        f.write(f"{os.getpid()}\n")
    run = comm.bcast(f"{time.time_ns():020d}" if rank == 0 else None)
    ledger = open(os.path.join(args.dir, f"ledger-{run}-rank-{rank}.txt"), "a")
    for step in range(start, args.steps):
        if first_attempt and rank == args.kill_rank and step == args.kill_at:
            ledger.close()
            os.kill(os.getpid(), signal.SIGKILL)
        ident = step * 1000 + rank
        replay.insert(trajectory(ident))
        ledger.write(f"{step} {ident}\n")
        ledger.flush()
        replay.sample(8, 2)
        if args.every and (step + 1) % args.every == 0:
            handle.now()
        time.sleep(args.step_seconds)
    handle.stop()
    held = held_ids(replay, comm)
    if rank == 0:
        print(f"done: steps 0..{args.steps - 1}, {len(held)} items, {resumes} resume(s)", flush=True)
    replay.close()
    ledger.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
