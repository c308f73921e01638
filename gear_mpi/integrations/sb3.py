"""Stable-Baselines3 replay buffers backed by a gear_mpi :class:`~gear_mpi.shard.Shard`.

``DQN(..., replay_buffer_class=GearReplayBuffer)`` (or SAC, TD3, DDPG, QR-DQN, any off-policy algorithm
that takes SB3's ``ReplayBuffer``, and with ``MultiInputPolicy`` on a ``Dict`` observation space, where it
stands in for SB3's ``DictReplayBuffer``) runs unchanged: the buffer keeps SB3's semantics -- ``n_envs``
environments per ``add``, FIFO overwrite when full, ``handle_timeout_termination``, the ``device`` of the
returned tensors, ``optimize_memory_usage``, ``VecNormalize`` at sample time, ``reset``, pickling through
``save_replay_buffer``/``load_replay_buffer`` -- and SB3's storage model: ``observations``, ``actions``,
``rewards``, ``dones``, ``timeouts`` (and ``next_observations``) are ``[buffer_size, n_envs, ...]`` arrays,
here views of the shard's column rings, so code that reads or writes them (SB3's own ``_setup_learn``
does) sees what SB3's buffer would hold. :class:`GearPrioritizedReplayBuffer` adds what SB3 lacks:
proportional prioritized replay with importance weights (:class:`PrioritizedDQN` uses them).

How it is stored. Every environment step of every environment is one one-step item of a
:class:`~gear_mpi.shard.Shard` of ``buffer_size * n_envs`` steps; the ``t``-th transition lies at ring step
``t mod (buffer_size * n_envs)``, which is SB3's position ``pos * n_envs + env``. A sample draws
``batch_size`` items uniformly (or in proportion to their priorities) among the live ones, with
replacement, as SB3 draws a position and an environment; the draws come from the shard's own random
stream (seeded from NumPy's global generator at construction, so ``set_random_seed`` makes runs repeat).

Why a ``Shard`` and not a one-rank ``Replay``: SB3 trains in one process; a shard has no collective layer
to pass through (a one-rank ``Replay.sample`` adds its header and agreement to every call) and offers
``sample(..., squeeze=True)``, whose one allocation per batch is the cost that decides a small batch.

Per-call cost. ``add`` writes the step into small staging arrays (numpy's assignment, which casts as
SB3's does); the staged steps enter the shard together, one packed insert per :data:`STAGE_ADDS` adds
or before anything reads the buffer (``sample``, the storage views, ``reset``, pickling): a sample never
misses a step added before it. ``sample`` is one shard sample into a fresh squeezed batch whose tensors
are returned as they are (on the CPU) or copied to ``device``.

``n_steps > 1`` (SB3's ``replay_buffer_kwargs={"n_steps": ..., "gamma": ...}``) gives samples n-step returns as
SB3's ``NStepReplayBuffer`` computes them, over the same storage views, after the shard's draw
(:mod:`gear_mpi.integrations.sb3_nstep`).

``optimize_memory_usage=True`` stores each observation once, as SB3 does: there is no ``next_obs``
column; a transition's next observation is the ring row of the same environment one position later,
and the shard keeps one position fewer than ``buffer_size`` live (``max_items``), so the position whose
row the newest ``next_obs`` overwrites is never drawn (SB3 skips it when sampling).

Several ranks. SB3 runs one process. A job of several learner processes that share experience (one SB3
model per rank, say, each with its own environments) would use a :class:`~gear_mpi.replay.Replay` over
their communicator instead: each rank inserts its transitions as one-step items (``replay.insert_packed``
with ``lengths=1``) and every rank calls ``replay.sample(batch_size, window=1)`` collectively, the same
number of times (SB3's ``train`` calls ``sample`` ``gradient_steps`` times per rollout, so ranks that
roll out in step stay in step), then ``batch.squeeze()``; see docs/guide/integrations/sb3.md.

Threads: numba's worker threads sleep when idle (``OMP_WAIT_POLICY=PASSIVE`` unless already set), so
that they do not spin beside torch's threads between the buffer's calls: ``import gear_mpi`` sets it (see
``gear_mpi.threads``); :func:`quiet_threads` is kept for code that calls it.

Needs ``stable-baselines3`` (the ``sb3`` extra); importing this module imports it, torch and gymnasium.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch as th
import torch.nn.functional as F
from gymnasium import spaces
from stable_baselines3 import DQN
from stable_baselines3.common.buffers import BaseBuffer, DictReplayBuffer, NStepReplayBuffer, ReplayBuffer
from stable_baselines3.common.type_aliases import DictReplayBufferSamples, ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from ..checkpoint.shard_archive import shard_arrays, shard_from_arrays
from ..selection.selectors import Prioritized, Uniform
from ..shard import Shard
from ..spec import TrajectorySpec, check_count
from .sb3_nstep import n_step_targets

_SCALARS = ("reward", "done", "timeout")  # one float a transition: [buffer_size, n_envs] in SB3's storage

#: ``add`` calls staged before their steps enter the shard in one packed insert (fewer when the buffer is smaller)
STAGE_ADDS = 256

__all__ = ["GearReplayBuffer", "GearPrioritizedReplayBuffer", "PrioritizedReplayBufferSamples", "PrioritizedDQN",
           "STAGE_ADDS", "quiet_threads"]


def quiet_threads() -> None:
    """Let idle numba worker threads sleep instead of spinning beside torch: sets ``OMP_WAIT_POLICY=PASSIVE``
    for numba's OpenMP threading layer, unless the variable is already set (the user's choice wins). It acts
    only before numba's thread pool first starts in the process; ``import gear_mpi`` already does this (see
    ``gear_mpi.threads``), so calling it again changes nothing. O(1)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


quiet_threads()


def _check_dict_space(space: spaces.Dict) -> None:
    """A Dict observation space the buffer can store: keys that are strings, each an array space (SB3's
    ``DictReplayBuffer`` takes no nested Dict or Tuple either).

    Raises:
        NotImplementedError: a nested ``Dict``/``Tuple`` (or other non-array) space, named by its key.
        ValueError: an empty Dict, or a key that is not a string.
    """
    if not space.spaces:
        raise ValueError("a Dict observation space needs at least one key")
    for key, sub in space.spaces.items():
        if not isinstance(key, str):
            raise ValueError(f"Dict observation keys must be strings, got {key!r}")
        if not isinstance(sub, (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)):
            raise NotImplementedError(f"observation key {key!r} is a {type(sub).__name__} space; a Dict observation "
                                      "space's keys must be Box, Discrete, MultiDiscrete or MultiBinary (as SB3's)")


class PrioritizedReplayBufferSamples(NamedTuple):
    """SB3's ``ReplayBufferSamples`` fields, then what prioritized replay adds.

    ``weights``: ``[B, 1]`` float32 importance weights on the buffer's device (``(min p / p)^beta``, at most
    1); ``keys``: ``[B]`` int64 numpy keys to give back to
    :meth:`GearPrioritizedReplayBuffer.update_priorities`.
    """

    observations: th.Tensor
    actions: th.Tensor
    next_observations: th.Tensor
    dones: th.Tensor
    rewards: th.Tensor
    discounts: th.Tensor | None
    weights: th.Tensor
    keys: np.ndarray


class GearReplayBuffer(ReplayBuffer):
    """SB3's ``ReplayBuffer``, backed by a :class:`~gear_mpi.shard.Shard` (see the module docstring).

    Memory: ``buffer_size * step_bytes`` of columns (observation twice, or once with
    ``optimize_memory_usage``) plus the shard's table (about 20 bytes a transition) and :data:`STAGE_ADDS`
    staged adds. Not thread-safe, as SB3's buffer.

    Args:
        buffer_size: transitions kept (over all environments, as SB3: ``buffer_size // n_envs`` positions).
        observation_space: the observation space. A ``Dict`` of array spaces is stored as SB3's
            ``DictReplayBuffer`` stores it: ``observations`` and ``next_observations`` are dicts of arrays,
            ``add`` takes dicts, and ``sample`` returns ``DictReplayBufferSamples`` (each key its own pair of
            shard columns, ``obs/<key>`` and ``next_obs/<key>``; not with ``optimize_memory_usage``).
        action_space: the action space (float64 actions are stored as float32, as SB3 stores them).
        device: where sampled tensors go (``"auto"``: CUDA when available).
        n_envs: environments stepped together (one ``add`` stores one transition of each).
        optimize_memory_usage: store each observation once (not with ``handle_timeout_termination``).
        handle_timeout_termination: a step cut by a time limit (``infos[i]["TimeLimit.truncated"]``) is
            sampled as not done.
        seed: the seed of the shard's random stream (None: drawn from NumPy's global generator).
        memory: the shard's memory (``"private"`` or ``"shm"``; see :class:`~gear_mpi.shard.Shard`).
        n_steps: with more than 1, samples carry n-step returns as SB3's ``NStepReplayBuffer``'s do (its
            ``replay_buffer_kwargs={"n_steps": ..., "gamma": ...}``): the discounted sum of up to ``n_steps``
            rewards of the same environment, stopping at the first done or time limit and at the newest
            transition, the next observation and done flag of the last of them, and ``discounts``
            (``gamma ** steps``) for the bootstrap. Also for a ``Dict`` space (SB3 has no n-step buffer for it);
            not with ``optimize_memory_usage``.
        gamma: the discount of the n-step returns (SB3 passes the algorithm's).
    Raises:
        ValueError: ``buffer_size``, ``n_envs`` or ``seed`` not an integer (``buffer_size`` and ``seed`` >= 0,
            ``n_envs`` >= 1); ``optimize_memory_usage`` with ``handle_timeout_termination``, with fewer
            than 2 positions, or with a ``Dict`` observation space; an empty ``Dict`` space; ``n_steps`` not an
            integer >= 1, ``gamma`` not a number in [0, 1].
        NotImplementedError: a ``Dict`` space with a nested ``Dict``/``Tuple`` key, ``n_steps > 1`` with
            ``optimize_memory_usage``, or an action space SB3 does not support.
    """

    _selector_args: dict = {}

    def __init__(self, buffer_size: int, observation_space: spaces.Space, action_space: spaces.Space,
                 device: th.device | str = "auto", n_envs: int = 1, optimize_memory_usage: bool = False,
                 handle_timeout_termination: bool = True, *, seed: int | None = None, memory: str = "private",
                 n_steps: int = 1, gamma: float = 0.99):
        check_count(buffer_size, "buffer_size", 0)  # (0 keeps one position, as SB3's buffer)
        check_count(n_envs, "n_envs")
        check_count(seed, "seed", 0, optional=True)
        check_count(n_steps, "n_steps", 1)
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float, np.floating)) or not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma must be a number in [0, 1], got {gamma!r}")
        if n_steps > 1 and optimize_memory_usage:
            raise NotImplementedError("n-step returns (n_steps > 1) are not supported with optimize_memory_usage "
                                      "(as SB3's NStepReplayBuffer does not support it)")
        if isinstance(observation_space, spaces.Dict):
            _check_dict_space(observation_space)
            if optimize_memory_usage:
                raise ValueError("optimize_memory_usage is not supported with a Dict observation space (as SB3's "
                                 "DictReplayBuffer does not support it)")
        BaseBuffer.__init__(self, buffer_size, observation_space, action_space, device, n_envs=n_envs)
        self.buffer_size = max(buffer_size // n_envs, 1)
        # a Dict space's keys, each stored as its own pair of columns ("obs/<key>", "next_obs/<key>"); None: one array
        self._obs_keys = tuple(observation_space.spaces) if isinstance(observation_space, spaces.Dict) else None
        self.n_steps, self.gamma = int(n_steps), float(gamma)
        if optimize_memory_usage and handle_timeout_termination:
            raise ValueError("ReplayBuffer does not support optimize_memory_usage = True "
                             "and handle_timeout_termination = True simultaneously.")
        if optimize_memory_usage and self.buffer_size < 2:
            raise ValueError(f"optimize_memory_usage needs at least 2 positions, got buffer_size={buffer_size} "
                             f"for n_envs={n_envs}")
        self.optimize_memory_usage = optimize_memory_usage
        self.handle_timeout_termination = handle_timeout_termination
        self._memory = memory
        self._seed = int(np.random.randint(0, 2**31 - 1)) if seed is None else int(seed)
        self._build(None)

    # ---- the shard, its views and the staging arrays -----------------------------------------------
    def _spec(self) -> TrajectorySpec:
        cols = {}
        for prefix in ("obs",) if self.optimize_memory_usage else ("obs", "next_obs"):
            if self._obs_keys is None:
                cols[prefix] = (self.obs_shape, self.observation_space.dtype)
            else:
                cols.update({f"{prefix}/{key}": (self.obs_shape[key], self.observation_space[key].dtype)
                             for key in self._obs_keys})
        cols["action"] = ((self.action_dim,), self._maybe_cast_dtype(self.action_space.dtype))
        for name in ("reward", "done", "timeout"):
            cols[name] = ((1,), np.float32)
        return TrajectorySpec(cols, max_length=1)

    def _selector(self):
        return Uniform()

    def _build(self, saved: dict | None) -> None:
        """The shard (new, or from ``saved`` arrays), its column views in SB3's layout and the staging arrays."""
        n, cap = self.n_envs, self.buffer_size * self.n_envs
        if saved is None:
            max_items = cap - n if self.optimize_memory_usage else cap
            self.shard = Shard(self._spec(), cap, self._selector(), max_items=max_items, seed=self._seed,
                               memory=self._memory)
        else:
            self.shard = shard_from_arrays(saved, memory=self._memory)
        spec = self.shard.spec
        rings = self.shard.columns(writable=True)
        shapes = {c.name: (() if c.name in _SCALARS else c.shape) for c in spec.columns}  # SB3's layout
        self._views = {c.name: rings[c.name].reshape((self.buffer_size, n) + shapes[c.name]) for c in spec.columns}
        self._stage_adds = min(STAGE_ADDS, self.buffer_size - (1 if self.optimize_memory_usage else 0))
        self._stage = {c.name: np.zeros((self._stage_adds, n) + shapes[c.name], c.dtype) for c in spec.columns}
        self._packed = {c.name: (self._stage[c.name], (-1,) + c.shape) for c in spec.columns}
        self._lengths = np.ones(self._stage_adds * n, np.int64)
        self._staged = 0
        self._next_obs = None  # optimize_memory_usage: the newest next_obs, for the row after the newest position
        self._synced = (self.pos, self.full)
        self._closed = False

    # ---- SB3's storage, as views of the shard's rings ------------------------------------------------
    @property
    def observations(self) -> np.ndarray | dict[str, np.ndarray]:
        """``[buffer_size, n_envs, *obs_shape]``: the shard's ``obs`` ring (writable); for a Dict space, a dict of
        such rings, one per key (as SB3's ``DictReplayBuffer``). Staged adds go in first."""
        self._flush()
        return self._by_key(self._views, "obs")

    @property
    def next_observations(self) -> np.ndarray | dict[str, np.ndarray]:
        """``[buffer_size, n_envs, *obs_shape]``, or a dict of them for a Dict space (absent with
        ``optimize_memory_usage``, as in SB3)."""
        if self.optimize_memory_usage:
            raise AttributeError("next_observations is not stored with optimize_memory_usage=True")
        self._flush()
        return self._by_key(self._views, "next_obs")

    def _by_key(self, columns: dict, prefix: str):
        """``columns[prefix]``, or for a Dict space ``{key: columns[prefix/key]}`` (SB3's dict of arrays). O(keys)."""
        if self._obs_keys is None:
            return columns[prefix]
        return {key: columns[f"{prefix}/{key}"] for key in self._obs_keys}

    @property
    def actions(self) -> np.ndarray:
        """``[buffer_size, n_envs, action_dim]``."""
        self._flush()
        return self._views["action"]

    @property
    def rewards(self) -> np.ndarray:
        """``[buffer_size, n_envs]`` float32."""
        self._flush()
        return self._views["reward"]

    @property
    def dones(self) -> np.ndarray:
        """``[buffer_size, n_envs]`` float32."""
        self._flush()
        return self._views["done"]

    @property
    def timeouts(self) -> np.ndarray:
        """``[buffer_size, n_envs]`` float32 (all 0 without ``handle_timeout_termination``)."""
        self._flush()
        return self._views["timeout"]

    # ---- add --------------------------------------------------------------------------------------------
    def add(self, obs: np.ndarray, next_obs: np.ndarray, action: np.ndarray, reward: np.ndarray,
            done: np.ndarray, infos: list[dict[str, Any]]) -> None:
        """Store one transition of each environment (SB3's arguments: ``[n_envs, ...]`` arrays and the
        ``infos`` list). Values are cast to the stored dtypes as SB3's buffer casts them (numpy's assignment).
        Cost: one small array assignment per column; every :data:`STAGE_ADDS` calls, one packed insert
        into the shard (about 70 us for 256 transitions of CartPole).

        Raises:
            ValueError, TypeError: a value that does not fit its column (numpy's message); the buffer is left as
                it was (nothing of the transition is kept).
            RuntimeError: the buffer is closed.
        """
        self._check_open()
        k = self._staged
        stage = self._stage  # row k is scratch until _staged counts it: a failed assignment leaves nothing behind
        if self._obs_keys is not None:
            self._stage_dict_obs(k, obs, next_obs)
        else:
            if isinstance(self.observation_space, spaces.Discrete):
                obs = np.asarray(obs).reshape((self.n_envs, *self.obs_shape))
                next_obs = np.asarray(next_obs).reshape((self.n_envs, *self.obs_shape))
            stage["obs"][k] = obs
        if self.optimize_memory_usage:  # kept aside, as the stored dtype and shape: set only once the add succeeds
            newest = np.empty_like(stage["obs"][k])
            newest[...] = next_obs
        elif self._obs_keys is None:
            stage["next_obs"][k] = next_obs
        stage["action"][k] = np.asarray(action).reshape((self.n_envs, self.action_dim))
        stage["reward"][k] = reward
        stage["done"][k] = done
        if self.handle_timeout_termination:
            stage["timeout"][k] = [info.get("TimeLimit.truncated", False) for info in infos]
        else:
            stage["timeout"][k] = 0.0
        if self.optimize_memory_usage:
            self._next_obs = newest
        self._staged = k + 1
        self.pos += 1
        if self.pos == self.buffer_size:
            self.full = True
            self.pos = 0
        self._synced = (self.pos, self.full)
        if self._staged == self._stage_adds:
            self._flush()

    def _stage_dict_obs(self, k: int, obs: dict, next_obs: dict) -> None:
        """A Dict space's observations of one add into staging row ``k``, key by key (a Discrete key's values
        reshaped as SB3 reshapes them; the caller's dicts are not changed, where SB3's buffer changes them).

        Raises:
            TypeError: an observation that is not a dict.
            KeyError: an observation lacks one of the space's keys (named).
        """
        for prefix, values in (("obs", obs), ("next_obs", next_obs)):
            if not isinstance(values, Mapping):
                raise TypeError(f"{prefix} must be a dict of arrays for a Dict observation space, got "
                                f"{type(values).__name__}")
            missing = [key for key in self._obs_keys if key not in values]
            if missing:
                raise KeyError(f"{prefix} has no {missing[0]!r}: the observation space's keys are "
                               f"{list(self._obs_keys)}")
            for key in self._obs_keys:
                value = values[key]
                if isinstance(self.observation_space[key], spaces.Discrete):
                    value = np.asarray(value).reshape((self.n_envs, *self.obs_shape[key]))
                self._stage[f"{prefix}/{key}"][k] = value

    def _priorities(self, m: int) -> np.ndarray:
        return np.broadcast_to(np.float64(1.0), (m,))

    def _stored(self, first_step: int, keys: np.ndarray) -> None:
        """Told the keys of the items a flush stored at ring steps ``first_step, first_step + 1, ...`` (modulo
        the ring): nothing to do here (the HER buffer keeps them)."""

    def _flush(self) -> None:
        """The staged adds into the shard, in one packed insert (their positions are the next ring steps).

        Raises:
            RuntimeError: the buffer is closed.
        """
        self._check_open()
        k = self._staged
        if k == 0:
            return
        self._staged = 0
        m = k * self.n_envs
        cols = {name: stage[:k].reshape(shape) for name, (stage, shape) in self._packed.items()}
        keys = self.shard.store_packed(cols, self._lengths[:m], self._priorities(m), steps=m)
        self._stored(((self.pos - k) % self.buffer_size) * self.n_envs, keys)
        if self._next_obs is not None:  # SB3 writes next_obs into the row of the position after the newest
            self._views["obs"][self.pos] = self._next_obs

    # ---- sample -----------------------------------------------------------------------------------------
    def sample(self, batch_size: int, env: VecNormalize | None = None) -> ReplayBufferSamples:
        """``batch_size`` transitions drawn uniformly with replacement among those held (SB3's
        distribution: a position and an environment, each uniform), as tensors on ``device``.

        If ``pos``/``full`` were set by hand to something other than what the adds made them (SB3's
        ``test_buffer_dtypes`` marks an empty buffer full), the draw follows SB3's storage model instead:
        positions below ``pos`` (all when ``full``) of the arrays, whatever they hold.

        Args:
            batch_size: transitions to draw.
            env: a ``VecNormalize`` whose statistics normalize observations and rewards (None: as stored).
        Returns:
            SB3's ``ReplayBufferSamples`` (``[B, *obs_shape]``, ``[B, action_dim]``, ``[B, *obs_shape]``,
            ``[B, 1]``, ``[B, 1]``); new tensors, not shared with the buffer.
        Raises:
            gear_mpi.EmptyReplayError: nothing was added.
        Cost: one shard sample into a fresh batch (one allocation, one kernel call), a product for the
        timeout-masked dones, and the copies to ``device`` when it is not the CPU.
        """
        self._flush()
        if (self.pos, self.full) != self._synced:
            return ReplayBuffer.sample(self, batch_size, env)
        batch = self.shard.sample(batch_size, 1, squeeze=True)
        return self._samples(batch, env)

    def _sampled_dones(self, d: dict) -> np.ndarray:
        """The done flags a sample returns from batch arrays ``d``: ``done * (1 - timeout)`` with
        ``handle_timeout_termination`` (a step cut by a time limit is not done), else as stored."""
        return d["done"] * (1.0 - d["timeout"]) if self.handle_timeout_termination else d["done"]

    def _samples(self, batch, env: VecNormalize | None) -> ReplayBufferSamples | DictReplayBufferSamples:
        d = batch.numpy()
        if self.n_steps > 1:  # (its done flags are each sequence's last step's)
            return self._n_step_samples(batch, d, env)
        done = self._sampled_dones(d)
        if self._obs_keys is not None:
            return self._dict_samples(d, done, env)
        if env is None and not self.optimize_memory_usage and self.device.type == "cpu":
            # tensors over the batch's own arrays: a fresh batch, nobody else's (the common case, the cheapest;
            # th.from_numpy of the arrays rather than batch[name], which keeps each tensor in the batch: 0.5 us a
            # column more, for a batch nobody else sees)
            return ReplayBufferSamples(th.from_numpy(d["obs"]), th.from_numpy(d["action"]),
                                       th.from_numpy(d["next_obs"]), th.from_numpy(done), th.from_numpy(d["reward"]))
        obs = d["obs"]
        next_obs = self._next_of(batch) if self.optimize_memory_usage else d["next_obs"]
        rewards = d["reward"]
        if env is not None:
            obs, next_obs = self._normalize_obs(obs, env), self._normalize_obs(next_obs, env)
            rewards = self._normalize_reward(rewards, env)
        data = (obs, d["action"], next_obs, done, rewards)
        return ReplayBufferSamples(*(self._tensor(a) for a in data))

    def _n_step_samples(self, batch, d: dict, env: VecNormalize | None
                        ) -> ReplayBufferSamples | DictReplayBufferSamples:
        """``n_steps > 1``: each drawn transition's observation and action with the n-step return, the bootstrap
        discount and the next observation and done flag of its sequence's last step, computed over the storage
        rings as SB3's ``NStepReplayBuffer`` computes them (:func:`~gear_mpi.integrations.sb3_nstep.n_step_targets`);
        for a Dict space the same, key by key (``DictReplayBufferSamples``; SB3 has no n-step buffer for it).
        Cost: O(B * n_steps) reads of the rings and one gather of B next observations."""
        start, _ = self.shard.locate(batch.keys.numpy())
        positions, envs = np.divmod(start, self.n_envs)
        views = self._views
        returns, discounts, last, dones = n_step_targets(
            views["reward"], views["done"], views["timeout"], positions, envs, (self.pos - 1) % self.buffer_size,
            self.n_steps, self.gamma, None if env is None else (lambda r: self._normalize_reward(r, env)))
        obs = self._by_key(d, "obs")
        next_obs = self._by_key({name: view[last, envs] for name, view in views.items()
                                 if name.startswith("next_obs")}, "next_obs")
        if env is not None:
            obs, next_obs = self._normalize_obs(obs, env), self._normalize_obs(next_obs, env)
        action, dones, returns, discounts = (self._tensor(a) for a in (d["action"], dones, returns, discounts))
        if self._obs_keys is None:
            return ReplayBufferSamples(self._tensor(obs), action, self._tensor(next_obs), dones, returns, discounts)
        return DictReplayBufferSamples({k: self._tensor(v) for k, v in obs.items()}, action,
                                       {k: self._tensor(v) for k, v in next_obs.items()}, dones, returns, discounts)

    def _dict_samples(self, d: dict, done: np.ndarray, env: VecNormalize | None) -> DictReplayBufferSamples:
        """A Dict space's samples (SB3's ``DictReplayBufferSamples``) from batch arrays ``d``."""
        obs, next_obs, rewards = self._by_key(d, "obs"), self._by_key(d, "next_obs"), d["reward"]
        if env is not None:
            obs, next_obs = self._normalize_obs(obs, env), self._normalize_obs(next_obs, env)
            rewards = self._normalize_reward(rewards, env)
        return DictReplayBufferSamples({key: self._tensor(a) for key, a in obs.items()}, self._tensor(d["action"]),
                                       {key: self._tensor(a) for key, a in next_obs.items()}, self._tensor(done),
                                       self._tensor(rewards))

    def _tensor(self, a: np.ndarray) -> th.Tensor:
        """An array of a fresh batch (nobody else's) as a tensor on ``device``: shared on the CPU, else copied."""
        if self.device.type == "cpu":
            return th.from_numpy(np.ascontiguousarray(a))
        return th.as_tensor(a, device=self.device)

    def _get_samples(self, batch_inds: np.ndarray, env: VecNormalize | None = None):
        """SB3's storage-model draw (``pos``/``full`` set by hand, see :meth:`sample`): ``DictReplayBuffer``'s for
        a Dict space (one-step, with ``n_steps > 1`` too: SB3 has no n-step draw for it), ``NStepReplayBuffer``'s
        with ``n_steps > 1``, ``ReplayBuffer``'s otherwise, all over this buffer's storage views."""
        if self._obs_keys is not None:
            return DictReplayBuffer._get_samples(self, batch_inds, env)
        if self.n_steps > 1:
            return NStepReplayBuffer._get_samples(self, batch_inds, env)
        return ReplayBuffer._get_samples(self, batch_inds, env)

    def _next_of(self, batch) -> np.ndarray:
        """optimize_memory_usage: each item's next observation, the ring row one position (``n_envs`` steps) on."""
        start, _ = self.shard.locate(batch.keys.numpy())
        ring = self.shard.columns()["obs"]
        return ring[(start + self.n_envs) % ring.shape[0]]

    # ---- reset, pickling, close -------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty the buffer (SB3's ``reset``): staged adds dropped, the shard cleared, ``pos`` 0. O(items held).

        Raises:
            RuntimeError: the buffer is closed.
        """
        self._check_open()
        self._staged = 0
        self._next_obs = None
        self.shard.clear()
        super().reset()
        self._synced = (self.pos, self.full)

    def close(self) -> None:
        """Release the shard's memory now (otherwise when the buffer is collected); staged adds are dropped.
        Afterwards ``add``, ``sample``, the storage arrays and pickling raise ``RuntimeError``. Idempotent."""
        self._closed = True
        self._staged = 0
        self.shard.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} is closed")

    def __getstate__(self) -> dict:
        """Pickled as SB3 pickles its buffer (``save_replay_buffer``): everything, the shard's contents as
        :func:`~gear_mpi.checkpoint.shard_archive.shard_arrays` (the staged adds entered first)."""
        self._flush()
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("shard", "_views", "_stage", "_packed", "_lengths")}
        state["_shard_arrays"] = shard_arrays(self.shard)
        if self.optimize_memory_usage:  # the position after the newest: no live item's, but the newest next_obs
            state["_next_row"] = {name: view[self.pos].copy() for name, view in self._views.items()}
        return state

    def __setstate__(self, state: dict) -> None:
        saved = state.pop("_shard_arrays")
        next_row = state.pop("_next_row", None)
        synced, next_obs = state["_synced"], state["_next_obs"]
        self.__dict__.update(state)
        if self._memory not in ("private", "shm"):
            self._memory = "private"
        self._build(saved)
        self._synced, self._next_obs = synced, next_obs
        for name, row in (next_row or {}).items():
            self._views[name][self.pos] = row


class GearPrioritizedReplayBuffer(GearReplayBuffer):
    """:class:`GearReplayBuffer` with proportional prioritized replay (Schaul et al. 2016): transition ``i``
    is drawn with probability ``p_i^alpha / sum_j p_j^alpha``; samples carry importance weights
    ``(min_j P(j) / P(i))^beta`` and keys (:class:`PrioritizedReplayBufferSamples`); new transitions get the
    largest priority given so far (1 at first). SB3's algorithms ignore the extra fields;
    :class:`PrioritizedDQN` uses them. Exact: the shard's priority index draws from the priorities as given.

    Args:
        buffer_size, observation_space, action_space, device, n_envs: as :class:`GearReplayBuffer`.
        optimize_memory_usage, handle_timeout_termination, seed, memory, n_steps, gamma: as
            :class:`GearReplayBuffer`.
        alpha: how much priorities count (0: uniform).
        beta: the importance-weight exponent (settable: anneal it towards 1).
    Raises:
        ValueError: as :class:`GearReplayBuffer`, or ``alpha``/``beta`` outside what
            :class:`~gear_mpi.selection.selectors.Prioritized` takes.
    """

    def __init__(self, buffer_size: int, observation_space: spaces.Space, action_space: spaces.Space,
                 device: th.device | str = "auto", n_envs: int = 1, optimize_memory_usage: bool = False,
                 handle_timeout_termination: bool = True, *, alpha: float = 0.6, beta: float = 0.4,
                 seed: int | None = None, memory: str = "private", n_steps: int = 1, gamma: float = 0.99):
        self._prioritized = Prioritized(alpha, beta)  # checks alpha and beta before anything is built
        self.max_priority = 1.0
        super().__init__(buffer_size, observation_space, action_space, device, n_envs, optimize_memory_usage,
                         handle_timeout_termination, seed=seed, memory=memory, n_steps=n_steps, gamma=gamma)

    def _selector(self):
        return self._prioritized

    @property
    def alpha(self) -> float:
        """The priority exponent. O(1)."""
        return self.shard.selector.alpha

    @property
    def beta(self) -> float:
        """The importance-weight exponent, read at every sample; settable (finite, >= 0; 1 corrects fully). O(1)."""
        return self.shard.selector.beta

    @beta.setter
    def beta(self, value: float) -> None:
        Prioritized(self.alpha, value)  # the selector's own checks
        self.shard.selector.beta = float(value)

    def _priorities(self, m: int) -> np.ndarray:
        return np.broadcast_to(np.float64(self.max_priority), (m,))

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> PrioritizedReplayBufferSamples:
        """``batch_size`` transitions drawn in proportion to ``priority^alpha``, with replacement.

        Args:
            batch_size, env: as :meth:`GearReplayBuffer.sample`.
        Returns:
            :class:`PrioritizedReplayBufferSamples` (storage-model samples, when ``pos``/``full`` were set by
            hand, have weights 1 and keys -1).
        Raises:
            gear_mpi.EmptyReplayError: nothing was added, or every priority is 0.
        Cost: as :meth:`GearReplayBuffer.sample`, the draw O(B log N) in the shard's index.
        """
        self._flush()
        if (self.pos, self.full) != self._synced:
            base = ReplayBuffer.sample(self, batch_size, env)
            return PrioritizedReplayBufferSamples(*base[:6], th.ones((batch_size, 1), device=self.device),
                                                  np.full(batch_size, -1, np.int64))
        batch = self.shard.sample(batch_size, 1, squeeze=True)
        base = self._samples(batch, env)
        keys, _, weights, _ = batch.meta_numpy()
        weights = th.from_numpy(weights.reshape(-1, 1))  # (numpy's reshape, then one tensor: 0.8 us less than torch's)
        if self.device.type != "cpu":
            weights = weights.to(self.device)
        # the batch's own keys array: update_priorities knows it (the sample's sorted draw then serves the update)
        return PrioritizedReplayBufferSamples(*base[:6], weights, keys)

    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Give sampled transitions new priorities (e.g. ``|TD error| + eps``); keys of transitions already
        overwritten are skipped. Later transitions start at the largest priority given so far.

        Args:
            keys: ``samples.keys`` (or a part of them).
            priorities: one finite, non-negative number per key (array or tensor).
        Returns:
            How many were applied.
        Raises:
            gear_mpi.InvalidKeyError, gear_mpi.InvalidPriorityError: a key of another buffer; a bad priority
                (nothing changes).
        Cost: O(B) plus one batched index update.
        """
        if isinstance(priorities, th.Tensor):
            priorities = priorities.detach().cpu().numpy()
        pr = np.asarray(priorities).reshape(-1)  # as given: the shard refuses text ("1.5") rather than parse it
        applied = self.shard.update_priorities(keys, pr)
        if len(pr):  # validated by the shard: real numbers
            self.max_priority = max(self.max_priority, float(pr.max()))
        return applied


class PrioritizedDQN(DQN):
    """SB3's DQN trained from a :class:`GearPrioritizedReplayBuffer`: each sample's Huber losses are weighted
    by its importance weights, and the sampled transitions get ``|TD error| + priority_eps`` as their new
    priorities; ``beta`` goes linearly from the buffer's initial value to ``beta_final`` over training.
    Everything else is DQN's (its arguments; ``replay_buffer_class`` defaults to the prioritized buffer).

    Args:
        *args, **kwargs: DQN's.
        priority_eps: added to each ``|TD error|`` so that no transition stops being drawn.
        beta_final: ``beta`` at the end of training (None: kept as the buffer's).
    """

    def __init__(self, *args, priority_eps: float = 1e-6, beta_final: float | None = 1.0, **kwargs):
        kwargs.setdefault("replay_buffer_class", GearPrioritizedReplayBuffer)
        self.priority_eps = float(priority_eps)
        self.beta_final = beta_final
        self._beta_start = None
        super().__init__(*args, **kwargs)

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        buffer = self.replay_buffer
        if not isinstance(buffer, GearPrioritizedReplayBuffer):
            raise TypeError(f"PrioritizedDQN needs a GearPrioritizedReplayBuffer, got {type(buffer).__name__}")
        if self.beta_final is not None:
            if self._beta_start is None:
                self._beta_start = buffer.beta
            done = 1.0 - self._current_progress_remaining
            buffer.beta = self._beta_start + (self.beta_final - self._beta_start) * min(1.0, max(0.0, done))
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        losses = []
        for _ in range(gradient_steps):
            data = buffer.sample(batch_size, env=self._vec_normalize_env)
            with th.no_grad():
                best_next = self.q_net_target(data.next_observations).max(dim=1).values.reshape(-1, 1)
                # an n-step buffer's samples carry each sequence's bootstrap discount (gamma ** steps)
                discounts = data.discounts if data.discounts is not None else self.gamma
                target = data.rewards + (1 - data.dones) * discounts * best_next
            q = th.gather(self.q_net(data.observations), dim=1, index=data.actions.long())
            per_item = F.smooth_l1_loss(q, target, reduction="none")
            loss = (data.weights * per_item).mean()
            losses.append(loss.item())
            self.policy.optimizer.zero_grad()
            loss.backward()
            th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            self.policy.optimizer.step()
            td = (q.detach() - target).abs().reshape(-1).cpu().numpy().astype(np.float64)
            if (data.keys >= 0).all():
                buffer.update_priorities(data.keys, td + self.priority_eps)
            else:
                warnings.warn("samples drawn by SB3's storage model carry no keys: priorities not updated")
        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/loss", float(np.mean(losses)))
