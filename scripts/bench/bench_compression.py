#!/usr/bin/env python
"""Storage at the paper's scale, side by side: bytes per transition, insert and sample rates.

    python -m scripts.bench.bench_compression            # Pong and Breakout, 10k transitions each
    python -m scripts.bench.bench_compression --quick    # Pong, 1.5k transitions, fewer calls (seconds)

Atari (gymnasium + ale-py, random policy, 84x84 grayscale, frame stack 4; scripts/data/atari_frames.py)
in one process, one core's share of the machine, in the same run:

- ``gear raw``: a Shard storing stacked ``obs`` and ``next_obs`` per step (``[4, 84, 84]`` uint8 each);
- ``gear frames-once``: one ``[84, 84]`` frame per step, ``obs = FrameStack("frame", 4)``,
  ``next_obs = NextStep("obs")`` rebuilt at sample time;
- ``gear frames-once+zstd``: the same with the frame column ``gm.Compressed(codec="zstd")`` (level 1, the default
  chunks); ``gear frames-once+lz4``: ``gm.Compressed()`` (lz4, the default codec);
- ``torchrl CompressedListStorage`` (its default level, 3) and ``torchrl LazyTensorStorage``, each transition
  a TensorDict of ``obs``, ``next_obs``, action, reward, done (flat keys: CompressedListStorage 0.14 compresses
  the top-level tensors of an item only and would keep a nested ``("next", "obs")`` raw);
- ``cpprb stack_compress+next_of``: cpprb's ReplayBuffer with ``obs`` ``[84, 84, 4]``, ``next_of="obs"``,
  ``stack_compress="obs"``.

Bytes per transition: gear_mpi's ``stored_bytes()`` (ring steps in use + table rows); TorchRL's
``storage.bytes()`` (compressed) or its tensors' ``nbytes`` (lazy); cpprb: the numpy memory its buffers hold
(``tracemalloc``, which numpy reports to, measured around construction and fill, temporaries freed). The ratio column is
against storing stacked obs and next_obs raw (``2 * 4 * 84 * 84`` bytes a transition). Gear samples pick
an episode uniformly, then a step (W=1) or an 8-step window (W=8); the peers pick transitions uniformly
(W=8: not run for them). A hopper-like float32 case (11 observations, 3 actions, episodes of 1000 steps,
a smooth random walk) compares ``next_obs`` stored against ``NextStep``, and compression off and on.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import gear_mpi as gm
from scripts.data.atari_frames import atari_episodes, stacked_transitions

FRAME = (84, 84)
DEPTH = 4
RAW_STACKED = 2 * DEPTH * FRAME[0] * FRAME[1]  # bytes of obs + next_obs stored as stacks, per transition


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed_calls(fn, calls: int) -> float:
    """Seconds per call, best of 3 runs of ``calls`` calls (after one warm-up call)."""
    fn()
    best = np.inf
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


# ---- gear_mpi --------------------------------------------------------------------------------------
def gear_spec(kind: str, max_length: int, frame_shape=FRAME, dtype="uint8", compressed=False, codec="zstd"):
    scalars = {"action": ((), "int64"), "reward": ((), "float32"), "done": ((), "bool")}
    if kind == "raw":
        shape = (DEPTH,) + frame_shape if dtype == "uint8" else frame_shape
        return gm.TrajectorySpec({"obs": (shape, dtype), "next_obs": (shape, dtype), **scalars}, max_length)
    frame = (frame_shape, dtype, gm.Compressed(codec=codec)) if compressed else (frame_shape, dtype)
    derived = ({"obs": gm.FrameStack("frame", DEPTH)} if dtype == "uint8" else
               {"obs": gm.FrameStack("frame", 1)})
    return gm.TrajectorySpec({"frame": frame, **scalars, **derived, "next_obs": gm.NextStep("obs")}, max_length + 1)


def gear_episodes(kind: str, episodes: list[dict], stacked_obs) -> list[dict]:
    out = []
    for e in episodes:
        n = len(e["frame"]) - 1
        done = e["terminated"][:-1] | e["truncated"][:-1]
        if kind == "raw":
            st = stacked_obs(e["frame"])
            out.append({"obs": st[:-1], "next_obs": st[1:], "action": e["action"][:-1], "reward": e["reward"][:-1],
                        "done": done})
        else:
            out.append({"frame": e["frame"], "action": e["action"], "reward": e["reward"],
                        "done": np.concatenate([done, [False]])})
        assert len(out[-1]["action"]) in (n, n + 1)
    return out


def bench_gear(name, spec, trajs, transitions, calls, windows=(1, 8)):
    steps = sum(len(t["action"]) for t in trajs)
    shard = gm.Shard(spec, steps + 16, seed=0, max_items=len(trajs) + 4)
    t = time.perf_counter()
    for i in range(0, len(trajs), 8):
        shard.insert_many(trajs[i:i + 8])
    insert_s = time.perf_counter() - t
    rows = []
    per = shard.stored_bytes() / transitions
    for w in windows:
        for b in (32, 256):
            out = gm.Batch.empty(spec, b, w)
            s = timed_calls(lambda: shard.sample(b, w, out=out), calls)
            rows.append({"store": name, "B": b, "W": w, "bytes_per_transition": per,
                         "insert_per_s": transitions / insert_s, "sample_us": s * 1e6,
                         "transitions_per_s": b * w / s})
    shard.close()
    return rows


# ---- peers -----------------------------------------------------------------------------------------
def torchrl_data(stacked: dict, channels_last=False):
    import torch
    from tensordict import TensorDict
    n = len(stacked["action"])
    return TensorDict({"obs": torch.from_numpy(stacked["obs"]), "action": torch.from_numpy(stacked["action"]),
                       "reward": torch.from_numpy(stacked["reward"]), "done": torch.from_numpy(stacked["done"]),
                       "next_obs": torch.from_numpy(stacked["next_obs"])}, batch_size=[n])


def bench_torchrl(name, stacked, calls, compressed):
    from torchrl.data import CompressedListStorage, LazyTensorStorage, ReplayBuffer
    data = torchrl_data(stacked)
    n = data.batch_size[0]
    storage = CompressedListStorage(max_size=n) if compressed else LazyTensorStorage(max_size=n)
    rows = []
    rb = ReplayBuffer(storage=storage, batch_size=32)
    t = time.perf_counter()
    for i in range(0, n, 1000):
        rb.extend(data[i:i + 1000])
    insert_s = time.perf_counter() - t
    per = (storage.bytes() if compressed else sum(v.nbytes for v in storage._storage.values(True, True))) / n
    for b in (32, 256):
        s = timed_calls(lambda: rb.sample(b), max(2, calls // (8 if compressed else 1)))
        rows.append({"store": name, "B": b, "W": 1, "bytes_per_transition": per, "insert_per_s": n / insert_s,
                     "sample_us": s * 1e6, "transitions_per_s": b / s})
    return rows


def bench_cpprb(name, episodes, transitions, calls):
    import tracemalloc

    import cpprb
    tracemalloc.start()
    rb = cpprb.ReplayBuffer(transitions + 8, {"obs": {"shape": FRAME + (DEPTH,), "dtype": np.uint8},
                                              "action": {"dtype": np.int64}, "reward": {}, "done": {}},
                            next_of="obs", stack_compress="obs")
    t = time.perf_counter()
    for e in episodes:
        st = np.moveaxis(stack(e["frame"]), 1, -1)
        done = e["terminated"][:-1] | e["truncated"][:-1]
        rb.add(obs=st[:-1], next_obs=st[1:], action=e["action"][:-1, None], reward=e["reward"][:-1, None],
               done=done[:, None].astype(np.float32))
        rb.on_episode_end()
    insert_s = time.perf_counter() - t
    per = tracemalloc.get_traced_memory()[0] / transitions
    tracemalloc.stop()
    rows = []
    for b in (32, 256):
        s = timed_calls(lambda: rb.sample(b), calls)
        rows.append({"store": name, "B": b, "W": 1, "bytes_per_transition": per,
                     "insert_per_s": transitions / insert_s, "sample_us": s * 1e6, "transitions_per_s": b / s})
    return rows


def stack(frames):
    idx = np.clip(np.arange(len(frames))[:, None] + np.arange(-DEPTH + 1, 1)[None, :], 0, None)
    return frames[idx]


# ---- cases -----------------------------------------------------------------------------------------
def atari_case(game, transitions, calls, peers=True):
    episodes = atari_episodes(game, transitions, seed=0)
    longest = max(len(e["frame"]) - 1 for e in episodes)
    rows = []
    rows += bench_gear("gear raw", gear_spec("raw", longest), gear_episodes("raw", episodes, stack), transitions,
                       calls)
    once = gear_episodes("once", episodes, stack)
    rows += bench_gear("gear frames-once", gear_spec("once", longest), once, transitions, calls)
    if hasattr(gm, "Compressed"):
        rows += bench_gear("gear frames-once+zstd", gear_spec("once", longest, compressed=True), once, transitions,
                           calls)
        rows += bench_gear("gear frames-once+lz4", gear_spec("once", longest, compressed=True, codec="lz4"), once,
                           transitions, calls)
    if peers:
        stacked = stacked_transitions(episodes, DEPTH)
        rows += bench_torchrl("torchrl CompressedListStorage", stacked, calls, True)
        rows += bench_torchrl("torchrl LazyTensorStorage", stacked, calls, False)
        del stacked
        rows += bench_cpprb("cpprb stack_compress+next_of", episodes, transitions, calls)
    for r in rows:
        r["case"] = game
        r["ratio_vs_raw_stacks"] = RAW_STACKED / r["bytes_per_transition"]
    return rows


def hopper_episodes(transitions, seed=0, length=1000):
    rng = np.random.default_rng(seed)
    eps, left = [], transitions
    while left > 0:
        n = min(length, left)
        obs = np.cumsum(rng.normal(0, 0.05, (n + 1, 11)), axis=0).astype(np.float32)
        eps.append({"frame": obs, "action": np.concatenate([rng.integers(0, 3, n), [0]]).astype(np.int64),
                    "reward": np.concatenate([rng.normal(1, 0.1, n), [0]]).astype(np.float32),
                    "terminated": np.zeros(n + 1, bool), "truncated": np.r_[np.zeros(n - 1, bool), [True, False]]})
        left -= n
    return eps


def hopper_case(transitions, calls, peers=True):
    eps = hopper_episodes(transitions)
    longest = max(len(e["frame"]) - 1 for e in eps)
    rows = []
    ident = lambda f: f  # noqa: E731
    rows += bench_gear("gear raw", gear_spec("raw", longest, (11,), "float32"), gear_episodes("raw", eps, ident),
                       transitions, calls)
    once = gear_episodes("once", eps, ident)
    rows += bench_gear("gear next-step", gear_spec("once", longest, (11,), "float32"), once, transitions, calls)
    if hasattr(gm, "Compressed"):
        rows += bench_gear("gear next-step+zstd", gear_spec("once", longest, (11,), "float32", True), once,
                           transitions, calls)
    if peers:
        stacked = {"obs": np.concatenate([e["frame"][:-1] for e in eps]),
                   "next_obs": np.concatenate([e["frame"][1:] for e in eps]),
                   "action": np.concatenate([e["action"][:-1] for e in eps]),
                   "reward": np.concatenate([e["reward"][:-1] for e in eps]),
                   "done": np.concatenate([e["truncated"][:-1] for e in eps])}
        rows += bench_torchrl("torchrl CompressedListStorage", stacked, calls, True)
        rows += bench_torchrl("torchrl LazyTensorStorage", stacked, calls, False)
    raw_bytes = 2 * 11 * 4
    for r in rows:
        r["case"] = "hopper-like"
        r["ratio_vs_raw_stacks"] = raw_bytes / r["bytes_per_transition"]
    return rows


def targets(rows):
    """The issue's targets, per Atari game: memory ratio, sampling against TorchRL compressed and gear raw."""
    out = []
    for game in sorted({r["case"] for r in rows if r["case"] != "hopper-like"}):
        g = {(r["store"], r["B"], r["W"]): r for r in rows if r["case"] == game}
        stores = [s for s in ("gear frames-once+zstd", "gear frames-once+lz4") if (s, 32, 1) in g] or ["gear frames-once"]
        for best in stores:
            for b in (32, 256):
                mine = g[(best, b, 1)]
                t = {"case": game, "store": best, "B": b, "memory_ratio": mine["ratio_vs_raw_stacks"],
                     "memory_target_100x": mine["ratio_vs_raw_stacks"] >= 100,
                     "vs_gear_raw": mine["transitions_per_s"] / g[("gear raw", b, 1)]["transitions_per_s"]}
                t["target_50pct_raw"] = t["vs_gear_raw"] >= 0.5
                if (best, b, 8) in g and ("gear raw", b, 8) in g:
                    t["vs_gear_raw_W8"] = g[(best, b, 8)]["transitions_per_s"] / g[("gear raw", b, 8)]["transitions_per_s"]
                trl = g.get(("torchrl CompressedListStorage", b, 1))
                if trl:
                    t["vs_torchrl_compressed"] = mine["transitions_per_s"] / trl["transitions_per_s"]
                    t["target_5x_torchrl"] = t["vs_torchrl_compressed"] >= 5
                    t["insert_vs_torchrl_compressed"] = mine["insert_per_s"] / trl["insert_per_s"]
                out.append(t)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="Pong only, 1500 transitions, fewer calls")
    p.add_argument("--transitions", type=int, default=None, help="per game (default 10000; --quick 1500)")
    p.add_argument("--games", default=None, help="comma-separated (default Pong,Breakout; --quick Pong)")
    p.add_argument("--no-peers", action="store_true", help="gear_mpi rows only")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    args = p.parse_args(argv)
    n = args.transitions or (1500 if args.quick else 10_000)
    games = (args.games or ("Pong" if args.quick else "Pong,Breakout")).split(",")
    calls = 8 if args.quick else 200  # quick: 8 calls, best of 3 (a smoke run, not figures)
    rows = []
    for game in games:
        rows += atari_case(game, n, calls, not args.no_peers)
    rows += hopper_case(min(n, 20_000) if not args.quick else 2000, calls, not args.no_peers)
    tgt = targets(rows)
    if args.json:
        for r in rows:
            print(json.dumps({"section": "store", **r}))
        for t in tgt:
            print(json.dumps({"section": "targets", **t}))
        return
    print(f"{'case':<12} {'store':<31} {'B':>4} {'W':>2} {'bytes/trans':>12} {'x less':>8} {'insert/s':>10} "
          f"{'sample us':>10} {'trans/s':>11}")
    for r in rows:
        print(f"{r['case']:<12} {r['store']:<31} {r['B']:>4} {r['W']:>2} {r['bytes_per_transition']:>12.1f} "
              f"{r['ratio_vs_raw_stacks']:>8.1f} {r['insert_per_s']:>10.0f} {r['sample_us']:>10.1f} "
              f"{r['transitions_per_s']:>11.0f}")
    print()
    for t in tgt:
        print("target", " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in t.items()))


if __name__ == "__main__":
    main()
