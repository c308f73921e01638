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

import re

import numpy as np
import pytest
import torch as th

pytest.importorskip("stable_baselines3")
pytest.importorskip("torchrl")
from gymnasium import spaces  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl.data import TensorDictReplayBuffer  # noqa: E402

import gear_mpi as gm  # noqa: E402
from gear_mpi.integrations import torchrl as gtrl  # noqa: E402
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


# ---- TorchRL ------------------------------------------------------------------------------------------
def _steps(n: int, start: int = 0) -> TensorDict:
    step = th.arange(start, start + n)
    return TensorDict({"obs": step[:, None].float().expand(n, 4).clone(), "step": step,
                       "next": {"done": th.zeros(n, 1, dtype=th.bool)}}, [n])


def _held(storage) -> list[int]:
    return sorted(storage.get(slice(None))["step"].tolist())


def test_torchrl_bad_state_dict_leaves_the_items_as_they_were():
    """load_state_dict checks the whole state first; before, the shard was emptied and then the columns were
    refused (every item lost), or the items were replaced and then the priorities refused (half-loaded)."""
    storage = gtrl.GearStorage(50, timeout=20)
    rb = TensorDictReplayBuffer(storage=storage, sampler=gtrl.GearSampler(alpha=1.0, beta=0.5), batch_size=4)
    rb.extend(_steps(10))
    good = storage.state_dict()
    rb.extend(_steps(3, start=100))
    held = _held(storage)
    bad_columns = dict(good, columns=dict(good["columns"], obs=good["columns"]["obs"][:, :2]))
    bad_lengths = dict(good, lengths=good["lengths"] * 0)
    bad_priorities = dict(good, priorities=good["priorities"][:2])
    negative = dict(good, priorities=-good["priorities"])
    for state, cls, what in ((bad_columns, gm.InvalidTrajectoryError, "column 'obs' has shape"),
                             (bad_lengths, gm.InvalidTrajectoryError, "length"),
                             (bad_priorities, gm.InvalidPriorityError, "got 2 values for 10"),
                             (negative, gm.InvalidPriorityError, "non-negative"),
                             ({"layout": good["layout"]}, ValueError, "lacks")):
        with pytest.raises(cls, match=what):
            storage.load_state_dict(state)
        assert _held(storage) == held and len(storage) == 13
    storage.load_state_dict(good)
    assert _held(storage) == list(range(10))
    storage.close()
    assert len(storage) == 0  # a closed storage holds nothing (was the count before the close)


def test_torchrl_failed_loads_keeps_the_replay(tmp_path):
    """loads of a directory without layout.pt, or of a damaged checkpoint, raises CheckpointError and the storage
    goes on with its replay; before, the replay was closed first (every item lost, every later call failing)."""
    storage = gtrl.GearStorage(50, timeout=20)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
    rb.extend(_steps(10))
    storage.dumps(tmp_path / "ok")
    (tmp_path / "ok" / "replay" / "MANIFEST.json").write_text("{")
    for path in (tmp_path / "missing", tmp_path / "ok"):
        with pytest.raises(gm.CheckpointError):
            storage.loads(path)
        assert _held(storage) == list(range(10)) and rb.sample()["obs"].shape == (4, 4)
    storage.close()


def test_torchrl_refused_priorities_change_nothing():
    """A refused update (a negative priority beside a large one; complex priorities; text) changes no priority and
    not the priority new items get; before, the large one became new items' priority, complex ones were taken
    with their imaginary parts dropped, and text failed in torch (on one rank only: the others waited)."""
    storage = gtrl.GearStorage(50, timeout=20)
    sampler = gtrl.GearSampler(alpha=1.0, beta=0.5)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=2)
    rb.extend(_steps(4))
    index = rb.sample()["index"]
    shard = storage.replay.shard
    before = shard.priorities(index).copy()
    for priority, what in ((th.tensor([1e9, -1.0]), "non-negative"), (th.tensor([1 + 2j, 3 + 0j]), "real numbers"),
                           (["high", "low"], "must be numbers")):
        with pytest.raises(gm.InvalidPriorityError, match=what):
            sampler.update_priority(index, priority, storage=storage)
        assert np.array_equal(shard.priorities(index), before)
    keys = rb.extend(_steps(2, start=10))
    assert shard.priorities(keys).tolist() == [1.0, 1.0]
    storage.close()


def test_torchrl_empty_writes_and_draws_of_trajectories():
    """A trajectory storage takes an empty write (no keys) and a slice sampler draws 0 steps (an empty batch), as
    the one-step ones do; before, numpy's "slice step cannot be zero" and torch's "cannot reshape" escaped."""
    for sampler in (gtrl.GearSliceSampler(slice_len=2), gtrl.GearSliceSampler(num_slices=2),
                    gtrl.GearSliceSampler(slice_len=2, strict_length=False, pad_output=True)):
        storage = gtrl.GearStorage(50, max_length=10, timeout=20)
        rb = TensorDictReplayBuffer(storage=storage, sampler=sampler)  # (a batch_size here: TorchRL warns at sample)
        assert rb.extend(_steps(0)).shape == (0,)  # the first write, empty: builds the replay, stores nothing
        rb.extend(_steps(10))
        assert rb.extend(_steps(0)).shape == (0,) and len(storage) == 10
        assert rb.extend(_steps(6).reshape(2, 3)[:, :0]).shape == (2, 0)
        assert rb.sample(0).batch_size == (0,) and rb.sample(4).batch_size == (4,)
        storage.close()


def test_torchrl_constructors_refuse_bad_sizes_and_exponents_at_once():
    """``GearStorage(max_size=-3)`` and ``GearSampler(alpha=-1, beta=0.4)`` were accepted and failed only at the
    first write (a collective); now at construction, naming the argument."""
    from gear_mpi.integrations.torchrl import GearSampler, GearStorage
    for kw, what in (({"max_size": -3}, "max_size must be a positive integer, got -3"),
                     ({"max_size": 2.5}, "max_size must be a positive integer, got 2.5"),
                     ({"max_size": 10, "max_length": True}, "max_length must be a positive integer, got True")):
        with pytest.raises(ValueError, match=re.escape(what)):
            GearStorage(**kw)
    with pytest.raises(ValueError, match="alpha must be a finite number >= 0, got -1"):
        GearSampler(alpha=-1, beta=0.4)
    with pytest.raises(ValueError, match="beta must be a finite number >= 0, got 'x'"):
        GearSampler(alpha=0.6, beta="x")


def test_torchrl_slice_sampler_refuses_counts_that_are_no_integers():
    """``GearSliceSampler(num_slices=2.5)`` and ``slice_len="2"`` passed an ``int(v) < 1`` check, and
    ``max_redraws=1.5`` was truncated; each now raises a ValueError naming it."""
    from gear_mpi.integrations.torchrl import GearSliceSampler
    for kw, what in (({"num_slices": 2.5}, "num_slices must be an integer in [1, "),
                     ({"slice_len": "2"}, "slice_len must be an integer in [1, "),
                     ({"slice_len": True}, "slice_len must be an integer in [1, "),
                     ({"slice_len": 0}, "slice_len must be an integer in [1, "),
                     ({"slice_len": 2, "max_redraws": 1.5}, "max_redraws must be an integer in [0, "),
                     ({"slice_len": 2, "max_redraws": -1}, "max_redraws must be an integer in [0, ")):
        with pytest.raises(ValueError, match=re.escape(what)):
            GearSliceSampler(**kw)
    assert GearSliceSampler(num_slices=np.int64(2), max_redraws=0).max_redraws == 0
