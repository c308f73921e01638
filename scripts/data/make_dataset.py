#!/usr/bin/env python
"""Write a D4RL-layout HDF5 dataset (and optionally one .npz file per episode) from a gymnasium
environment driven by a scripted controller with noise: a mixed-quality offline dataset.

    python -m scripts.data.make_dataset --env CartPole-v1 --steps 100000 --out cartpole-mixed.hdf5
    python -m scripts.data.make_dataset --env Pendulum-v1 --steps 50000 --noise 0,0.5,2 --out pend.hdf5 \
        --npz-dir pend_npz/

No dataset can be downloaded here, so the loaders (gear_mpi.datasets) are exercised with
these. Episodes cycle through the noise levels (``--noise``): 0 is the controller alone
(an expert: CartPole balances to the time limit, Pendulum swings up and holds), larger
levels act at random more often (CartPole: the probability of a random action) or add
more Gaussian torque (Pendulum: its standard deviation), so episodes differ in length
and return. The file holds ``observations``, ``actions``, ``rewards``, ``terminals``
(the environment ended the episode), ``timeouts`` (the time limit did),
``next_observations``, ``infos/noise`` (the episode's noise level) and
``infos/episode_step``; attributes under ``metadata`` record how it was made. The last
episode is cut when ``--steps`` steps are written, so it stays open (neither flag set), as
in D4RL. Needs gymnasium and h5py (``pip install gear-mpi[examples,datasets]``).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np


def cartpole_action(obs: np.ndarray) -> int:
    """Push toward where the pole is falling (angle plus a share of its angular velocity)."""
    return int(obs[2] + 0.5 * obs[3] + 0.05 * obs[1] > 0)


def pendulum_action(obs: np.ndarray) -> float:
    """Energy pumping far from the top, a PD hold near it (obs: cos, sin, angular velocity)."""
    cos, sin, vel = float(obs[0]), float(obs[1]), float(obs[2])
    angle = np.arctan2(sin, cos)
    if cos > 0.85:
        return float(np.clip(-12.0 * angle - 2.0 * vel, -2.0, 2.0))
    energy = 0.5 * vel ** 2 + 10.0 * (cos - 1.0)  # 0 at the top, at rest
    return float(np.clip(-2.0 * np.sign(vel * energy if vel != 0 else 1.0), -2.0, 2.0))


def make_dataset(out: str | Path, env_id: str = "CartPole-v1", steps: int = 10000,
                 noise: tuple[float, ...] = (0.0, 0.3, 1.0), seed: int = 0, max_episode_steps: int | None = None,
                 npz_dir: str | Path | None = None) -> dict:
    """Run the controller for ``steps`` steps and write the D4RL-layout file ``out``.

    Args:
        out: the HDF5 file to write.
        env_id: ``"CartPole-v1"`` or ``"Pendulum-v1"``.
        steps: steps in all (the last episode is cut there, left open).
        noise: noise levels, one per episode in turn (CartPole: probability of a random action;
            Pendulum: standard deviation of added torque).
        seed: seeds the environment and the noise.
        max_episode_steps: the time limit (None: the environment's).
        npz_dir: also write each episode to ``npz_dir/episode_NNNNNN.npz`` (the same arrays, no ``infos/``
            prefix: ``infos_noise``) when given.
    Returns:
        A summary: episodes, steps, terminals, timeouts, mean return per noise level.
    """
    import gymnasium as gym
    import h5py

    if env_id not in ("CartPole-v1", "Pendulum-v1"):
        raise ValueError(f"env_id must be CartPole-v1 or Pendulum-v1, got {env_id!r}")
    env = gym.make(env_id, max_episode_steps=max_episode_steps)
    rng = np.random.default_rng(seed)
    discrete = env_id.startswith("CartPole")
    obs_dim = env.observation_space.shape[0]
    data = {"observations": np.zeros((steps, obs_dim), np.float32),
            "actions": np.zeros(steps, np.int64) if discrete else np.zeros((steps, 1), np.float32),
            "rewards": np.zeros(steps, np.float32), "terminals": np.zeros(steps, np.bool_),
            "timeouts": np.zeros(steps, np.bool_), "next_observations": np.zeros((steps, obs_dim), np.float32),
            "infos/noise": np.zeros(steps, np.float32), "infos/episode_step": np.zeros(steps, np.int32)}
    returns: dict[float, list[float]] = {float(x): [] for x in noise}
    i, episode = 0, 0
    while i < steps:
        level = float(noise[episode % len(noise)])
        obs, _ = env.reset(seed=seed * 100003 + episode)
        total, t = 0.0, 0
        while i < steps:
            if discrete:
                action = cartpole_action(obs) if rng.random() >= level else int(rng.integers(2))
            else:
                action = np.array([np.clip(pendulum_action(obs) + level * rng.standard_normal(), -2, 2)], np.float32)
            nxt, reward, terminated, truncated, _ = env.step(action)
            data["observations"][i] = obs
            data["actions"][i] = action
            data["rewards"][i] = reward
            data["terminals"][i] = terminated
            data["timeouts"][i] = truncated and not terminated
            data["next_observations"][i] = nxt
            data["infos/noise"][i] = level
            data["infos/episode_step"][i] = t
            total += float(reward)
            i, t, obs = i + 1, t + 1, nxt
            if terminated or truncated:
                returns[level].append(total)
                break
        episode += 1
    env.close()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(out, "w") as f:
        for name, arr in data.items():
            f.create_dataset(name, data=arr)
        meta = f.create_group("metadata")
        meta.attrs.update({"env": env_id, "seed": seed, "noise": list(map(float, noise)), "steps": steps,
                           "made_by": "scripts/data/make_dataset.py", "time": time.strftime("%Y-%m-%d %H:%M:%S")})
    if npz_dir is not None:
        from gear_mpi.datasets import split_episodes
        starts, lengths, _ = split_episodes(data["terminals"], data["timeouts"])
        Path(npz_dir).mkdir(parents=True, exist_ok=True)
        for e, (a, n) in enumerate(zip(starts, lengths)):
            np.savez(Path(npz_dir) / f"episode_{e:06d}.npz",
                     **{k.replace("/", "_"): v[a:a + n] for k, v in data.items()})
    ends = data["terminals"] | data["timeouts"]
    return {"env": env_id, "steps": steps, "episodes": int(ends.sum()) + int(not ends[-1]),
            "terminals": int(data["terminals"].sum()), "timeouts": int(data["timeouts"].sum()),
            "open_last": bool(not ends[-1]),
            "mean_return": {k: (float(np.mean(v)) if v else None) for k, v in returns.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="CartPole-v1", choices=["CartPole-v1", "Pendulum-v1"])
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--noise", default=None, help="noise levels, comma-separated (default CartPole 0,0.3,1; "
                                                   "Pendulum 0,0.5,2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-episode-steps", type=int, default=None)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--npz-dir", type=Path, default=None, help="also write one .npz file per episode here")
    args = ap.parse_args()
    default = "0,0.3,1" if args.env.startswith("CartPole") else "0,0.5,2"
    noise = tuple(float(x) for x in (args.noise or default).split(","))
    summary = make_dataset(args.out, args.env, args.steps, noise, args.seed, args.max_episode_steps, args.npz_dir)
    print(summary)


if __name__ == "__main__":
    main()
