"""n-step returns over Stable-Baselines3's storage layout, as SB3's ``NStepReplayBuffer`` computes them.

A pure function over explicit arrays (no buffer state): :func:`n_step_targets` takes the reward, done and
timeout rings in SB3's ``[buffer_size, n_envs]`` layout, the position and environment of each sampled
transition and the newest position, and returns what SB3's ``NStepReplayBuffer._get_samples`` puts in a
sample beside the first transition's observation and action: the discounted return of up to ``n_steps``
rewards of the same environment, the discount that bootstraps from the last one, where the last one is
(for its next observation), and its done flag. :class:`~gear_mpi.integrations.sb3.GearReplayBuffer` calls it
with ``n_steps > 1`` after drawing the transitions from its shard.

The rule, SB3's: a sequence runs over positions ``p, p + 1, ...`` (modulo ``buffer_size``) of one
environment and stops at the first step that is done or cut by a time limit, inclusive, or at the newest
position (the one before ``pos``: the step after it is the oldest transition when the buffer is full, or
nothing), or after ``n_steps`` steps. Rewards are discounted by ``gamma ** k``; the bootstrap discount is
``gamma ** steps``; the done flag is the last step's done unless a time limit cut it. The same float32
operations in the same order as SB3's, so the results are equal bit for bit (tests/test_sb3.py).
"""
from __future__ import annotations

from typing import Callable

import numpy as np


def n_step_targets(rewards: np.ndarray, dones: np.ndarray, timeouts: np.ndarray, positions: np.ndarray,
                   envs: np.ndarray, newest: int, n_steps: int, gamma: float,
                   normalize_reward: Callable[[np.ndarray], np.ndarray] | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The n-step targets of ``B`` sampled transitions (see the module docstring). O(B * n_steps) reads of the
    rings, no state; the rings are only read.

    Args:
        rewards, dones, timeouts: ``[buffer_size, n_envs]`` float32 rings (SB3's ``rewards``, ``dones``,
            ``timeouts``; timeouts all 0 without ``handle_timeout_termination``).
        positions: ``[B]`` int64 positions of the sampled transitions.
        envs: ``[B]`` int64 environments of the sampled transitions.
        newest: the newest position (``(pos - 1) % buffer_size``): no sequence runs past it.
        n_steps: rewards summed at most (>= 1).
        gamma: the discount factor.
        normalize_reward: applied to the ``[B, n_steps]`` rewards before discounting (a ``VecNormalize``'s,
            as SB3 applies it), or None.
    Returns:
        ``(returns, discounts, last, final_dones)``: ``[B, 1]`` discounted returns, ``[B, 1]`` float32
        bootstrap discounts ``gamma ** steps``, ``[B]`` int64 positions of each sequence's last step, and
        ``[B, 1]`` float32 done flags of that step (``done * (1 - timeout)``).
    """
    size = rewards.shape[0]
    steps = np.arange(n_steps).reshape(1, -1)
    indices = (positions[:, None] + steps) % size  # [B, n_steps]
    env_col = envs[:, None]
    rewards_seq = rewards[indices, env_col]
    if normalize_reward is not None:
        rewards_seq = normalize_reward(rewards_seq)
    dones_seq = dones[indices, env_col]
    cut = np.logical_or(dones_seq, timeouts[indices, env_col])
    # the newest position ends every sequence: SB3 marks it as cut by a time limit unless it is done
    stop = np.logical_or(cut, indices == newest)
    first_stop = stop.argmax(axis=1)
    first_stop = np.where(stop.any(axis=1), first_stop, n_steps - 1)
    mask = steps <= first_stop[:, None]
    discounts = gamma ** mask.sum(axis=1, keepdims=True).astype(np.float32)
    weights = gamma ** np.arange(n_steps, dtype=np.float32).reshape(1, -1)
    returns = (rewards_seq * weights * mask).sum(axis=1, keepdims=True)
    last = (positions + first_stop) % size
    final_dones = dones[last, envs][:, None].astype(np.float32)
    final_dones = final_dones * (1.0 - timeouts[last, envs][:, None].astype(np.float32))
    return returns, discounts, last, final_dones


__all__ = ["n_step_targets"]
