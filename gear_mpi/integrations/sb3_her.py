"""Hindsight experience replay for Stable-Baselines3 on a gear_mpi shard: :class:`GearHerReplayBuffer`.

``SAC("MultiInputPolicy", env, replay_buffer_class=GearHerReplayBuffer, replay_buffer_kwargs=dict(...))`` (or
DQN, TD3, DDPG) runs as with SB3's ``HerReplayBuffer``: SB3 hands the buffer the training environment (the class
is a subclass of ``HerReplayBuffer``), the buffer stores goal-conditioned transitions (a ``Dict`` space with
``achieved_goal`` and ``desired_goal``) and samples a share ``n_sampled_goal / (n_sampled_goal + 1)`` of each
batch as *virtual* transitions, whose desired goal is replaced by a goal achieved later in the same episode
(``"future"``), at its end (``"final"``) or anywhere in it (``"episode"``), with the reward the environment's
``compute_reward`` gives for it.

What gear_mpi does here, and what stays SB3's. The transitions live in the shard's column rings as
:class:`~gear_mpi.integrations.sb3.GearReplayBuffer` stores a ``Dict`` space, and the draw is the shard's: a
transition may only be drawn once its episode has ended (SB3's rule: an unfinished episode has no future to take
goals from), so every transition enters at priority 0 and its episode's transitions get priority 1 when the
episode ends, 0 again when the buffer starts to overwrite the episode; a ``Prioritized(alpha=1)`` selector then
draws uniformly among the finished episodes' transitions, as SB3 does. The episode bookkeeping (where each
transition's episode starts and how long it is) is SB3's, in the same arrays (``ep_start``, ``ep_length``), and
the priority changes it implies reach the shard in one update before the next draw. Goals are drawn with NumPy's
global generator, as SB3 draws them (``set_random_seed`` makes them repeat); the transitions with the shard's own
stream.

Needs ``stable-baselines3`` (the ``sb3`` extra).
"""
from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.type_aliases import DictReplayBufferSamples
from stable_baselines3.common.vec_env import VecEnv, VecNormalize
from stable_baselines3.her.goal_selection_strategy import KEY_TO_GOAL_STRATEGY, GoalSelectionStrategy
from stable_baselines3.her.her_replay_buffer import HerReplayBuffer

from ..selection.selectors import Prioritized
from ..spec import check_count
from .sb3 import GearReplayBuffer

__all__ = ["GearHerReplayBuffer"]

_GOAL_KEYS = ("achieved_goal", "desired_goal")


class GearHerReplayBuffer(GearReplayBuffer, HerReplayBuffer):
    """SB3's ``HerReplayBuffer`` on a :class:`~gear_mpi.shard.Shard` (see the module docstring).

    Memory: as :class:`~gear_mpi.integrations.sb3.GearReplayBuffer` for the ``Dict`` space, plus SB3's episode
    arrays (two int64 a transition) and, with ``copy_info_dict``, the ``infos`` dicts. Not thread-safe.

    Args:
        buffer_size: transitions kept (over all environments), as SB3's.
        observation_space: a ``Dict`` space with ``achieved_goal`` and ``desired_goal`` keys.
        action_space: the action space.
        device, n_envs, handle_timeout_termination: as SB3's ``HerReplayBuffer``.
        optimize_memory_usage: not supported (a ``Dict`` space), as SB3's.
        env: the training ``VecEnv`` (SB3 passes it); its first environment's ``compute_reward`` rewards the
            virtual transitions. None is allowed until :meth:`set_env` (after unpickling).
        n_sampled_goal: virtual transitions per real one (>= 0).
        goal_selection_strategy: ``"future"``, ``"final"``, ``"episode"`` or a ``GoalSelectionStrategy``.
        copy_info_dict: keep each step's ``infos`` and pass them to ``compute_reward``.
        seed, memory: as :class:`~gear_mpi.integrations.sb3.GearReplayBuffer`.
    Raises:
        ValueError: a space without ``achieved_goal``/``desired_goal``, an unknown strategy, a negative or
            non-integer ``n_sampled_goal``; otherwise as :class:`~gear_mpi.integrations.sb3.GearReplayBuffer`.
    """

    def __init__(self, buffer_size: int, observation_space: spaces.Dict, action_space: spaces.Space,
                 env: VecEnv | None, device: th.device | str = "auto", n_envs: int = 1,
                 optimize_memory_usage: bool = False, handle_timeout_termination: bool = True,
                 n_sampled_goal: int = 4, goal_selection_strategy: GoalSelectionStrategy | str = "future",
                 copy_info_dict: bool = False, *, seed: int | None = None, memory: str = "private"):
        if not isinstance(observation_space, spaces.Dict) or any(k not in observation_space.spaces
                                                                 for k in _GOAL_KEYS):
            raise ValueError("GearHerReplayBuffer needs a Dict observation space with 'achieved_goal' and "
                             f"'desired_goal' keys, got {observation_space}")
        if isinstance(goal_selection_strategy, str):
            strategy = KEY_TO_GOAL_STRATEGY.get(goal_selection_strategy.lower())
        else:
            strategy = goal_selection_strategy if isinstance(goal_selection_strategy, GoalSelectionStrategy) else None
        if strategy is None:
            raise ValueError(f"goal_selection_strategy must be one of {list(KEY_TO_GOAL_STRATEGY)} (or a "
                             f"GoalSelectionStrategy), got {goal_selection_strategy!r}")
        check_count(n_sampled_goal, "n_sampled_goal", 0)
        super().__init__(buffer_size, observation_space, action_space, device, n_envs, optimize_memory_usage,
                         handle_timeout_termination, seed=seed, memory=memory)
        self.env = env
        self.copy_info_dict = bool(copy_info_dict)
        self.goal_selection_strategy = strategy
        self.n_sampled_goal = int(n_sampled_goal)
        self.her_ratio = 1 - (1.0 / (self.n_sampled_goal + 1))
        self._episodes_reset()

    def _episodes_reset(self) -> None:
        """SB3's episode arrays, empty; no transition drawable. The ``infos`` of each step only with
        ``copy_info_dict`` (SB3 keeps an empty dict a transition either way: about 70 MB a million)."""
        self.infos = np.array([[{} for _ in range(self.n_envs)] for _ in range(self.buffer_size)]) \
            if self.copy_info_dict else None
        self.ep_start = np.zeros((self.buffer_size, self.n_envs), dtype=np.int64)
        self.ep_length = np.zeros((self.buffer_size, self.n_envs), dtype=np.int64)
        self._current_ep_start = np.zeros(self.n_envs, dtype=np.int64)
        self._changes: list[tuple[np.ndarray, float]] = []  # (ring steps, priority), in order, not yet in the shard
        self._pending = 0  # ring steps in _changes
        self._step_keys = np.full(self.buffer_size * self.n_envs, -1, np.int64)  # the key of each ring step's item

    # ---- the shard: a transition is drawable (priority 1) once its episode has ended -------------------------
    def _selector(self):
        return Prioritized(1.0, 0.0)  # P(i) = p_i / sum p: uniform over the priority-1 transitions

    def _priorities(self, m: int) -> np.ndarray:
        return np.zeros(m)  # its episode has not ended yet

    def _stored(self, first_step: int, keys: np.ndarray) -> None:
        steps = (first_step + np.arange(len(keys))) % len(self._step_keys)
        self._step_keys[steps] = keys

    def _mark(self, positions: np.ndarray, env_idx: int, drawable: bool) -> None:
        """Record that the transitions of environment ``env_idx`` at ``positions`` become drawable or not."""
        self._changes.append((positions * self.n_envs + env_idx, 1.0 if drawable else 0.0))
        self._pending += len(positions)
        if self._pending > len(self._step_keys):  # adds without samples: keep the record bounded
            self._sync()

    def _sync(self) -> None:
        """The recorded changes into the shard's priorities, in one update (the last change of a step wins).
        O(changes)."""
        self._flush()  # every changed step's item is in the shard, and _step_keys knows it
        if not self._changes:
            return
        steps = np.concatenate([s for s, _ in self._changes])
        values = np.concatenate([np.full(len(s), v) for s, v in self._changes])
        self._changes, self._pending = [], 0
        self.shard.update_priorities(self._step_keys[steps], values)

    # ---- SB3's episode bookkeeping -------------------------------------------------------------------------------
    def add(self, obs: dict[str, np.ndarray], next_obs: dict[str, np.ndarray], action: np.ndarray,
            reward: np.ndarray, done: np.ndarray, infos: list[dict[str, Any]]) -> None:
        """Store one transition of each environment, as SB3's ``HerReplayBuffer.add``: an episode that the new
        transitions start to overwrite stops being drawable as a whole; an environment whose step is done ends
        its episode, whose transitions become drawable. Cost: as the plain buffer's ``add``, plus O(episode)
        bookkeeping when an episode ends or is overwritten.

        Raises:
            ValueError, TypeError, KeyError: as ``GearReplayBuffer.add`` (nothing of the transition kept, the
                bookkeeping unchanged).
        """
        p = self.pos
        super().add(obs, next_obs, action, reward, done, infos)
        for env_idx in range(self.n_envs):
            length = self.ep_length[p, env_idx]
            if length > 0:  # the oldest episode's first transition was overwritten: none of it is drawable now
                gone = np.arange(p, self.ep_start[p, env_idx] + length) % self.buffer_size
                self.ep_length[gone, env_idx] = 0
                self._mark(gone, env_idx, False)
        self.ep_start[p] = self._current_ep_start
        if self.copy_info_dict:
            self.infos[p] = infos
        for env_idx in range(self.n_envs):
            if done[env_idx]:
                self._compute_episode_length(env_idx)

    def _compute_episode_length(self, env_idx: int) -> None:
        """End environment ``env_idx``'s current episode at ``pos``: its length into ``ep_length``, its
        transitions drawable (SB3's method of the same name, which ``truncate_last_trajectory`` calls too)."""
        start, end = int(self._current_ep_start[env_idx]), self.pos
        if end < start:  # the episode wrapped around the end of the buffer
            end += self.buffer_size
        steps = np.arange(start, end) % self.buffer_size
        self.ep_length[steps, env_idx] = end - start
        self._mark(steps, env_idx, end > start)
        self._current_ep_start[env_idx] = self.pos

    # ---- sampling -------------------------------------------------------------------------------------------------
    def sample(self, batch_size: int, env: VecNormalize | None = None) -> DictReplayBufferSamples:
        """``batch_size`` transitions of ended episodes, uniformly with replacement (the shard's draw); the first
        ``int(her_ratio * batch_size)`` drawn get a new desired goal and its reward (virtual), and the batch lists
        the real ones first, as SB3's.

        Args:
            batch_size: transitions to draw.
            env: a ``VecNormalize`` whose statistics normalize observations and rewards (None: as stored).
        Returns:
            SB3's ``DictReplayBufferSamples``.
        Raises:
            RuntimeError: no episode has ended yet (SB3's message), or virtual transitions are needed and no
                environment is set.
        Cost: the priority changes since the last call (one update), one shard sample, a gather of the virtual
        goals from the ring and one ``compute_reward`` call for them.
        """
        self._sync()
        if self.shard.total_weight <= 0:  # (the sum of the priorities: the drawable transitions)
            raise RuntimeError("Unable to sample before the end of the first episode. We recommend choosing a value "
                               "for learning_starts that is greater than the maximum number of timesteps in the "
                               "environment.")
        batch = self.shard.sample(batch_size, 1, squeeze=True)
        positions, envs = np.divmod(self.shard.locate(batch.keys.numpy())[0], self.n_envs)
        d = batch.numpy()
        done = self._sampled_dones(d)
        n_virtual = int(self.her_ratio * batch_size)
        real, virtual = np.arange(n_virtual, batch_size), np.arange(n_virtual)  # the draw's rows
        obs, next_obs, rewards = [], [], []
        for rows in (real, virtual):
            if not len(rows):
                continue
            o = {key: d[f"obs/{key}"][rows] for key in self._obs_keys}
            n = {key: d[f"next_obs/{key}"][rows] for key in self._obs_keys}
            if rows is virtual:  # a goal achieved later in the episode, and what reaching it is worth
                o["desired_goal"] = n["desired_goal"] = self._sample_goals(positions[rows], envs[rows])
                r = self._rewards(n["achieved_goal"], o["desired_goal"], positions[rows], envs[rows])
            else:
                r = d["reward"][rows]
            obs.append(self._normalize_obs(o, env))
            next_obs.append(self._normalize_obs(n, env))
            rewards.append(self._normalize_reward(r.reshape(-1, 1), env))
        order = np.concatenate([real, virtual])
        return DictReplayBufferSamples(
            {key: self._tensor(np.concatenate([o[key] for o in obs])) for key in self._obs_keys},
            self._tensor(d["action"][order]),
            {key: self._tensor(np.concatenate([n[key] for n in next_obs])) for key in self._obs_keys},
            self._tensor(done[order]), self._tensor(np.concatenate(rewards).astype(np.float32, copy=False)))

    def _sample_goals(self, positions: np.ndarray, envs: np.ndarray) -> np.ndarray:
        """New desired goals for transitions at ``positions`` of ``envs``: the ``achieved_goal`` of a next
        observation of the same episode, by the strategy (SB3's rule, ``future`` inclusive of the transition)."""
        start, length = self.ep_start[positions, envs], self.ep_length[positions, envs]
        if self.goal_selection_strategy == GoalSelectionStrategy.FINAL:
            index_in_episode = length - 1
        elif self.goal_selection_strategy == GoalSelectionStrategy.FUTURE:
            index_in_episode = np.random.randint((positions - start) % self.buffer_size, length)
        else:  # EPISODE
            index_in_episode = np.random.randint(0, length)
        at = (index_in_episode + start) % self.buffer_size
        return self._views["next_obs/achieved_goal"][at, envs]

    def _rewards(self, achieved: np.ndarray, desired: np.ndarray, positions: np.ndarray,
                 envs: np.ndarray) -> np.ndarray:
        """The environment's ``compute_reward`` for the virtual transitions (float32)."""
        if self.env is None:
            raise RuntimeError("GearHerReplayBuffer needs its VecEnv to reward virtual transitions: pass env= or "
                               "call set_env() (an unpickled buffer has none)")
        infos = copy.deepcopy(self.infos[positions, envs]) if self.copy_info_dict else [{} for _ in positions]
        return np.asarray(self.env.env_method("compute_reward", achieved, desired, infos, indices=[0])[0],
                          np.float32)

    # ---- reset and pickling ----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty the buffer and its episode bookkeeping. O(items held + buffer_size)."""
        super().reset()
        self._episodes_reset()

    def __getstate__(self) -> dict:
        """As the plain buffer's (the shard's contents, drawability included), without the environment (which
        may not pickle; SB3 sets it again on ``load_replay_buffer``) or the ring's key map (rebuilt)."""
        self._sync()
        state = super().__getstate__()
        state.pop("env", None)
        state.pop("_step_keys", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.env = None
        self._step_keys = np.full(self.buffer_size * self.n_envs, -1, np.int64)
        keys = self.shard.live_keys()
        if len(keys):
            self._step_keys[self.shard.locate(keys)[0]] = keys
