#!/usr/bin/env python
"""Compressed frame columns by codec and chunk size: bytes per transition and sample time, Atari frames.

    python -m scripts.bench.bench_chunks                        # Pong, 3000 transitions, zstd/lz4, chunks 1-8
    python -m scripts.bench.bench_chunks --transitions 500 --chunks 4 --repeats 3   # seconds

One process, a ``gm.Shard`` per row: stacked obs and next_obs stored raw, frames stored once raw, then the
frame column ``gm.Compressed(codec=..., chunk=...)`` under ``FrameStack("frame", 4)`` / ``NextStep("obs")``.
Each cell is the median (and the spread, min-max) of ``--repeats`` runs of 40 calls (B=32) or 10 (B=256)
of ``shard.sample(B, W, out=batch)``, in microseconds a call.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

import gear_mpi as gm
from scripts.bench import bench_compression as bc
from scripts.data.atari_frames import atari_episodes


def frame_spec(longest: int, codec: str, chunk: int) -> gm.TrajectorySpec:
    """Frames once, the frame column compressed with ``codec`` in chunks of ``chunk`` steps."""
    scalars = {"action": ((), "int64"), "reward": ((), "float32"), "done": ((), "bool")}
    return gm.TrajectorySpec({"frame": ((84, 84), "uint8", gm.Compressed(codec=codec, chunk=chunk)), **scalars,
                              "obs": gm.FrameStack("frame", 4), "next_obs": gm.NextStep("obs")}, longest + 1)


def measure(name: str, spec: gm.TrajectorySpec, trajs: list[dict], transitions: int, repeats: int) -> dict:
    """One row: bytes per transition and, per (B, W), the median and spread of the sample time (us)."""
    shard = gm.Shard(spec, sum(len(t["action"]) for t in trajs) + 16, seed=0, max_items=len(trajs) + 4)
    for i in range(0, len(trajs), 8):
        shard.insert_many(trajs[i:i + 8])
    row = {"store": name, "bytes_per_transition": shard.stored_bytes() / transitions}
    for w in (1, 8):
        for b in (32, 256):
            out = gm.Batch.empty(spec, b, w)
            shard.sample(b, w, out=out)
            calls = 40 if b == 32 else 10
            runs = []
            for _ in range(repeats):
                t = time.perf_counter()
                for _ in range(calls):
                    shard.sample(b, w, out=out)
                runs.append((time.perf_counter() - t) / calls * 1e6)
            row[f"B{b}W{w}"] = [float(np.median(runs)), float(min(runs)), float(max(runs))]
    shard.close()
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--game", default="Pong")
    p.add_argument("--transitions", type=int, default=3000)
    p.add_argument("--codecs", default="zstd,lz4", help="comma-separated gm.Compressed codecs")
    p.add_argument("--chunks", default="1,2,4,8", help="comma-separated steps per chunk")
    p.add_argument("--repeats", type=int, default=5, help="runs per cell (median and spread)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    args = p.parse_args(argv)
    episodes = atari_episodes(args.game, args.transitions, seed=0)
    n = sum(len(e["frame"]) - 1 for e in episodes)
    longest = max(len(e["frame"]) - 1 for e in episodes)
    once = bc.gear_episodes("once", episodes, bc.stack)
    rows = [measure("raw stacks", bc.gear_spec("raw", longest), bc.gear_episodes("raw", episodes, bc.stack), n,
                    args.repeats),
            measure("frames once", bc.gear_spec("once", longest), once, n, args.repeats)]
    for codec in args.codecs.split(","):
        for chunk in (int(c) for c in args.chunks.split(",")):
            rows.append(measure(f"{codec} chunk {chunk}", frame_spec(longest, codec, chunk), once, n, args.repeats))
    for r in rows:
        if args.json:
            print(json.dumps({"game": args.game, **r}))
            continue
        cells = " | ".join(f"{k} {v[0]:8.1f} ({v[1]:.0f}-{v[2]:.0f})" for k, v in r.items() if k.startswith("B"))
        print(f"{r['store']:<14} {r['bytes_per_transition']:8.1f} B/t | {cells}", flush=True)


if __name__ == "__main__":
    main()
