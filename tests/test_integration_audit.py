"""Bad input and edge states of the framework integrations and dataset ingest, on one rank (an audit's cases).

House rule: bad input gets a clear error naming the problem and leaves the buffer or replay as it was. Each test
here failed before its fix: SB3's buffers (a failed ``add`` kept part of the transition with
``optimize_memory_usage``; a closed buffer took adds; text priorities were parsed), TorchRL's storage and samplers
(a bad ``load_state_dict`` emptied the replay; a failed ``loads`` closed it; a failed priority update raised the
priority of new items; an empty write or ``sample(0)`` of trajectories failed in numpy or torch), D4RL files
(``terminals``/``timeouts`` of another length than ``observations``). The two-rank cases are in
tests/mpi/test_torchrl_adapter.py and tests/mpi/test_dataset_ingest.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch as th

pytest.importorskip("stable_baselines3")
from gymnasium import spaces  # noqa: E402

import gear_mpi as gm  # noqa: E402
from gear_mpi.integrations.sb3 import GearPrioritizedReplayBuffer, GearReplayBuffer  # noqa: E402

OBS = spaces.Box(-1, 1, (3,), np.float32)
ACT = spaces.Discrete(2)


def _add(buf, value: float, next_value: float | None = None, action=(1,)):
    o = np.full((1, 3), value, np.float32)
    n = np.full((1, 3), value + 1 if next_value is None else next_value, np.float32)
    buf.add(o, n, np.array(action), np.array([1.0]), np.array([0.0]), [{}])


def test_sb3_failed_add_keeps_the_newest_next_observation():
    """optimize_memory_usage: an add that fails (a bad action, a next_obs of another shape) changes nothing;
    before, its next_obs replaced the newest transition's, and a next_obs of another shape was taken and
    failed at the next sample."""
    buf = GearReplayBuffer(10, OBS, ACT, device="cpu", optimize_memory_usage=True, handle_timeout_termination=False)
    for i in range(3):
        _add(buf, i)
    with pytest.raises(ValueError):
        _add(buf, 50, 99, action=(1, 2, 3))  # three actions for one environment
    with pytest.raises(ValueError, match="broadcast"):
        buf.add(np.zeros((1, 3), np.float32), np.zeros((1, 5), np.float32), np.array([1]), np.array([1.0]),
                np.array([0.0]), [{}])
    assert buf.pos == 3 and buf.size() == 3
    assert buf.observations[3, 0].tolist() == [3.0, 3.0, 3.0]  # the newest next_obs, where SB3 keeps it
    s = buf.sample(64)
    assert th.equal(s.next_observations, s.observations + 1)
    buf.close()


def test_sb3_closed_buffer_refuses_every_call():
    """After close(), add, sample, the storage arrays, reset and pickling raise; before, adds were taken (and
    lost at the next flush) and the arrays were views of released memory."""
    buf = GearReplayBuffer(10, OBS, ACT, device="cpu")
    _add(buf, 0)
    buf.close()
    buf.close()  # idempotent
    for call in (lambda: _add(buf, 1), lambda: buf.sample(2), lambda: buf.observations, lambda: buf.rewards,
                 buf.reset, lambda: buf.__getstate__()):
        with pytest.raises(RuntimeError, match="GearReplayBuffer is closed"):
            call()


def test_sb3_priorities_given_as_text_are_refused():
    """update_priorities refuses text as the shard does ("must be numbers"); before, "1.5" was parsed, and the
    largest priority given so far (what new transitions get) moved even though nothing was applied."""
    buf = GearPrioritizedReplayBuffer(10, OBS, ACT, device="cpu", seed=0)
    for i in range(3):
        _add(buf, i)
    s = buf.sample(2)
    before = buf.shard.priorities(s.keys).copy()
    with pytest.raises(gm.InvalidPriorityError, match="must be numbers"):
        buf.update_priorities(s.keys, ["1.5", "7"])
    assert buf.max_priority == 1.0 and np.array_equal(buf.shard.priorities(s.keys), before)
    assert buf.update_priorities(s.keys, np.array([2, 3])) == 2 and buf.max_priority == 3.0  # integers still do
    buf.close()
