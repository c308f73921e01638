"""gear_mpi.integrations.torchrl on K ranks, inside TorchRL's own ReplayBuffer / TensorDictReplayBuffer.

Run by tests/test_torchrl.py on 1 and 2 ranks; by hand:
``mpiexec -n 2 python -m pytest tests/mpi/test_torchrl_adapter.py``. Each rank writes data that names
its rank and step, so every sampled row tells where it came from.

- ``rb.extend`` goes into the writing rank's own shard (its keys name it; ``len(rb)`` counts it alone).
- ``rb.sample()`` is the global draw: rows from every rank's shard, equal to what was written under
  their keys; ``rb.update_priority(index, p)`` reaches the owners (another rank's item made dominant
  is then what every rank draws); priorities given with the data at ``extend`` stay on the writer.
- ``GearSliceSampler``: TorchRL's flat layout, windows of consecutive steps of one trajectory,
  truncated/done/terminated/is_init markers; strict windows redrawn until full on every rank; padded
  or ragged windows for short trajectories; an argument wrong on one rank fails on every rank.
- ``rb.empty()``, ``state_dict``/``load_state_dict`` (local), ``dumps``/``loads`` (collective, a
  gear_mpi checkpoint), ``can_sample`` (collective), one rank's ``Shard.clear()``.
- Refusals: ``set`` at a position, another rank's key read locally, a one-step sampler over
  trajectories, TorchRL's prefetch on several ranks, the writer on another storage.
"""
from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch
from mpi4py import MPI
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer

import gear_mpi as gm
from gear_mpi.integrations import torchrl as gtrl
from replay_checks import COMM, RANK, SIZE, TIMEOUT, expect_same_error, owner_of


@pytest.fixture
def storages():
    """Build GearStorages closed (collectively) at the end of the test."""
    made = []

    def build(*args, **kwargs):
        kwargs.setdefault("timeout", TIMEOUT)
        s = gtrl.GearStorage(*args, **kwargs)
        made.append(s)
        return s

    yield build
    for s in made:
        s.close()


def transitions(n: int, start: int = 0) -> TensorDict:
    """``n`` one-step transitions of this rank: ``step`` numbers them, ``rank`` names the writer."""
    step = torch.arange(start, start + n)
    return TensorDict({"obs": step[:, None].float().expand(n, 4).clone(), "step": step,
                       "rank": torch.full((n,), RANK), "action": (step % 2)[:, None],
                       "next": {"reward": step[:, None].float() / 10, "done": torch.zeros(n, 1, dtype=torch.bool)}},
                      [n])


def buffer(storage, sampler=None, batch_size=16, cls=TensorDictReplayBuffer, **kw):
    return cls(storage=storage, sampler=sampler or gtrl.GearSampler(), writer=gtrl.GearWriter(),
               batch_size=batch_size, **kw)


def test_extend_goes_to_this_ranks_shard_and_sample_draws_from_every_rank(storages):
    rb = buffer(storages(200))
    index = rb.extend(transitions(20 + 5 * RANK, start=1000 * RANK))
    assert index.shape == (20 + 5 * RANK,) and {owner_of(k) for k in index.tolist()} == {RANK}
    assert len(rb) == 20 + 5 * RANK and rb.write_count == 20 + 5 * RANK
    seen = set()
    for _ in range(6):
        s = rb.sample()
        assert s.batch_size == (16,) and s["obs"].shape == (16, 4) and s["next", "reward"].shape == (16, 1)
        owners = [owner_of(k) for k in s["index"].tolist()]
        assert owners == s["rank"].tolist()  # each row is its key's item: written by its owner
        assert torch.equal(s["obs"][:, 0], s["step"].float()) and (s["step"] // 1000 == s["rank"]).all()
        seen.update(owners)
    assert seen == set(range(SIZE))  # the draw is global
    # the rows are what was written under their keys (the owner reads its own)
    mine = rb[:]
    assert sorted(mine["step"].tolist()) == list(range(1000 * RANK, 1000 * RANK + 20 + 5 * RANK))


def test_update_priority_reaches_the_owner(storages):
    rb = buffer(storages(100), gtrl.GearSampler(alpha=1.0, beta=0.5), batch_size=8)
    rb.extend(transitions(10, start=1000 * RANK))
    s = rb.sample()
    assert "priority_weight" in s.keys() and s["priority_weight"].shape == (8,)
    # rank 0 makes one item of the last rank dominant; the others update nothing (an empty call)
    target = COMM.bcast(rb[:]["index"][3].item() if RANK == SIZE - 1 else None, root=SIZE - 1)
    keys = torch.tensor([target] if RANK == 0 else [], dtype=torch.int64)
    rb.update_priority(keys, torch.full((len(keys),), 1e6))
    if RANK == SIZE - 1:
        assert rb.storage.replay.shard.priorities([target])[0] == pytest.approx(1e6)
    s = rb.sample()
    assert (s["index"] == target).float().mean() > 0.9, s["index"]


def test_priorities_given_with_the_data_stay_on_the_writer(storages):
    rb = buffer(storages(100), gtrl.GearSampler(alpha=1.0, beta=0.5), priority_key="td_error")
    data = transitions(6)
    data["td_error"] = torch.arange(1, 7).float() * (RANK + 1)
    index = rb.extend(data)  # TorchRL calls update_priority(index, td_error): local, no collective
    got = rb.storage.replay.shard.priorities(index)
    np.testing.assert_allclose(got, data["td_error"].double().numpy() + 1e-8)
    # new items get the highest priority this rank has set (TorchRL's default for new items)
    more = transitions(2, start=50)
    more["td_error"] = torch.zeros(2)
    index = rb.extend(more, update_priority=False)
    np.testing.assert_allclose(rb.storage.replay.shard.priorities(index), 6.0 * (RANK + 1) + 1e-8)


def episodes(lengths: list[int], offset: int) -> TensorDict:
    """Consecutive episodes of ``lengths`` steps: ``t`` numbers every step, ``ep`` names the episode."""
    parts = []
    for e, n in enumerate(lengths):
        done = torch.zeros(n, 1, dtype=torch.bool)
        done[-1] = True
        init = torch.zeros(n, 1, dtype=torch.bool)
        init[0] = True
        t = offset + 100 * e + torch.arange(n)
        parts.append(TensorDict({"t": t, "ep": torch.full((n,), offset + 100 * e), "is_init": init,
                                 "next": {"done": done, "terminated": done.clone()}}, [n]))
    return torch.cat(parts)


def test_slice_sampler_returns_torchrls_layout(storages):
    rb = buffer(storages(400), gtrl.GearSliceSampler(slice_len=5), batch_size=20)
    rb.extend(episodes([9, 12, 7], offset=10_000 * RANK))
    owners = set()
    for _ in range(5):
        s = rb.sample()
        assert s.batch_size == (20,) and s["index"].shape == (20, 1)
        t = s["t"].reshape(4, 5)
        assert ((t[:, 1:] - t[:, :-1]) == 1).all()  # consecutive steps of one trajectory
        assert (s["ep"].reshape(4, 5) == s["ep"].reshape(4, 5)[:, :1]).all()
        trunc = s["next", "truncated"].reshape(4, 5)
        assert trunc[:, -1].all() and not trunc[:, :-1].any()
        assert s["next", "done"].reshape(4, 5)[:, -1].all()
        ends = t % 100 == torch.tensor([8, 11, 6])[(s["ep"] % 10_000 // 100).reshape(4, 5)]
        assert torch.equal(s["next", "terminated"].reshape(4, 5), ends)
        assert s["is_init"].reshape(4, 5)[:, 0].all()
        assert (s["index"].reshape(4, 5) == s["index"].reshape(4, 5)[:, :1]).all()
        owners.update(owner_of(k) for k in s["index"].reshape(-1).tolist())
    assert owners == set(range(SIZE))


def test_strict_slices_are_redrawn_until_full_on_every_rank(storages):
    # rank 0 holds short episodes (3 steps < 6) among long ones, the others long ones only
    rb = buffer(storages(400), gtrl.GearSliceSampler(num_slices=4), batch_size=24)
    rb.extend(episodes([3, 3, 20, 3, 25] if RANK == 0 else [15, 30], offset=10_000 * RANK))
    for _ in range(4):
        s = rb.sample()
        assert s.batch_size == (24,)
        t = s["t"].reshape(4, 6)
        assert ((t[:, 1:] - t[:, :-1]) == 1).all()
    # only short episodes anywhere: every rank gives up with the same error
    rb.empty()
    rb.extend(episodes([3, 4], offset=10_000 * RANK))
    expect_same_error(rb.sample, RuntimeError, "after 16 redraws")


def test_short_slices_padded_or_cut(storages):
    sampler = gtrl.GearSliceSampler(slice_len=6, strict_length=False, pad_output=True)
    rb = buffer(storages(400), sampler, batch_size=24)
    rb.extend(episodes([2, 4], offset=10_000 * RANK))
    s = rb.sample()
    mask = s["collector", "mask"].reshape(4, 6)
    lengths = mask.sum(-1)
    assert (lengths <= 4).all() and (mask == (torch.arange(6) < lengths[:, None])).all()
    t = s["t"].reshape(4, 6)
    last = t.gather(1, (lengths - 1)[:, None])
    assert (t[~mask] == last.expand(4, 6)[~mask]).all()  # padding repeats the last real step
    trunc = s["next", "truncated"].reshape(4, 6)
    assert (trunc.sum(-1) == 1).all() and trunc.gather(1, (lengths - 1)[:, None]).all()
    # without padding: the real steps only, slice after slice
    rb.set_sampler(gtrl.GearSliceSampler(slice_len=6, strict_length=False))
    s = rb.sample()
    assert 4 <= s.batch_size[0] <= 16 and ("collector", "mask") not in s.keys(True)
    assert s["next", "truncated"].sum() == 4


def test_an_argument_wrong_on_one_rank_fails_on_every_rank(storages):
    rb = buffer(storages(100), gtrl.GearSliceSampler(slice_len=4), batch_size=None)
    rb.extend(episodes([10], offset=0))
    expect_same_error(lambda: rb.sample(8 if RANK else 10), ValueError, "divisible by the slice length")
    assert rb.sample(8).batch_size == (8,)  # the replay is still usable


def test_empty_state_dict_and_clear(storages):
    rb = buffer(storages(50))
    rb.extend(transitions(10, start=1000 * RANK))
    sd = rb.state_dict()
    assert sd["_storage"]["columns"]["step"].tolist() == list(range(1000 * RANK, 1000 * RANK + 10))
    rb.empty()
    assert len(rb) == 0 and rb.write_count == 0
    expect_same_error(rb.sample, gm.EmptyReplayError, "Cannot sample from an empty storage")
    rb.load_state_dict(sd)
    assert len(rb) == 10 and sorted(rb[:]["step"].tolist()) == list(range(1000 * RANK, 1000 * RANK + 10))
    assert {owner_of(k) for k in rb.sample()["index"].tolist()} <= set(range(SIZE))
    # one rank's Replay.clear(): the others keep theirs, and the draw takes from them only
    if SIZE > 1:
        if RANK == 0:
            rb.storage.replay.settle()
            assert rb.storage.replay.shard.clear() == 10  # this rank's shard alone (Replay.clear: all)
        s = rb.sample()
        assert 0 not in s["rank"].tolist()
        assert rb.can_sample()  # collective: rank 0 holds nothing, the others do


def test_dumps_and_loads_restore_every_shard(storages):
    rb = buffer(storages(64), gtrl.GearSampler(alpha=0.7, beta=0.4))
    data = transitions(12, start=1000 * RANK)
    data["td_error"] = torch.rand(12) + 0.5
    rb.extend(data)
    path = COMM.bcast(tempfile.mkdtemp(prefix="gear_trl_") if RANK == 0 else None, root=0)
    try:
        rb.dumps(path)
        before = (sorted(rb[:]["step"].tolist()), np.sort(rb.storage.replay.shard.priorities(rb[:]["index"])))
        rb2 = buffer(storages(64), gtrl.GearSampler(alpha=0.7, beta=0.4))
        rb2.loads(path)
        after = (sorted(rb2[:]["step"].tolist()), np.sort(rb2.storage.replay.shard.priorities(rb2[:]["index"])))
        assert before[0] == after[0]
        np.testing.assert_allclose(before[1], after[1])
        assert rb2.sample()["obs"].shape == (16, 4)
    finally:
        COMM.barrier()
        if RANK == 0:
            import shutil
            shutil.rmtree(path, ignore_errors=True)


def test_plain_replay_buffer_with_tensors_and_pytrees(storages):
    rb = buffer(storages(30), cls=ReplayBuffer, batch_size=5)
    rb.extend(torch.arange(10)[:, None] + 1000 * RANK)
    x = rb.sample()
    assert x.shape == (5, 1) and set((x[:, 0] // 1000).tolist()) <= set(range(SIZE))
    rb2 = buffer(storages(30), cls=ReplayBuffer, batch_size=5)
    rb2.extend({"a": torch.arange(10), "b": (torch.ones(10, 2), torch.zeros(10, dtype=torch.bool))})
    y = rb2.sample()
    assert y["a"].shape == (5,) and y["b"][0].shape == (5, 2) and y["b"][1].dtype == torch.bool


def test_refusals(storages):
    storage = storages(20)
    rb = buffer(storage)
    rb.extend(transitions(4, start=1000 * RANK))
    with pytest.raises(TypeError, match="GearWriter"):
        storage.set(0, transitions(1)[0])
    with pytest.raises(TypeError, match="GearStorage"):
        TensorDictReplayBuffer(storage=LazyTensorStorage(10), writer=gtrl.GearWriter())
    with pytest.raises(gm.InvalidTrajectoryError, match="missing"):
        rb.extend(transitions(2).exclude("obs"))
    if SIZE > 1:
        other = COMM.allgather(rb[:]["index"][0].item())[(RANK + 1) % SIZE]
        with pytest.raises(gm.InvalidKeyError, match="belongs to shard"):
            storage.get(other)
        with pytest.raises(ValueError, match="prefetch"):
            buffer(storages(20), prefetch=2)
    slices = buffer(storages(100, max_length=16))
    slices.extend(episodes([5], offset=0))
    expect_same_error(slices.sample, ValueError, "use GearSliceSampler")


def test_first_write_with_different_layouts_fails_on_every_rank(storages):
    rb = buffer(storages(20))
    data = transitions(3)
    if RANK == 0 and SIZE > 1:
        data["extra"] = torch.zeros(3)
    if SIZE > 1:
        expect_same_error(lambda: rb.extend(data), ValueError, "Replay construction")
    else:
        rb.extend(data)
        assert len(rb) == 3


def test_slice_sampler_over_two_dimensional_writes(storages):
    """``[rows, T]`` data (a collector's batch): each row its own stream, cut at its end."""
    rb = buffer(storages(200), gtrl.GearSliceSampler(slice_len=4), batch_size=8)
    t = torch.arange(3 * 10).reshape(3, 10) + 1000 * RANK
    rb.extend(TensorDict({"t": t, "next": {"done": torch.zeros(3, 10, 1, dtype=torch.bool)}}, [3, 10]))
    assert len(rb) == 30
    for _ in range(5):
        w = rb.sample()["t"].reshape(2, 4)
        assert ((w[:, 1:] - w[:, :-1]) == 1).all() and (w[:, 0] // 10 == w[:, -1] // 10).all()


@pytest.mark.skipif(SIZE < 2, reason="needs two ranks")
def test_a_rank_that_never_wrote_cannot_join_and_says_so(storages):
    rb = buffer(storages(20))
    with pytest.raises(RuntimeError, match="nothing has been written on this rank"):
        rb.storage.draw(1, 1, None)


@pytest.mark.parametrize("reduction", ["max", "min", "mean", "median"])
def test_items_with_their_own_batch_dims_and_update_tensordict_priority(storages, reduction):
    """``[3, 4]`` data: 3 items of 4 steps each (TorchRL's ndim=1 storage); a ``[B, 4]`` td_error is reduced to
    one priority per item by ``reduction``, through TensorDictReplayBuffer.update_tensordict_priority."""
    rb = buffer(storages(100), gtrl.GearSampler(alpha=1.0, beta=0.9, reduction=reduction), batch_size=3,
                priority_key="td_error")
    rb.extend(TensorDict({"obs": torch.randn(3, 4, 5), "actions": torch.randn(3, 4, 2)}, [3, 4]))
    s = rb.sample()
    assert s.batch_size == (3, 4) and s["obs"].shape == (3, 4, 5)
    error = torch.rand(3, 4) + 0.1
    s.set("td_error", error)
    rb.update_tensordict_priority(s)  # collective: routed to each row's owner
    expected = {"max": error.amax(1), "min": error.amin(1), "mean": error.mean(1),
                "median": error.median(1).values}[reduction]
    keys = s["index"][:, 0]
    sent = [kv for ks, vs in COMM.allgather((keys.tolist(), expected.tolist())) for kv in zip(ks, vs)]
    once = {k for k, _ in sent if sum(kk == k for kk, _ in sent) == 1}  # a key drawn twice: its values combined
    for k, v in sent:
        if k in once and owner_of(k) == RANK:  # the owner holds what was sent
            assert rb.storage.replay.shard.priorities([k])[0] == pytest.approx(v + 1e-8, rel=1e-6)
    assert once
    s = rb.sample()
    assert (s["priority_weight"] > 0).all() and s.batch_size == (3, 4)


def test_ranks_whose_data_lists_entries_in_another_order_build_one_replay(storages):
    """A TensorDict's entry order follows how it was built (a collector's batch can differ from rank to rank):
    the layout is in one order on every rank."""
    n = 4
    parts = [("obs", torch.zeros(n, 2)), ("next", TensorDict({"reward": torch.ones(n), "done": torch.zeros(n)}, [n])),
             ("rank", torch.full((n,), RANK))]
    if RANK % 2:
        parts.reverse()
    rb = buffer(storages(20))
    rb.extend(TensorDict(dict(parts), [n]))
    s = rb.sample()
    assert (s["next", "reward"] == 1).all() and set(s["rank"].tolist()) <= set(range(SIZE))


def test_priorities_torch_cannot_read_on_one_rank_fail_on_every_rank(storages):
    """Text priorities given on one rank (the sampler's own call): the same InvalidPriorityError on every rank,
    nothing changed; before, torch's ValueError on that rank while the others waited in the collective update."""
    sampler = gtrl.GearSampler(alpha=1.0, beta=0.5)
    rb = buffer(storages(50), sampler, batch_size=4)
    rb.extend(transitions(8, start=1000 * RANK))
    index = rb.sample()["index"]
    mine = rb[:]["index"]
    before = rb.storage.replay.shard.priorities(mine).copy()
    priority = ["a"] * 4 if RANK == 0 else torch.full((4,), 5.0)
    expect_same_error(lambda: sampler.update_priority(index, priority, storage=rb.storage), gm.InvalidPriorityError,
                      "rank 0: priorities must be numbers")
    assert np.array_equal(rb.storage.replay.shard.priorities(mine), before)


def test_loads_without_layout_on_one_rank_fails_on_every_rank_and_keeps_the_replay(storages):
    """storage.loads where one rank (the last) finds no layout.pt: the same CheckpointError on every rank, and every rank
    keeps its replay; before, that rank raised FileNotFoundError alone while the others closed their replay and
    waited in Replay.load until the timeout."""
    storage = storages(64)
    rb = buffer(storage)
    rb.extend(transitions(12, start=1000 * RANK))
    path = COMM.bcast(tempfile.mkdtemp(prefix="gear_trl_") if RANK == 0 else None, root=0)
    try:
        storage.dumps(path)
        where = path + "/no-such-dir" if RANK == SIZE - 1 else path  # the last rank finds no layout.pt
        expect_same_error(lambda: storage.loads(where), gm.CheckpointError, f"rank {SIZE - 1}: ")
        assert sorted(rb[:]["step"].tolist()) == list(range(1000 * RANK, 1000 * RANK + 12))
        assert rb.sample()["obs"].shape == (16, 4)
    finally:
        COMM.barrier()
        if RANK == 0:
            import shutil
            shutil.rmtree(path, ignore_errors=True)
