#!/usr/bin/env python
"""Compressed columns under memory="shm": node peers decoding the owner's chunks vs the owner decoding and sending.

    mpiexec -n 2 python -m mpi4py -m scripts.bench.bench_compressed_shm            # Pong, 2000 transitions a rank
    mpiexec -n 2 python -m mpi4py -m scripts.bench.bench_compressed_shm --synthetic  # no gymnasium: synthetic frames

Every rank stores its own Atari episodes (gymnasium + ale-py, random policy, 84x84 grayscale; scripts/data/
atari_frames.py) frames-once (``obs = FrameStack("frame", 4)``, ``next_obs = NextStep("obs")``) in three replays
with ``memory="shm"``, sampled in the same run (decentralized mode, uniform, so about half of each batch is a
node peer's):

- ``raw frames-once``: the frame column stored raw, node peers' windows read in place (the reference);
- ``lz4 shared chunks``: ``gm.Compressed()`` (lz4), node peers decode the owner's chunks from shared memory
  (the default under shm);
- ``lz4 alltoallv``: the same with ``force_alltoallv=True``: each owner decodes its windows (and the frames
  the requester's stacks need) and sends them raw through MPI (what shm did before).

Per row: batch ``B`` transitions or windows of ``W`` steps, the median and the spread (min..max) of the
seconds per ``sample`` over ``--repeat`` runs of ``--calls`` calls each (after warm-up calls), as rank 0 sees
them (every rank samples at once: sample is collective), and transitions per second from the median.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

import gear_mpi as gm

COMM = MPI.COMM_WORLD
RANK = COMM.rank


def episodes(transitions: int, synthetic: bool) -> list[dict]:
    if not synthetic:
        from scripts.data.atari_frames import atari_episodes
        got = atari_episodes("Pong", transitions, seed=RANK)
        return [{"frame": e["frame"], "action": e["action"], "reward": e["reward"]} for e in got]
    rng = np.random.default_rng(RANK)
    out, left = [], transitions
    while left > 0:  # a moving blob on a flat background: compresses like simple Atari screens
        n = min(left, 400)
        frame = np.full((n + 1, 84, 84), 87, np.uint8)
        for t in range(n + 1):
            y, x = (t * 3) % 70, (t * 5) % 70
            frame[t, y:y + 10, x:x + 4] = 236
            frame[t, 80:, :] = rng.integers(0, 255, 84, dtype=np.uint8)
        out.append({"frame": frame, "action": rng.integers(0, 6, n + 1), "reward": np.zeros(n + 1, np.float32)})
        left -= n
    return out


def spec(compressed: bool, max_length: int) -> gm.TrajectorySpec:
    frame = ((84, 84), "uint8", gm.Compressed()) if compressed else ((84, 84), "uint8")
    return gm.TrajectorySpec({"frame": frame, "action": ((), "int64"), "reward": ((), "float32"),
                              "obs": gm.FrameStack("frame", 4), "next_obs": gm.NextStep("obs")}, max_length + 1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--transitions", type=int, default=2000, help="transitions per rank")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--synthetic", action="store_true", help="synthetic 84x84 frames instead of Pong")
    args = p.parse_args(argv)
    eps = episodes(args.transitions, args.synthetic)
    longest = int(COMM.allreduce(max(len(e["frame"]) for e in eps), MPI.MAX))
    steps = int(COMM.allreduce(sum(len(e["frame"]) for e in eps), MPI.MAX))
    cases = [("raw frames-once", False, False), ("lz4 shared chunks", True, False), ("lz4 alltoallv", True, True)]
    rows = []
    for name, compressed, force in cases:
        replay = gm.Replay(spec(compressed, longest), steps + 64, max_items=len(eps) + 8, memory="shm",
                           force_alltoallv=force, seed=1)
        for e in eps:
            replay.insert(e)
        stored = COMM.allreduce(replay.shard.stored_bytes()) / COMM.allreduce(args.transitions)
        for w in (1, 8):
            for b in (32, 256):
                for _ in range(2):
                    replay.sample(b, w)
                times = []
                for _ in range(args.repeat):
                    COMM.Barrier()
                    t = time.perf_counter()
                    for _ in range(args.calls):
                        replay.sample(b, w)
                    times.append((time.perf_counter() - t) / args.calls)
                med = float(np.median(times))
                rows.append((name, b, w, med, min(times), max(times), b * w / med, stored))
        shared, mpi = COMM.allreduce(replay.windows_shared), COMM.allreduce(replay.windows_mpi)
        rows.append((name, "windows", shared, mpi))
        replay.close()
    if RANK == 0:
        print(f"ranks={COMM.size} transitions/rank={args.transitions} frames={'synthetic' if args.synthetic else 'Pong'} "
              f"calls={args.calls} repeat={args.repeat} load={os.getloadavg()[0]:.2f}")
        print(f"{'replay':<20} {'B':>4} {'W':>2} {'median ms':>10} {'min..max ms':>16} {'transitions/s':>14} "
              f"{'B/transition':>12}")
        for r in rows:
            if r[1] == "windows":
                print(f"{r[0]:<20} windows read in shared memory: {r[2]}, through MPI: {r[3]}")
                continue
            name, b, w, med, lo, hi, rate, stored = r
            print(f"{name:<20} {b:>4} {w:>2} {med * 1e3:>10.3f} {lo * 1e3:>7.3f}..{hi * 1e3:<7.3f} {rate:>14,.0f} "
                  f"{stored:>12,.0f}")


if __name__ == "__main__":
    main()
