#!/usr/bin/env python
"""Real Atari frames for storage tests and benchmarks: a random policy in gymnasium + ale-py.

    python -m scripts.data.atari_frames --game Pong --transitions 20000 --out pong.npz

Each episode is laid out as a frames-once replay stores it (``gm.FrameStack`` / ``gm.NextStep``,
docs/guide/storage.md): ``T`` transitions as ``T + 1`` steps, row ``t`` holding the observation
``o_t`` (84x84 grayscale, gymnasium's ``AtariPreprocessing``: frame skip 4, max-pooled, noop starts)
and the action taken in it, its reward and flags; the last row holds the final observation, the one
``step`` returned with ``terminated`` or ``truncated`` (never a reset observation), with action 0,
reward 0. The last episode is cut by the transition budget, a truncation: its final observation is
still the real one. ``stacked_transitions`` gives the same data as 4-frame stacked ``obs`` and
``next_obs`` per transition, the layout a replay that stores them raw holds.

Needs ``pip install gear-mpi[atari]`` (gymnasium, ale-py with its ROMs, opencv for the resize).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

GAMES = ("Pong", "Breakout")


def atari_episodes(game: str = "Pong", transitions: int = 10_000, seed: int = 0,
                   max_episode_steps: int | None = None) -> list[dict[str, np.ndarray]]:
    """Play a random policy until ``transitions`` transitions are collected.

    Cost: about 1.5 ms per transition on one core (the emulator and the resize).
    Args:
        game: an ALE game name (``"Pong"``, ``"Breakout"``, ...).
        transitions: how many transitions in all (the last episode is cut there: truncated).
        seed: seeds the environment and the policy.
        max_episode_steps: a time limit (TimeLimit truncation) in agent steps; None: the game's own.
    Returns:
        Episodes, each a dict of ``frame`` ``[T+1, 84, 84]`` uint8, ``action`` ``[T+1]`` int64, ``reward``
        ``[T+1]`` float32, ``terminated`` and ``truncated`` ``[T+1]`` bool (set on the last transition).
    Raises:
        ModuleNotFoundError: gymnasium, ale-py or opencv missing.
    """
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    env = gym.make(f"ALE/{game}-v5", frameskip=1, repeat_action_probability=0.0,
                   max_episode_steps=None if max_episode_steps is None else 4 * max_episode_steps)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=30)
    rng = np.random.default_rng(seed)
    episodes, total, first = [], 0, True
    while total < transitions:
        obs, _ = env.reset(seed=seed if first else None)
        first = False
        frames, actions, rewards, term, trunc = [obs], [], [], [], []
        while True:
            a = int(rng.integers(env.action_space.n))
            obs, r, te, tr, _ = env.step(a)
            frames.append(obs)
            actions.append(a)
            rewards.append(r)
            total += 1
            cut = total >= transitions
            term.append(bool(te))
            trunc.append(bool(tr) or (cut and not te))
            if te or tr or cut:
                break
        episodes.append({"frame": np.stack(frames).astype(np.uint8),
                         "action": np.array(actions + [0], np.int64),
                         "reward": np.array(rewards + [0.0], np.float32),
                         "terminated": np.array(term + [False]), "truncated": np.array(trunc + [False])})
    env.close()
    return episodes


def stack_frames(frames: np.ndarray, depth: int = 4) -> np.ndarray:
    """``[n, depth, *frame]``: step ``t`` holds frames ``t - depth + 1 .. t``, the first frame repeated
    before the start (``gm.FrameStack(pad="first")``). O(n depth) copy."""
    idx = np.clip(np.arange(len(frames))[:, None] + np.arange(-depth + 1, 1)[None, :], 0, None)
    return frames[idx]


def stacked_transitions(episodes: list[dict[str, np.ndarray]], depth: int = 4) -> dict[str, np.ndarray]:
    """Every transition with its stacked ``obs`` and ``next_obs`` (``[N, depth, 84, 84]`` uint8 each),
    ``action``, ``reward``, ``done``: the layout of a replay that stores stacks raw. O(N depth) memory."""
    parts = {"obs": [], "next_obs": [], "action": [], "reward": [], "done": []}
    for e in episodes:
        st = stack_frames(e["frame"], depth)
        parts["obs"].append(st[:-1])
        parts["next_obs"].append(st[1:])
        parts["action"].append(e["action"][:-1])
        parts["reward"].append(e["reward"][:-1])
        parts["done"].append(e["terminated"][:-1] | e["truncated"][:-1])
    return {k: np.concatenate(v) for k, v in parts.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--game", default="Pong", choices=GAMES)
    p.add_argument("--transitions", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="an .npz file: the episodes end to end, and their lengths")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    eps = atari_episodes(args.game, args.transitions, args.seed)
    cols = {k: np.concatenate([e[k] for e in eps]) for k in eps[0]}
    np.savez(args.out, lengths=np.array([len(e["frame"]) for e in eps], np.int64), **cols)
    print(f"{args.game}: {args.transitions} transitions in {len(eps)} episodes, "
          f"{time.perf_counter() - t0:.1f} s -> {args.out}")


if __name__ == "__main__":
    main()
