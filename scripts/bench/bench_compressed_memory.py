#!/usr/bin/env python
"""Compressed columns in every memory kind: checkpoint size, save and load times, disk held by a live shard.

    python -m scripts.bench.bench_compressed_memory                 # Pong, 5000 transitions, 3 repetitions
    python -m scripts.bench.bench_compressed_memory --quick         # 1500 transitions, 2 repetitions

Real Atari frames (scripts/data/atari_frames.py: Pong, random policy, 84x84), stored frames-once
(``obs = FrameStack("frame", 4)``, ``next_obs = NextStep("obs")``) in a one-rank :class:`gear_mpi.Replay`, in the
same run:

- ``raw``: the frame column stored raw (private memory; ``file``: memory="file");
- ``zstd``, ``lz4``: the frame column ``gm.Compressed(codec="zstd")`` / ``gm.Compressed()`` (lz4, the default), in private memory and
  (``file``) with their chunks in the shard's files;
- the peers: TorchRL ``ReplayBuffer.dumps`` of a ``LazyMemmapStorage`` and of a ``CompressedListStorage`` holding
  the same transitions as stacked ``obs``/``next_obs`` (their own checkpoint format), where TorchRL is installed.

Per row: the checkpoint's bytes on disk (its blocks, ``du``) and apparent size, ``save`` seconds, plain ``load``
and ``load(mmap=True)`` seconds, and the disk blocks the live shard holds (``memory="file"``: its column file
and chunk files); times are the median of ``--repeat`` runs with their min and max. One process.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

import gear_mpi as gm
from scripts.bench.bench_compression import DEPTH, gear_episodes, gear_spec, stack
from scripts.data.atari_frames import atari_episodes, stacked_transitions


def disk_bytes(path: str) -> tuple[int, int]:
    """(blocks in bytes, apparent bytes) of every file under ``path``."""
    blocks = size = 0
    for root, _, names in os.walk(path):
        for n in names:
            st = os.stat(os.path.join(root, n))
            blocks += st.st_blocks * 512
            size += st.st_size
    return blocks, size


def live_disk(directory: str) -> int:
    """Blocks (bytes) of the files this process maps from under ``directory`` (a file-backed shard's: unlinked,
    so found through /proc/self/maps and map_files), each file once."""
    seen, total = set(), 0
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(directory):
                try:
                    st = os.stat(f"/proc/self/map_files/{parts[0]}")
                except OSError:
                    continue
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_blocks * 512
    return total


def spread(values) -> dict:
    v = np.asarray(values, float)
    return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max())}


def gear_row(name: str, spec, trajs, memory: str, repeat: int, work: str) -> dict:
    steps = sum(len(t["action"]) for t in trajs)
    saves, loads, mapped, ck_blocks, ck_size, held = [], [], [], 0, 0, 0
    for r in range(repeat):
        shards = tempfile.mkdtemp(dir=work)
        kw = {"path": shards} if memory == "file" else {}
        replay = gm.Replay(spec, steps + 16, max_items=len(trajs) + 4, seed=0, memory=memory, **kw)
        for i in range(0, len(trajs), 8):
            replay.insert_many(trajs[i:i + 8])
        held = live_disk(shards) if memory == "file" else 0
        path = os.path.join(work, f"ck-{r}")
        t = time.perf_counter()
        replay.save(path, progress=False)
        saves.append(time.perf_counter() - t)
        replay.close()
        ck_blocks, ck_size = disk_bytes(path)
        os.system("sync")
        t = time.perf_counter()
        back, _ = gm.Replay.load(path, progress=False)
        loads.append(time.perf_counter() - t)
        back.sample(32, 1)
        back.close()
        t = time.perf_counter()
        back, _ = gm.Replay.load(path, mmap=True, progress=False)
        mapped.append(time.perf_counter() - t)
        back.sample(32, 1)
        back.close()
        shutil.rmtree(path)
        shutil.rmtree(shards, ignore_errors=True)
    return {"store": f"gear {name}", "memory": memory, "checkpoint_disk_bytes": ck_blocks,
            "checkpoint_apparent_bytes": ck_size, "save_s": spread(saves), "load_s": spread(loads),
            "load_mmap_s": spread(mapped), "live_disk_bytes": held}


def torchrl_rows(episodes, repeat: int, work: str) -> list[dict]:
    try:
        import torch
        from tensordict import TensorDict
        from torchrl.data import CompressedListStorage, LazyMemmapStorage, ReplayBuffer
    except ImportError as e:
        print(f"# torchrl rows skipped: {e}")
        return []
    st = stacked_transitions(episodes, DEPTH)
    n = len(st["obs"])
    data = TensorDict({"obs": torch.from_numpy(st["obs"]), "next_obs": torch.from_numpy(st["next_obs"]),
                       "action": torch.from_numpy(st["action"]), "reward": torch.from_numpy(st["reward"])},
                      batch_size=[n])
    rows = []
    for name, make in (("LazyMemmapStorage", lambda: LazyMemmapStorage(n, scratch_dir=tempfile.mkdtemp(dir=work))),
                       ("CompressedListStorage", lambda: CompressedListStorage(n))):
        saves, loads, blocks, size = [], [], 0, 0
        try:
            for r in range(repeat):
                rb = ReplayBuffer(storage=make())
                rb.extend(data)
                path = os.path.join(work, f"trl-{r}")
                t = time.perf_counter()
                rb.dumps(path)
                saves.append(time.perf_counter() - t)
                blocks, size = disk_bytes(path)
                back = ReplayBuffer(storage=make())
                t = time.perf_counter()
                back.loads(path)
                loads.append(time.perf_counter() - t)
                shutil.rmtree(path)
        except Exception as e:  # a storage without dumps/loads
            print(f"# torchrl {name}: {type(e).__name__}: {str(e)[:120]}")
            continue
        rows.append({"store": f"torchrl {name}", "memory": "-", "checkpoint_disk_bytes": blocks,
                     "checkpoint_apparent_bytes": size, "save_s": spread(saves), "load_s": spread(loads),
                     "load_mmap_s": None, "live_disk_bytes": None})
    return rows


def fmt(s) -> str:
    return "-" if s is None else f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1500 transitions, 2 repetitions")
    p.add_argument("--transitions", type=int, default=None, help="default 5000 (--quick 1500)")
    p.add_argument("--repeat", type=int, default=None, help="repetitions (default 3; --quick 2)")
    p.add_argument("--game", default="Pong")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--no-peers", action="store_true", help="gear_mpi rows only")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    a = p.parse_args(argv)
    transitions = a.transitions or (1500 if a.quick else 5000)
    repeat = a.repeat or (2 if a.quick else 3)
    work = tempfile.mkdtemp(dir=a.dir, prefix="gear-bench-ck-")
    try:
        episodes = atari_episodes(a.game, transitions, seed=0)
        longest = max(len(e["frame"]) - 1 for e in episodes)
        once = gear_episodes("once", episodes, stack)
        rows = []
        for name, spec in (("raw", gear_spec("once", longest)),
                           ("zstd", gear_spec("once", longest, compressed=True)),
                           ("lz4", gear_spec("once", longest, compressed=True, codec="lz4"))):
            for memory in ("private", "file"):
                rows.append(gear_row(name, spec, once, memory, repeat, work))
        if not a.no_peers:
            rows += torchrl_rows(episodes, repeat, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    if a.json:
        for r in rows:
            print(json.dumps(dict(r, game=a.game, transitions=transitions, repeat=repeat, loadavg=load)))
        return
    print(f"# {a.game}, {transitions} transitions, {repeat} repetitions, load average {load[0]:.2f}; "
          f"seconds: median [min-max]")
    print(f"{'store':32} {'memory':>7} {'ckpt disk':>11} {'B/trans':>8} {'save s':>22} {'load s':>22} "
          f"{'load mmap s':>22} {'live disk':>11}")
    for r in rows:
        live = "-" if r["live_disk_bytes"] is None else f"{r['live_disk_bytes']:,}"
        print(f"{r['store']:32} {r['memory']:>7} {r['checkpoint_disk_bytes']:>11,} "
              f"{r['checkpoint_disk_bytes'] / transitions:>8.0f} {fmt(r['save_s']):>22} {fmt(r['load_s']):>22} "
              f"{fmt(r['load_mmap_s']):>22} {live:>11}")


if __name__ == "__main__":
    main()
