#!/usr/bin/env python
"""Write a D4RL-layout HDF5 dataset (and optionally one .npz file per episode) from a gymnasium
environment driven by a scripted controller with noise: a mixed-quality offline dataset.

    python -m scripts.data.make_dataset --env CartPole-v1 --steps 100000 --out cartpole-mixed.hdf5
    python -m scripts.data.make_dataset --env Pendulum-v1 --steps 50000 --noise 0,0.5,2 --out pend.hdf5 \
        --npz-dir pend_npz/
    python -m scripts.data.make_dataset --env CartPole-v1 --steps 20000 --out cartpole-replay.hdf5 \
        --phases 20:1:0,30:0.2:0.2,40:0.1:0.15,40:0.1:0.1,20:0.1:0.05,1:0:0

No dataset can be downloaded here, so the loaders (gear_mpi.datasets) are exercised with
these. Episodes cycle through the noise levels (``--noise``): 0 is the controller alone
(an expert: CartPole balances to the time limit, Pendulum swings up and holds), larger
levels act at random more often (CartPole: the probability of a random action) or add
more Gaussian torque (Pendulum: its standard deviation), so episodes differ in length
and return. ``--phases`` replaces the cycle with a learning agent's history, as in D4RL's
medium-replay datasets: phases of ``EPISODES:NOISE:BIAS`` run in order (the last one on
until ``--steps`` are written), where the bias leans the controller (CartPole: added to
its decision value, so it pushes right too often: it holds the pole but drifts off the
track, returns about 140 at bias 0.1, 120 at 0.15, 100 at 0.2; Pendulum: added torque).
The file holds ``observations``, ``actions``, ``rewards``, ``terminals`` (the environment
ended the episode), ``timeouts`` (the time limit did), ``next_observations``,
``infos/noise`` and ``infos/bias`` (the episode's noise level and bias), ``infos/phase``
(the index of its phase, or of its noise level) and ``infos/episode_step``; attributes
under ``metadata`` record how it was made. The last episode is cut when ``--steps`` steps
are written, so it stays open (neither flag set), as in D4RL. Needs gymnasium and h5py
(``pip install gear-mpi[examples,datasets]``).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np


def cartpole_action(obs: np.ndarray) -> int:
    """Push toward where the pole is falling (angle plus a share of its angular velocity)."""
    return int(cartpole_value(obs) > 0)


def cartpole_value(obs: np.ndarray) -> float:
    """The CartPole controller's decision value: push right when it is positive (see :func:`cartpole_action`)."""
    return float(obs[2] + 0.5 * obs[3] + 0.05 * obs[1])


def pendulum_action(obs: np.ndarray) -> float:
    """Energy pumping far from the top, a PD hold near it (obs: cos, sin, angular velocity)."""
    cos, sin, vel = float(obs[0]), float(obs[1]), float(obs[2])
    angle = np.arctan2(sin, cos)
    if cos > 0.85:
        return float(np.clip(-12.0 * angle - 2.0 * vel, -2.0, 2.0))
    energy = 0.5 * vel ** 2 + 10.0 * (cos - 1.0)  # 0 at the top, at rest
    return float(np.clip(-2.0 * np.sign(vel * energy if vel != 0 else 1.0), -2.0, 2.0))


def parse_phases(text: str) -> list[tuple[int, float, float]]:
    """``"EPISODES:NOISE:BIAS,..."`` as a list of ``(episodes, noise, bias)``.

    Raises:
        ValueError: an item that is not three numbers, a count under 1, a negative or non-finite noise, or
            a non-finite bias.
    """
    phases = []
    for item in text.split(","):
        parts = item.strip().split(":")
        try:
            episodes, noise, bias = int(parts[0]), float(parts[1]), float(parts[2])
            if len(parts) != 3:
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(f"phases: {item!r} is not EPISODES:NOISE:BIAS (e.g. 20:0.1:0.15)") from None
        if episodes < 1 or not (np.isfinite(noise) and noise >= 0) or not np.isfinite(bias):
            raise ValueError(f"phases: {item!r} needs EPISODES >= 1, a finite NOISE >= 0 and a finite BIAS")
        phases.append((episodes, noise, bias))
    return phases


def make_dataset(out: str | Path, env_id: str = "CartPole-v1", steps: int = 10000,
                 noise: tuple[float, ...] = (0.0, 0.3, 1.0), seed: int = 0, max_episode_steps: int | None = None,
                 npz_dir: str | Path | None = None,
                 phases: list[tuple[int, float, float]] | None = None) -> dict:
    """Run the controller for ``steps`` steps and write the D4RL-layout file ``out``.

    Cost: ``steps`` environment steps (CartPole: about 20,000 a second) and one write of the arrays.

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
        phases: ``(episodes, noise, bias)`` per phase, run in order instead of cycling ``noise`` (the last
            phase goes on until ``steps`` are written; fewer steps may end in an earlier one). The bias is
            added to the controller's decision value (CartPole: pushes right more often) or torque (Pendulum).
    Returns:
        A summary: episodes, steps, terminals, timeouts, mean return per noise level (``mean_return``;
        with ``phases``, per phase: ``phase_mean_return``, None for a phase not reached) and, for
        CartPole, the share of actions that are the unbiased noiseless controller's (``controller_share``).
    Raises:
        ValueError: an unknown ``env_id``, an empty ``noise`` or ``phases``, a CartPole noise over 1, or
            ``steps`` under 1.
    """
    import gymnasium as gym
    import h5py

    if env_id not in ("CartPole-v1", "Pendulum-v1"):
        raise ValueError(f"env_id must be CartPole-v1 or Pendulum-v1, got {env_id!r}")
    policies = [(n, float(x), b) for n, x, b in phases] if phases is not None else [(1, float(x), 0.0) for x in noise]
    if not policies or steps < 1:
        raise ValueError(f"need steps >= 1 and at least one noise level or phase; got steps={steps}, "
                         f"noise={noise!r}, phases={phases!r}")
    if env_id.startswith("CartPole") and any(not 0 <= x <= 1 for _, x, _ in policies):
        raise ValueError(f"CartPole's noise is the probability of a random action (0..1); got {policies}")
    # episode e's policy: cycling the noise levels, or phase after phase (the last one kept)
    bounds = np.cumsum([n for n, _, _ in policies])
    env = gym.make(env_id, max_episode_steps=max_episode_steps)
    rng = np.random.default_rng(seed)
    discrete = env_id.startswith("CartPole")
    obs_dim = env.observation_space.shape[0]
    data = {"observations": np.zeros((steps, obs_dim), np.float32),
            "actions": np.zeros(steps, np.int64) if discrete else np.zeros((steps, 1), np.float32),
            "rewards": np.zeros(steps, np.float32), "terminals": np.zeros(steps, np.bool_),
            "timeouts": np.zeros(steps, np.bool_), "next_observations": np.zeros((steps, obs_dim), np.float32),
            "infos/noise": np.zeros(steps, np.float32), "infos/bias": np.zeros(steps, np.float32),
            "infos/phase": np.zeros(steps, np.int32), "infos/episode_step": np.zeros(steps, np.int32)}
    returns: dict[float, list[float]] = {x: [] for _, x, _ in policies}
    by_phase: list[list[float]] = [[] for _ in policies]
    i, episode, agree = 0, 0, 0
    while i < steps:
        phase = (episode % len(policies) if phases is None
                 else min(int(np.searchsorted(bounds, episode, side="right")), len(policies) - 1))
        _, level, bias = policies[phase]
        obs, _ = env.reset(seed=seed * 100003 + episode)
        total, t = 0.0, 0
        while i < steps:
            if discrete:
                value = cartpole_value(obs)
                action = int(value + bias > 0) if rng.random() >= level else int(rng.integers(2))
                agree += action == int(value > 0)
            else:
                torque = pendulum_action(obs) + bias + level * rng.standard_normal()
                action = np.array([np.clip(torque, -2, 2)], np.float32)
            nxt, reward, terminated, truncated, _ = env.step(action)
            data["observations"][i] = obs
            data["actions"][i] = action
            data["rewards"][i] = reward
            data["terminals"][i] = terminated
            data["timeouts"][i] = truncated and not terminated
            data["next_observations"][i] = nxt
            data["infos/noise"][i] = level
            data["infos/bias"][i] = bias
            data["infos/phase"][i] = phase
            data["infos/episode_step"][i] = t
            total += float(reward)
            i, t, obs = i + 1, t + 1, nxt
            if terminated or truncated:
                returns.setdefault(level, []).append(total)
                by_phase[phase].append(total)
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
        if phases is not None:
            meta.attrs["phases"] = ",".join(f"{n}:{x:g}:{b:g}" for n, x, b in policies)
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
            "mean_return": {k: (float(np.mean(v)) if v else None) for k, v in returns.items()},
            **({"phase_mean_return": [float(np.mean(v)) if v else None for v in by_phase]} if phases is not None
               else {}),
            "controller_share": agree / steps if discrete else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", default="CartPole-v1", choices=["CartPole-v1", "Pendulum-v1"])
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--noise", default=None, help="noise levels, comma-separated (default CartPole 0,0.3,1; "
                                                   "Pendulum 0,0.5,2)")
    ap.add_argument("--phases", default=None, help="EPISODES:NOISE:BIAS,... run in order instead of cycling "
                                                    "--noise (the last phase until --steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-episode-steps", type=int, default=None)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--npz-dir", type=Path, default=None, help="also write one .npz file per episode here")
    args = ap.parse_args()
    default = "0,0.3,1" if args.env.startswith("CartPole") else "0,0.5,2"
    noise = tuple(float(x) for x in (args.noise or default).split(","))
    try:
        phases = parse_phases(args.phases) if args.phases else None
    except ValueError as e:
        ap.error(str(e))
    summary = make_dataset(args.out, args.env, args.steps, noise, args.seed, args.max_episode_steps, args.npz_dir,
                           phases)
    print(summary)


if __name__ == "__main__":
    main()
