"""Small Minari datasets for the from_minari tests (tests/test_minari.py and tests/mpi/test_minari_ingest.py),
written by the ``minari`` package's own writer (``minari.create_dataset_from_buffers``) from gymnasium
rollouts with fixed seeds; nothing is downloaded.

:func:`write_all` writes, under one Minari root (``$MINARI_DATASETS_PATH`` while it runs):

- ``cartpole/random-v0``: CartPole-v1, a random policy, 13 episodes (terminations; Discrete actions);
- ``pendulum/random-v0``: Pendulum-v1 cut at 37 steps, 5 episodes (truncations; Box actions);
- ``dict/synthetic-v0``: a Dict observation space (``pos`` float32 x 3, ``count`` int32) and Box actions, 7
  episodes of 1..9 steps, with ``infos`` (``step``: the step number, T + 1 entries);
- damaged copies of cartpole: ``bad/arrow-v0`` (metadata says arrow), ``bad/nomain-v0`` (no main_data.hdf5),
  ``bad/truncated-v0`` (main_data.hdf5 cut short), ``bad/ragged-v0`` (episode 5's observations one row short:
  found when read), ``bad/text-v0`` (episode 0's actions are strings), and ``bad/nometa`` (a directory
  without metadata.json).

``DataCollector`` is not used: it needs jax (``minari[create]``); ``create_dataset_from_buffers`` writes the
same files from ``EpisodeBuffer`` objects with the ``minari[hdf5]`` extra alone.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np

ENV = "MINARI_DATASETS_PATH"
IDS = ("cartpole/random-v0", "pendulum/random-v0", "dict/synthetic-v0")


def rollouts(env_id: str, episodes: int, seed: int, **make_kwargs) -> list:
    """Episodes of a random policy as minari EpisodeBuffers (observations T + 1, the rest T)."""
    import gymnasium as gym
    from minari.data_collector import EpisodeBuffer

    env = gym.make(env_id, **make_kwargs)
    env.action_space.seed(seed)
    out = []
    for e in range(episodes):
        obs, _ = env.reset(seed=seed + e)
        observations, actions, rewards, terminations, truncations = [obs], [], [], [], []
        while True:
            action = env.action_space.sample()
            obs, reward, terminated, truncated, _ = env.step(action)
            observations.append(obs)
            actions.append(action)
            rewards.append(reward)
            terminations.append(terminated)
            truncations.append(truncated)
            if terminated or truncated:
                break
        out.append(EpisodeBuffer(id=e, seed=seed + e, observations=np.stack(observations),
                                 actions=np.asarray(actions), rewards=np.asarray(rewards, np.float64),
                                 terminations=np.asarray(terminations), truncations=np.asarray(truncations)))
    env.close()
    return out


def dict_episodes(episodes: int, seed: int) -> list:
    """Synthetic episodes of a Dict observation space, with infos."""
    from minari.data_collector import EpisodeBuffer

    rng = np.random.default_rng(seed)
    out = []
    for e in range(episodes):
        n = 1 + e % 9 if e else 9
        ends = np.zeros(n, np.bool_)
        ends[-1] = True
        out.append(EpisodeBuffer(
            id=e, observations={"pos": rng.standard_normal((n + 1, 3)).astype(np.float32),
                                "count": np.arange(n + 1, dtype=np.int32) + 100 * e},
            actions=rng.uniform(-1, 1, (n, 2)).astype(np.float32), rewards=rng.standard_normal(n),
            terminations=ends if e % 2 else np.zeros(n, np.bool_), truncations=np.zeros(n, np.bool_) if e % 2 else ends,
            infos={"step": np.arange(n + 1, dtype=np.int64)}))
    return out


def write_all(root: Path) -> Path:
    """Write every dataset of the module docstring under ``root`` (a Minari datasets root); returns root."""
    root.mkdir(parents=True, exist_ok=True)
    before = os.environ.get(ENV)
    os.environ[ENV] = str(root)
    with warnings.catch_warnings():  # minari's notes on eval_env and env_spec left unset: meant so here
        warnings.simplefilter("ignore", UserWarning)
        try:
            _write_good()
        finally:
            if before is None:
                del os.environ[ENV]
            else:
                os.environ[ENV] = before
    write_damaged(root)
    return root


def _write_good() -> None:
    """The three good datasets, under $MINARI_DATASETS_PATH."""
    import gymnasium as gym
    import minari

    minari.create_dataset_from_buffers("cartpole/random-v0", rollouts("CartPole-v1", 13, seed=7),
                                       env="CartPole-v1", algorithm_name="random")
    minari.create_dataset_from_buffers("pendulum/random-v0",
                                       rollouts("Pendulum-v1", 5, seed=3, max_episode_steps=37),
                                       env=gym.make("Pendulum-v1", max_episode_steps=37).spec,
                                       algorithm_name="random")
    space = gym.spaces.Dict({"pos": gym.spaces.Box(-10, 10, (3,), np.float32),
                             "count": gym.spaces.Box(0, 10_000, (), np.int32)})
    minari.create_dataset_from_buffers("dict/synthetic-v0", dict_episodes(7, seed=5), observation_space=space,
                                       action_space=gym.spaces.Box(-1, 1, (2,), np.float32))


def write_damaged(root: Path) -> None:
    import h5py

    good = root / "cartpole" / "random-v0"

    def copy(name: str) -> Path:
        dst = root / "bad" / name
        shutil.copytree(good, dst)
        meta = json.loads((dst / "data" / "metadata.json").read_text())
        meta["dataset_id"] = f"bad/{name}"
        (dst / "data" / "metadata.json").write_text(json.dumps(meta))
        return dst / "data"

    data = copy("arrow-v0")
    meta = json.loads((data / "metadata.json").read_text())
    meta["data_format"] = "arrow"
    (data / "metadata.json").write_text(json.dumps(meta))
    (copy("nomain-v0") / "main_data.hdf5").unlink()
    main = copy("truncated-v0") / "main_data.hdf5"
    size = main.stat().st_size
    with open(main, "r+b") as f:
        f.truncate(size // 2)
    with h5py.File(copy("ragged-v0") / "main_data.hdf5", "a") as f:
        obs = f["episode_5/observations"][()]
        del f["episode_5/observations"]
        f["episode_5"].create_dataset("observations", data=obs[:-1])
    with h5py.File(copy("text-v0") / "main_data.hdf5", "a") as f:
        n = f["episode_0/actions"].shape[0]
        del f["episode_0/actions"]
        f["episode_0"].create_dataset("actions", data=np.array(["left"] * n, dtype=h5py.string_dtype()))
    (root / "bad" / "nometa").mkdir(parents=True)
