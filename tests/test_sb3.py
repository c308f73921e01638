"""gear_mpi's Stable-Baselines3 buffers against SB3's own: the same storage after the same adds, SB3's sampling
semantics (distribution, FIFO overwrite, timeouts, optimize_memory_usage, VecNormalize, device), pickling and
reset, the prioritized variant, and SB3's DQN training with it (a short run: no learning asserted).
SB3's own buffer tests, run on these classes, are tests/test_sb3_buffers.py."""
from __future__ import annotations

import pickle
import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from stable_baselines3 import DQN
from stable_baselines3.common.buffers import DictReplayBuffer, NStepReplayBuffer, ReplayBuffer
from stable_baselines3.common.type_aliases import DictReplayBufferSamples

import gear_mpi as gm
from gear_mpi.integrations import sb3 as gsb3

OBS = spaces.Box(-10, 10, (3,), np.float32)
SPACES = {"discrete": spaces.Discrete(4), "box64": spaces.Box(-1, 1, (2,), np.float64)}
STORAGE = ("observations", "actions", "rewards", "dones", "timeouts")
#: a Dict observation space of the kinds SB3's DictReplayBuffer stores: a vector, a Discrete cell, a small image
DICT_OBS = spaces.Dict({"pos": spaces.Box(-1, 1, (2,), np.float32), "cell": spaces.Discrete(5),
                        "img": spaces.Box(0, 255, (3, 4), np.uint8)})


@pytest.fixture(autouse=True)
def sb3_logs_in_tmp(tmp_path, monkeypatch):
    """SB3's logger makes a folder for every ``learn`` (``$SB3_LOGDIR``, else ``/tmp/SB3-<date>``, left
    behind): here it goes under the test's own temporary folder."""
    monkeypatch.setenv("SB3_LOGDIR", str(tmp_path / "sb3_logs"))


def random_steps(n_envs: int, count: int, action_space, seed: int = 0):
    """``count`` adds' arguments: random observations, actions, rewards, dones, time limits."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        obs = rng.standard_normal((n_envs, 3)).astype(np.float32)
        next_obs = rng.standard_normal((n_envs, 3))  # float64: cast to the space's float32, as SB3 casts
        action = np.array([action_space.sample() for _ in range(n_envs)])
        reward = rng.standard_normal(n_envs)
        done = rng.random(n_envs) < 0.2
        infos = [{"TimeLimit.truncated": bool(t)} for t in rng.random(n_envs) < 0.3]
        yield obs, next_obs, action, reward, done, infos


def assert_same_storage(ours, theirs, where: str = "") -> None:
    names = STORAGE + (() if theirs.optimize_memory_usage else ("next_observations",))
    for name in names:
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (where, name, a.dtype, b.dtype, a.shape, b.shape)
        np.testing.assert_array_equal(a, b, err_msg=f"{where} {name}")
    assert (ours.pos, ours.full, ours.size()) == (theirs.pos, theirs.full, theirs.size()), where


@pytest.mark.parametrize("cls", [gsb3.GearReplayBuffer, gsb3.GearPrioritizedReplayBuffer])
@pytest.mark.parametrize("n_envs,optimize", [(1, False), (3, False), (2, True)])
@pytest.mark.parametrize("space", list(SPACES))
def test_storage_equals_sb3s_after_every_add(cls, n_envs, optimize, space):
    kw = dict(n_envs=n_envs, optimize_memory_usage=optimize, handle_timeout_termination=not optimize, device="cpu")
    theirs = ReplayBuffer(21, OBS, SPACES[space], **kw)
    ours = cls(21, OBS, SPACES[space], **kw)
    for t, step in enumerate(random_steps(n_envs, 45, SPACES[space])):  # past full twice: FIFO overwrite
        theirs.add(*step)
        ours.add(*step)
        assert_same_storage(ours, theirs, f"add {t}")
    assert len(ours.shard) == (ours.buffer_size - optimize) * n_envs


def held_transitions(buf: ReplayBuffer) -> set[tuple]:
    """Every transition SB3's sampling may return from ``buf``: (obs, action, next_obs, done, reward) as bytes."""
    positions = range(buf.buffer_size) if buf.full else range(buf.pos)
    out = set()
    for p in positions:
        if buf.optimize_memory_usage and buf.full and p == buf.pos:
            continue  # SB3 never samples it
        for e in range(buf.n_envs):
            nxt = buf.observations[(p + 1) % buf.buffer_size, e] if buf.optimize_memory_usage \
                else buf.next_observations[p, e]
            done = buf.dones[p, e] * (1 - buf.timeouts[p, e]) if buf.handle_timeout_termination else buf.dones[p, e]
            out.add((buf.observations[p, e].tobytes(), buf.actions[p, e].tobytes(), nxt.tobytes(),
                     np.float32(done).tobytes(), np.float32(buf.rewards[p, e]).tobytes()))
    return out


@pytest.mark.parametrize("n_envs,optimize,adds", [(1, False, 7), (2, False, 40), (2, True, 9), (3, True, 40)])
def test_samples_are_what_sb3_could_draw_and_cover_it_uniformly(n_envs, optimize, adds):
    kw = dict(n_envs=n_envs, optimize_memory_usage=optimize, handle_timeout_termination=not optimize, device="cpu")
    theirs = ReplayBuffer(24, OBS, SPACES["discrete"], **kw)
    ours = gsb3.GearReplayBuffer(24, OBS, SPACES["discrete"], seed=4, **kw)
    for step in random_steps(n_envs, adds, SPACES["discrete"], seed=adds):
        theirs.add(*step)
        ours.add(*step)
    held = held_transitions(theirs)
    s = ours.sample(12000)
    assert s.observations.shape == (12000, 3) and s.actions.shape == (12000, 1) and s.dones.shape == (12000, 1)
    rows = [(o.tobytes(), a.tobytes(), n.tobytes(), d.tobytes(), r.tobytes()) for o, a, n, d, r in
            zip(s.observations.numpy(), s.actions.numpy(), s.next_observations.numpy(), s.dones.numpy()[:, 0],
                s.rewards.numpy()[:, 0])]
    assert set(rows) == held  # every held transition drawn, nothing else
    counts = np.unique(np.array([hash(r) for r in rows]), return_counts=True)[1]
    expected = 12000 / len(held)
    assert abs(counts - expected).max() < 5 * np.sqrt(expected)  # uniform (about 5 sigma)


def test_dones_cut_by_time_limits_are_sampled_as_not_done():
    ours = gsb3.GearReplayBuffer(10, OBS, SPACES["discrete"], device="cpu")
    obs = np.zeros((1, 3), np.float32)
    ours.add(obs, obs, np.array([0]), np.array([1.0]), np.array([True]), [{"TimeLimit.truncated": True}])
    assert ours.sample(20).dones.sum() == 0
    plain = gsb3.GearReplayBuffer(10, OBS, SPACES["discrete"], device="cpu", handle_timeout_termination=False)
    plain.add(obs, obs, np.array([0]), np.array([1.0]), np.array([True]), [{"TimeLimit.truncated": True}])
    assert plain.sample(20).dones.sum() == 20 and plain.timeouts.sum() == 0


def test_samples_are_new_tensors_and_follow_the_device():
    ours = gsb3.GearReplayBuffer(10, OBS, SPACES["discrete"], device="cpu")
    for step in random_steps(1, 5, SPACES["discrete"]):
        ours.add(*step)
    a = ours.sample(8)
    before = a.observations.clone()
    ours.sample(8)
    ours.observations[:] = 0  # the storage views write the ring; earlier samples keep their values
    assert th.equal(a.observations, before)
    assert all(t.device.type == "cpu" for t in a[:5])


def test_empty_buffer_raises_and_bad_options_are_refused():
    ours = gsb3.GearReplayBuffer(10, OBS, SPACES["discrete"], device="cpu")
    with pytest.raises(gm.EmptyReplayError):
        ours.sample(4)
    with pytest.raises(ValueError, match="simultaneously"):
        gsb3.GearReplayBuffer(10, OBS, SPACES["discrete"], optimize_memory_usage=True)
    with pytest.raises(ValueError, match="at least 2 positions"):
        gsb3.GearReplayBuffer(1, OBS, SPACES["discrete"], optimize_memory_usage=True,
                              handle_timeout_termination=False)
    with pytest.raises(ValueError, match="optimize_memory_usage is not supported with a Dict"):
        gsb3.GearReplayBuffer(10, DICT_OBS, SPACES["discrete"], optimize_memory_usage=True,
                              handle_timeout_termination=False)
    with pytest.raises(NotImplementedError, match="observation key 'inner' is a Dict space"):
        gsb3.GearReplayBuffer(10, spaces.Dict({"a": OBS, "inner": spaces.Dict({"b": OBS})}), SPACES["discrete"])
    with pytest.raises(ValueError, match="at least one key"):
        gsb3.GearReplayBuffer(10, spaces.Dict({}), SPACES["discrete"])
    with pytest.raises(ValueError):
        gsb3.GearPrioritizedReplayBuffer(10, OBS, SPACES["discrete"], alpha=-1.0)
    # named, not a message about the shard's capacity_steps (59.5, nan) or an operator's TypeError
    for kw, what in (({"buffer_size": 8.5}, "buffer_size"), ({"buffer_size": "8"}, "buffer_size"),
                     ({"buffer_size": None}, "buffer_size"), ({"buffer_size": float("inf")}, "buffer_size"),
                     ({"n_envs": 0}, "n_envs"), ({"n_envs": 2.0}, "n_envs"), ({"seed": 1.5}, "seed")):
        for cls in (gsb3.GearReplayBuffer, gsb3.GearPrioritizedReplayBuffer):
            with pytest.raises(ValueError, match=f"^{what} must be an integer in"):
                cls(**({"buffer_size": 10} | kw), observation_space=OBS, action_space=SPACES["discrete"], device="cpu")


@pytest.mark.parametrize("cls", [gsb3.GearReplayBuffer, gsb3.GearPrioritizedReplayBuffer])
@pytest.mark.parametrize("optimize", [False, True])
def test_pickle_and_reset_keep_sb3s_semantics(cls, optimize):
    kw = dict(n_envs=2, optimize_memory_usage=optimize, handle_timeout_termination=not optimize, device="cpu")
    theirs = ReplayBuffer(16, OBS, SPACES["discrete"], **kw)
    ours = cls(16, OBS, SPACES["discrete"], seed=9, **kw)
    steps = list(random_steps(2, 30, SPACES["discrete"]))
    for step in steps[:13]:
        theirs.add(*step)
        ours.add(*step)
    back = pickle.loads(pickle.dumps(ours))  # what SB3's save_replay_buffer / load_replay_buffer do
    assert_same_storage(back, theirs, "unpickled")
    a, b = ours.sample(32), back.sample(32)  # the same stream: the same draws
    assert all(th.equal(x, y) for x, y in zip(a[:5], b[:5]))
    for step in steps[13:]:
        for buf in (theirs, ours, back):
            buf.add(*step)
    assert_same_storage(back, theirs, "unpickled, then added to")
    ours.reset()
    theirs.reset()
    assert len(ours.shard) == 0 and ours.size() == 0
    with pytest.raises(gm.EmptyReplayError):
        ours.sample(2)
    for step in steps[:3]:
        theirs.add(*step)
        ours.add(*step)
    assert len(held_transitions(theirs)) == 6  # 3 positions of 2 environments, not full
    s = ours.sample(400)
    assert len(set(s.observations.numpy()[:, 0].tolist())) == 6  # only what came after reset


def test_prioritized_draws_follow_priorities_and_weights_correct_for_them():
    ours = gsb3.GearPrioritizedReplayBuffer(8, OBS, SPACES["discrete"], alpha=1.0, beta=1.0, device="cpu", seed=2)
    for i in range(4):
        o = np.full((1, 3), i, np.float32)
        ours.add(o, o, np.array([0]), np.array([0.0]), np.array([False]), [{}])
    s = ours.sample(8)
    assert s.weights.shape == (8, 1) and s.keys.shape == (8,) and np.allclose(s.weights.numpy(), 1.0)
    first = {int(o): int(k) for o, k in zip(s.observations.numpy()[:, 0], s.keys)}
    keys = np.array([first.get(i, -1) for i in range(4)])
    assert (keys >= 0).all()  # 8 draws among 4 equal items: all seen (seeded)
    assert ours.update_priorities(keys, np.array([1.0, 1.0, 1.0, 9.0])) == 4
    assert ours.max_priority == 9.0
    s = ours.sample(12000)
    freq = np.bincount(s.observations.numpy()[:, 0].astype(int), minlength=4) / 12000
    np.testing.assert_allclose(freq, [1 / 12, 1 / 12, 1 / 12, 9 / 12], atol=0.02)
    w = dict(zip(s.observations.numpy()[:, 0].astype(int), s.weights.numpy()[:, 0]))
    np.testing.assert_allclose([w[0], w[3]], [1.0, 1 / 9], rtol=1e-6)  # (min P / P)^beta
    ours.beta = 0.5
    w = dict(zip(*(lambda s: (s.observations.numpy()[:, 0].astype(int), s.weights.numpy()[:, 0]))(ours.sample(64))))
    np.testing.assert_allclose(w[3], (1 / 9) ** 0.5, rtol=1e-6)
    o = np.full((1, 3), 7, np.float32)
    ours.add(o, o, np.array([0]), np.array([0.0]), np.array([False]), [{}])  # enters at the largest priority: 9
    freq = np.bincount(ours.sample(12000).observations.numpy()[:, 0].astype(int), minlength=8)[[3, 7]] / 12000
    np.testing.assert_allclose(freq, [9 / 21, 9 / 21], atol=0.02)
    with pytest.raises(gm.InvalidPriorityError):
        ours.update_priorities(keys[:1], [-1.0])
    with pytest.raises(ValueError):
        ours.beta = -0.5


class MirroredBuffer(gsb3.GearReplayBuffer):
    """A GearReplayBuffer that hands every add to an SB3 ReplayBuffer too: the same transitions in both."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mirror = ReplayBuffer(*args, **kwargs)

    def add(self, *args, **kwargs):
        self.mirror.add(*args, **kwargs)
        super().add(*args, **kwargs)


@pytest.mark.parametrize("n_envs", [1, 2])
def test_sb3_dqn_trains_with_it_and_it_holds_what_sb3s_buffer_holds(n_envs):
    from stable_baselines3.common.env_util import make_vec_env
    env = make_vec_env("CartPole-v1", n_envs=n_envs, seed=0)
    model = DQN("MlpPolicy", env, buffer_size=1500, learning_starts=200, batch_size=32, train_freq=8,
                gradient_steps=2, target_update_interval=100, replay_buffer_class=MirroredBuffer,
                policy_kwargs=dict(net_arch=[32]), seed=0, device="cpu")
    model.learn(total_timesteps=2400)  # wraps the buffer: FIFO overwrite under training
    buf = model.replay_buffer
    assert isinstance(buf, gsb3.GearReplayBuffer) and buf.full and model._n_updates > 0
    assert_same_storage(buf, buf.mirror, "after DQN.learn")
    assert len(buf.shard) == 1500 // n_envs * n_envs


def test_prioritized_dqn_trains_and_updates_priorities():
    model = gsb3.PrioritizedDQN("MlpPolicy", "CartPole-v1", buffer_size=1000, learning_starts=100, batch_size=32,
                                train_freq=8, gradient_steps=2, replay_buffer_kwargs=dict(alpha=0.6, beta=0.4),
                                policy_kwargs=dict(net_arch=[32]), seed=1, device="cpu")
    model.learn(total_timesteps=600)
    buf = model.replay_buffer
    assert isinstance(buf, gsb3.GearPrioritizedReplayBuffer) and model._n_updates > 0
    live = buf.shard.live_keys()
    assert len(np.unique(buf.shard.priorities(live))) > 10  # TD errors, not the initial 1
    assert 0.4 < buf.beta <= 1.0  # annealed towards 1


def test_prioritized_update_of_the_samples_keys_goes_through_the_sorted_draw(monkeypatch):
    """The samples' ``keys`` are the batch's own keys array, which the shard knows (weakly) after the sample
    although the batch object is gone: ``update_priorities(samples.keys, ...)`` goes through the sample's sorted
    draw (one kernel, no key lookups) and leaves what a buffer taking the general path leaves."""
    from gear_mpi.kernels import priority_sampled
    seen = []
    real = priority_sampled.update_sampled
    monkeypatch.setattr(priority_sampled, "update_sampled", lambda *a: seen.append(1) or real(*a))
    fast, slow = (gsb3.GearPrioritizedReplayBuffer(256, OBS, SPACES["discrete"], device="cpu", seed=4) for _ in "ab")
    rng = np.random.default_rng(0)
    for _ in range(200):
        o = rng.standard_normal((1, 3)).astype(np.float32)
        for buf in (fast, slow):
            buf.add(o, o, np.array([1]), np.array([0.5]), np.array([False]), [{}])
    for step in range(4):
        a, b = fast.sample(32), slow.sample(32)
        np.testing.assert_array_equal(a.observations.numpy(), b.observations.numpy())  # (keys: their own tags)
        new = rng.random(32) + 0.1
        calls = len(seen)
        assert fast.update_priorities(a.keys, new) == slow.update_priorities(b.keys.copy(), new)
        assert len(seen) == calls + 1  # the fast buffer's update took the sorted draw; the copy's did not
    np.testing.assert_array_equal(fast.shard.index.leaves, slow.shard.index.leaves)
    fast.close()
    slow.close()


# ---- Dict observation spaces: SB3's DictReplayBuffer as the reference -------------------------------------
def random_dict_steps(n_envs: int, count: int, seed: int = 0):
    """``count`` adds' arguments for :data:`DICT_OBS`: dict observations (fresh dicts, since SB3's buffer
    reshapes a Discrete key's array in the caller's dict), actions, rewards, dones, time limits."""
    rng = np.random.default_rng(seed)
    def observation():
        return {"pos": rng.uniform(-1, 1, (n_envs, 2)), "cell": rng.integers(0, 5, n_envs),
                "img": rng.integers(0, 256, (n_envs, 3, 4)).astype(np.uint8)}
    for _ in range(count):
        yield (observation(), observation(), rng.integers(0, 4, n_envs), rng.standard_normal(n_envs),
               rng.random(n_envs) < 0.2, [{"TimeLimit.truncated": bool(t)} for t in rng.random(n_envs) < 0.3])


def copied(step):
    """An add's arguments with its dicts copied (SB3's buffer changes them)."""
    return tuple({k: v.copy() for k, v in a.items()} if isinstance(a, dict) else a for a in step)


def assert_same_dict_storage(ours, theirs, where: str = "") -> None:
    for name in ("observations", "next_observations"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert list(a) == list(b), (where, name, list(a), list(b))
        for key in b:
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, (where, name, key)
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{where} {name}[{key!r}]")
    for name in STORAGE[1:]:
        np.testing.assert_array_equal(getattr(ours, name), getattr(theirs, name), err_msg=f"{where} {name}")
    assert (ours.pos, ours.full, ours.size()) == (theirs.pos, theirs.full, theirs.size()), where


@pytest.mark.parametrize("cls", [gsb3.GearReplayBuffer, gsb3.GearPrioritizedReplayBuffer])
@pytest.mark.parametrize("n_envs", [1, 3])
def test_dict_storage_equals_sb3s_after_every_add(cls, n_envs):
    theirs = DictReplayBuffer(21, DICT_OBS, SPACES["discrete"], n_envs=n_envs, device="cpu")
    ours = cls(21, DICT_OBS, SPACES["discrete"], n_envs=n_envs, device="cpu")
    for t, step in enumerate(random_dict_steps(n_envs, 45)):  # past full twice: FIFO overwrite
        theirs.add(*copied(step))
        ours.add(*step)
        assert_same_dict_storage(ours, theirs, f"add {t}")
    assert len(ours.shard) == ours.buffer_size * n_envs
    assert sorted(ours.shard.spec.names) == sorted(["action", "done", "reward", "timeout"] +
                                                   [f"{p}/{k}" for p in ("obs", "next_obs") for k in DICT_OBS.spaces])


def test_dict_samples_are_what_sb3_could_draw_and_cover_it_uniformly():
    theirs = DictReplayBuffer(24, DICT_OBS, SPACES["discrete"], n_envs=2, device="cpu")
    ours = gsb3.GearReplayBuffer(24, DICT_OBS, SPACES["discrete"], n_envs=2, seed=5, device="cpu")
    for step in random_dict_steps(2, 31, seed=3):  # 62 transitions into 48: overwritten ones gone
        theirs.add(*copied(step))
        ours.add(*step)
    held = set()
    for p in range(theirs.buffer_size):
        for e in range(2):
            done = theirs.dones[p, e] * (1 - theirs.timeouts[p, e])
            held.add(tuple(theirs.observations[k][p, e].tobytes() for k in DICT_OBS.spaces)
                     + tuple(theirs.next_observations[k][p, e].tobytes() for k in DICT_OBS.spaces)
                     + (theirs.actions[p, e].tobytes(), np.float32(done).tobytes(),
                        np.float32(theirs.rewards[p, e]).tobytes()))
    s = ours.sample(12000)
    assert isinstance(s, DictReplayBufferSamples) and list(s.observations) == list(DICT_OBS.spaces)
    assert s.observations["img"].shape == (12000, 3, 4) and s.observations["img"].dtype == th.uint8
    assert s.observations["cell"].shape == (12000, 1) and s.next_observations["pos"].shape == (12000, 2)
    obs = {k: v.numpy() for k, v in s.observations.items()}
    nxt = {k: v.numpy() for k, v in s.next_observations.items()}
    rows = [tuple(obs[k][i].tobytes() for k in DICT_OBS.spaces) + tuple(nxt[k][i].tobytes() for k in DICT_OBS.spaces)
            + (s.actions.numpy()[i].tobytes(), s.dones.numpy()[i, 0].tobytes(), s.rewards.numpy()[i, 0].tobytes())
            for i in range(12000)]
    assert set(rows) == held  # every held transition drawn, nothing else (observations matched key by key)
    counts = np.unique(np.array([hash(r) for r in rows]), return_counts=True)[1]
    expected = 12000 / len(held)
    assert abs(counts - expected).max() < 5 * np.sqrt(expected)  # uniform (about 5 sigma)


def test_dict_adds_with_a_missing_key_change_nothing_and_pickling_keeps_the_buffer():
    ours = gsb3.GearPrioritizedReplayBuffer(16, DICT_OBS, SPACES["discrete"], n_envs=2, seed=9, device="cpu")
    theirs = DictReplayBuffer(16, DICT_OBS, SPACES["discrete"], n_envs=2, device="cpu")
    steps = list(random_dict_steps(2, 20, seed=7))
    for step in steps[:5]:
        theirs.add(*copied(step))
        ours.add(*step)
    obs, next_obs, *rest = steps[5]
    with pytest.raises(KeyError, match="next_obs has no 'img'"):
        ours.add(obs, {k: v for k, v in next_obs.items() if k != "img"}, *rest)
    with pytest.raises(TypeError, match="obs must be a dict of arrays"):
        ours.add(obs["pos"], next_obs, *rest)
    assert_same_dict_storage(ours, theirs, "after the refused add")  # nothing of it kept
    back = pickle.loads(pickle.dumps(ours))  # what SB3's save_replay_buffer / load_replay_buffer do
    assert_same_dict_storage(back, theirs, "unpickled")
    a, b = ours.sample(32), back.sample(32)  # the same stream: the same draws
    assert all(th.equal(a.observations[k], b.observations[k]) for k in DICT_OBS.spaces)
    np.testing.assert_array_equal(a.weights.numpy(), b.weights.numpy())
    new = np.array([1.0, 2.0, 3.0, 4.0])
    assert ours.update_priorities(a.keys[:4], new) == 4 == back.update_priorities(b.keys[:4], new)
    a, b = ours.sample(32), back.sample(32)  # the same priorities in both: the same draws and weights again
    assert all(th.equal(a.next_observations[k], b.next_observations[k]) for k in DICT_OBS.spaces)
    np.testing.assert_array_equal(a.weights.numpy(), b.weights.numpy())
    assert not np.allclose(a.weights.numpy(), 1.0)  # the new priorities are in the weights
    for step in steps[5:]:
        theirs.add(*copied(step))
        back.add(*step)
    assert_same_dict_storage(back, theirs, "unpickled, then added to")
    back.reset()
    assert len(back.shard) == 0 and back.size() == 0
    with pytest.raises(gm.EmptyReplayError):
        back.sample(2)


class MirroredDictBuffer(gsb3.GearReplayBuffer):
    """A GearReplayBuffer on a Dict space that hands every add to an SB3 DictReplayBuffer too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mirror = DictReplayBuffer(*args, **kwargs)

    def add(self, *args, **kwargs):
        self.mirror.add(*copied(args), **kwargs)
        super().add(*args, **kwargs)


def test_sb3_multi_input_dqn_trains_with_it_and_it_holds_what_sb3s_dict_buffer_holds():
    """SB3's DQN with ``MultiInputPolicy`` (a CNN for the image, an MLP for the vector) on SB3's own Dict
    environment, ``SimpleMultiObsEnv`` (a 4x4 grid, a 64x64 image and a 5-vector per observation), with the
    buffer wrapping around under training; and PrioritizedDQN on the same environment."""
    from stable_baselines3.common.envs import SimpleMultiObsEnv
    model = DQN("MultiInputPolicy", SimpleMultiObsEnv(random_start=False), buffer_size=300, learning_starts=100,
                batch_size=16, train_freq=8, gradient_steps=1, target_update_interval=100,
                replay_buffer_class=MirroredDictBuffer, seed=0, device="cpu")
    model.learn(total_timesteps=500)
    buf = model.replay_buffer
    assert isinstance(buf, gsb3.GearReplayBuffer) and buf.full and model._n_updates > 0
    assert_same_dict_storage(buf, buf.mirror, "after DQN.learn")
    model = gsb3.PrioritizedDQN("MultiInputPolicy", SimpleMultiObsEnv(random_start=False), buffer_size=300,
                                learning_starts=100, batch_size=16, train_freq=8, gradient_steps=1, seed=1,
                                device="cpu")
    model.learn(total_timesteps=300)
    buf = model.replay_buffer
    assert isinstance(buf, gsb3.GearPrioritizedReplayBuffer) and model._n_updates > 0
    assert len(np.unique(buf.shard.priorities(buf.shard.live_keys()))) > 5  # TD errors, not the initial 1


# ---- n-step returns: SB3's NStepReplayBuffer as the reference ------------------------------------------------
class TinyEnv(gym.Env):
    """A one-step environment with :data:`OBS` observations, for a VecNormalize whose statistics are set by hand."""

    observation_space, action_space = OBS, SPACES["discrete"]

    def reset(self, *, seed=None, options=None):
        return np.zeros(3, np.float32), {}

    def step(self, action):
        return np.zeros(3, np.float32), 0.0, True, False, {}


def normalizer():
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize
    env = VecNormalize(DummyVecEnv([TinyEnv]), gamma=0.9)
    env.obs_rms.mean, env.obs_rms.var = np.array([0.5, -0.25, 1.0]), np.array([2.0, 0.5, 4.0])
    env.ret_rms.var = np.array(3.0)
    return env


@pytest.mark.parametrize("n_envs,adds,timeouts,n_steps", [(1, 9, True, 3), (1, 40, True, 5), (2, 17, False, 3),
                                                         (3, 40, True, 4)])
@pytest.mark.parametrize("normalize", [False, True])
def test_n_step_samples_equal_sb3s_n_step_buffer(n_envs, adds, timeouts, n_steps, normalize, monkeypatch):
    """Each drawn transition's n-step return, bootstrap discount, next observation and done flag equal, bit for
    bit, what SB3's NStepReplayBuffer computes for the same position and environment (its environment draw set
    to ours): before the buffer is full (sequences stop at the newest step) and after it wrapped, with and
    without time limits, with and without a VecNormalize."""
    from stable_baselines3.common import buffers as sb3_buffers
    kw = dict(n_envs=n_envs, handle_timeout_termination=timeouts, device="cpu")
    theirs = NStepReplayBuffer(24, OBS, SPACES["discrete"], n_steps=n_steps, gamma=0.9, **kw)
    # alpha 0: a uniform draw whose samples carry their keys, which say where each transition lies
    ours = gsb3.GearPrioritizedReplayBuffer(24, OBS, SPACES["discrete"], n_steps=n_steps, gamma=0.9, alpha=0.0,
                                            seed=adds, **kw)
    for step in random_steps(n_envs, adds, SPACES["discrete"], seed=adds):
        theirs.add(*step)
        ours.add(*step)
    env = normalizer() if normalize else None
    s = ours.sample(3000, env)
    start, _ = ours.shard.locate(s.keys)
    positions, envs = np.divmod(start, n_envs)
    monkeypatch.setattr(sb3_buffers.np.random, "randint", lambda *a, **k: envs.copy())  # SB3's environment draw
    ref = theirs._get_samples(positions, env)
    assert s.discounts.shape == (3000, 1) and s.discounts.dtype == th.float32
    for name in ("observations", "actions", "next_observations", "dones", "rewards", "discounts"):
        a, b = getattr(s, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert th.equal(a, b), name
    assert (s.discounts < 0.9 ** n_steps + 1e-6).sum() > 0  # some sequences ran their full length
    assert (s.discounts > 0.9 ** n_steps + 1e-6).sum() > 0  # and some stopped early


def test_n_step_buffers_refuse_what_sb3s_refuses():
    with pytest.raises(NotImplementedError, match="optimize_memory_usage"):
        gsb3.GearReplayBuffer(10, OBS, SPACES["discrete"], optimize_memory_usage=True,
                              handle_timeout_termination=False, n_steps=3)
    for kw, what in (({"n_steps": 0}, "n_steps must be an integer"), ({"n_steps": 2.0}, "n_steps must be an integer"),
                     ({"gamma": 1.5}, "gamma must be a number in"), ({"gamma": "0.9"}, "gamma must be a number in")):
        with pytest.raises(ValueError, match=what):
            gsb3.GearReplayBuffer(10, OBS, SPACES["discrete"], **kw)


def test_n_step_samples_of_a_dict_space_are_the_array_cases_key_by_key():
    """SB3 has no n-step buffer for Dict spaces; here a Dict space's n-step samples equal, key by key and bit for
    bit, those of array-space buffers holding each key's values (the same draws: the same seed and adds)."""
    space = spaces.Dict({"a": OBS, "b": spaces.Box(0, 255, (2, 2), np.uint8)})
    kw = dict(n_envs=2, n_steps=4, gamma=0.95, device="cpu", seed=6)
    ours = gsb3.GearReplayBuffer(30, space, SPACES["discrete"], **kw)
    per_key = {k: gsb3.GearReplayBuffer(30, space[k], SPACES["discrete"], **kw) for k in ("a", "b")}
    rng = np.random.default_rng(8)
    for step in random_steps(2, 41, SPACES["discrete"], seed=8):
        obs, next_obs = ({"a": o.astype(np.float32), "b": rng.integers(0, 256, (2, 2, 2)).astype(np.uint8)}
                         for o in step[:2])
        ours.add(obs, next_obs, *step[2:])
        for k, buf in per_key.items():
            buf.add(obs[k], next_obs[k], *step[2:])
    s = ours.sample(500)
    assert isinstance(s, DictReplayBufferSamples) and s.discounts.shape == (500, 1)
    for k, buf in per_key.items():
        ref = buf.sample(500)
        assert th.equal(s.observations[k], ref.observations) and th.equal(s.next_observations[k],
                                                                          ref.next_observations), k
        for name in ("actions", "dones", "rewards", "discounts"):
            assert th.equal(getattr(s, name), getattr(ref, name)), (k, name)
    assert (s.discounts.numpy() > 0.95 ** 4 + 1e-6).any()  # some sequences stopped early


class MirroredNStepBuffer(gsb3.GearReplayBuffer):
    """A GearReplayBuffer with n-step returns that hands every add to SB3's NStepReplayBuffer too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        kwargs.pop("seed", None)
        self.mirror = NStepReplayBuffer(*args, **kwargs)

    def add(self, *args, **kwargs):
        self.mirror.add(*args, **kwargs)
        super().add(*args, **kwargs)


def test_sb3_dqn_with_n_step_returns_trains_with_it():
    """DQN with 3-step returns through ``replay_buffer_kwargs`` (how SB3 asks a custom buffer class for them),
    and PrioritizedDQN, whose targets then bootstrap with the samples' discounts."""
    model = DQN("MlpPolicy", "CartPole-v1", buffer_size=800, learning_starts=200, batch_size=32, train_freq=8,
                gradient_steps=2, target_update_interval=100, replay_buffer_class=MirroredNStepBuffer,
                replay_buffer_kwargs={"n_steps": 3, "gamma": 0.98}, policy_kwargs=dict(net_arch=[32]), seed=0,
                device="cpu")
    model.learn(total_timesteps=1200)
    buf = model.replay_buffer
    assert isinstance(buf, gsb3.GearReplayBuffer) and buf.full and model._n_updates > 0
    assert (buf.n_steps, buf.gamma) == (3, 0.98)
    assert_same_storage(buf, buf.mirror, "after DQN.learn")
    s = buf.sample(256)
    distance = np.abs(s.discounts.numpy() - np.array([0.98 ** k for k in (1, 2, 3)], np.float32)).min(axis=1)
    assert distance.max() < 1e-6, s.discounts  # gamma ** steps, 1 to 3 steps
    model = gsb3.PrioritizedDQN("MlpPolicy", "CartPole-v1", buffer_size=800, learning_starts=100, batch_size=32,
                                train_freq=8, gradient_steps=2, replay_buffer_kwargs=dict(n_steps=3, gamma=0.99),
                                policy_kwargs=dict(net_arch=[32]), seed=1, device="cpu")
    model.learn(total_timesteps=500)
    buf = model.replay_buffer
    assert buf.n_steps == 3 and model._n_updates > 0
    assert len(np.unique(buf.shard.priorities(buf.shard.live_keys()))) > 10


# ---- hindsight experience replay: SB3's HerReplayBuffer as the reference -----------------------------------
def bit_flipping(n_envs: int, n_bits: int = 4):
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.envs import BitFlippingEnv
    return make_vec_env(lambda: BitFlippingEnv(n_bits=n_bits, continuous=False), n_envs, seed=0)


def her_steps(env, count: int, seed: int = 0):
    """``count`` adds' arguments from a VecEnv, with each finished episode's true last observation as SB3's
    off-policy loop stores it (``infos[i]["terminal_observation"]``)."""
    rng = np.random.default_rng(seed)
    obs = env.reset()
    for _ in range(count):
        action = rng.integers(0, env.action_space.n, env.num_envs)
        new_obs, reward, done, infos = env.step(action)
        nxt = {k: v.copy() for k, v in new_obs.items()}
        for i in np.flatnonzero(done):
            for k in nxt:
                nxt[k][i] = infos[i]["terminal_observation"][k]
        yield obs, nxt, action, reward, done, infos
        obs = new_obs


@pytest.mark.parametrize("n_envs", [1, 2])
def test_her_bookkeeping_equals_sb3s_and_only_ended_episodes_are_drawn(n_envs):
    from stable_baselines3 import HerReplayBuffer
    from gear_mpi.integrations.sb3_her import GearHerReplayBuffer
    env = bit_flipping(n_envs)
    theirs = HerReplayBuffer(40, env.observation_space, env.action_space, env, n_envs=n_envs, device="cpu")
    ours = GearHerReplayBuffer(40, env.observation_space, env.action_space, env, n_envs=n_envs, device="cpu", seed=1)
    assert isinstance(ours, HerReplayBuffer)  # what SB3 checks before handing it the environment
    with pytest.raises(RuntimeError, match="before the end of the first episode"):
        ours.sample(4)
    for t, step in enumerate(her_steps(env, 90)):  # 40 // n_envs positions: wrapped several times
        theirs.add(*copied(step))
        ours.add(*step)
        np.testing.assert_array_equal(ours.ep_start, theirs.ep_start, err_msg=f"add {t}")
        np.testing.assert_array_equal(ours.ep_length, theirs.ep_length, err_msg=f"add {t}")
        assert_same_dict_storage(ours, theirs, f"add {t}")
        if t % 7 == 6 and (theirs.ep_length > 0).any():
            s = ours.sample(64)  # brings the priorities up to date first
            live = ours.shard.live_keys()
            start, _ = ours.shard.locate(live)
            drawable = ours.shard.priorities(live) > 0
            np.testing.assert_array_equal(drawable, theirs.ep_length.reshape(-1)[start] > 0, err_msg=f"add {t}")
            assert s.rewards.shape == (64, 1) and s.observations["observation"].shape == (64, 4)


@pytest.mark.parametrize("strategy", ["future", "final", "episode"])
def test_her_samples_are_sb3s_real_and_virtual_transitions(strategy):
    """Real rows are held transitions of ended episodes, drawn uniformly; virtual rows (the last
    ``int(her_ratio * B)``, as SB3 orders them) are held transitions whose desired goal is an achieved goal of
    the same episode, chosen by the strategy, rewarded by the environment's ``compute_reward``."""
    from gear_mpi.integrations.sb3_her import GearHerReplayBuffer
    env = bit_flipping(2)
    buf = GearHerReplayBuffer(60, env.observation_space, env.action_space, env, n_envs=2, n_sampled_goal=3,
                              goal_selection_strategy=strategy, device="cpu", seed=2)
    for step in her_steps(env, 47, seed=3):
        buf.add(*step)
    obs, nxt = buf.observations, buf.next_observations
    episodes = {}  # (position, env) -> the episode's positions, for transitions of ended episodes
    for p, e in zip(*np.nonzero(buf.ep_length > 0)):
        episodes[(p, e)] = list((buf.ep_start[p, e] + np.arange(buf.ep_length[p, e])) % buf.buffer_size)

    def content(o, a, n, keys=("achieved_goal", "desired_goal", "observation")):  # a transition as bytes
        return b"".join(o[k].tobytes() for k in keys) + a.tobytes() + b"".join(n[k].tobytes() for k in keys)

    held, held_but_goal = {}, {}  # a transition of an ended episode (with / without its desired goal) -> where
    for p, e in episodes:
        oo, nn = {k: v[p, e] for k, v in obs.items()}, {k: v[p, e] for k, v in nxt.items()}
        held.setdefault(content(oo, buf.actions[p, e], nn), []).append((p, e))
        without_goal = content(oo, buf.actions[p, e], nn, ("achieved_goal", "observation"))
        held_but_goal.setdefault(without_goal, []).append((p, e))
    np.random.seed(0)
    s = buf.sample(4000)
    n_virtual = int(0.75 * 4000)
    o = {k: v.numpy() for k, v in s.observations.items()}
    n = {k: v.numpy() for k, v in s.next_observations.items()}
    actions, reward = s.actions.numpy(), s.rewards.numpy()[:, 0]
    real_counts = {}
    for i in range(4000 - n_virtual):  # real rows: held transitions of ended episodes, goal and reward as stored
        c = content({k: v[i] for k, v in o.items()}, actions[i], {k: v[i] for k, v in n.items()})
        assert c in held, f"real row {i} is no held transition of an ended episode"
        assert any(buf.rewards[p, e] == reward[i] for p, e in held[c]), i
        real_counts[c] = real_counts.get(c, 0) + 1
    for i in range(4000 - n_virtual, 4000):  # virtual rows: a new goal, from where the strategy looks
        goal = o["desired_goal"][i]
        assert np.array_equal(goal, n["desired_goal"][i])
        c = content({k: v[i] for k, v in o.items()}, actions[i], {k: v[i] for k, v in n.items()},
                    ("achieved_goal", "observation"))
        assert c in held_but_goal, f"virtual row {i} is no held transition of an ended episode"
        ok = False
        for p, e in held_but_goal[c]:
            positions = episodes[(p, e)]
            allowed = {"final": positions[-1:], "episode": positions,
                       "future": positions[positions.index(p):]}[strategy]
            ok |= any(np.array_equal(nxt["achieved_goal"][q, e], goal) for q in allowed)
        assert ok, f"virtual row {i}: its goal was not achieved where the strategy {strategy!r} looks"
        expected = env.env_method("compute_reward", n["achieved_goal"][i:i + 1], goal[None], [{}], indices=[0])[0]
        assert reward[i] == np.float32(expected[0]), i
    # the real rows cover the ended episodes' transitions uniformly (identical transitions counted together)
    total = len(episodes)
    for c, where in held.items():
        expected = (4000 - n_virtual) * len(where) / total
        assert abs(real_counts.get(c, 0) - expected) < 5 * np.sqrt(expected) + 1, (len(where), real_counts.get(c))


def test_her_arguments_are_checked():
    from gear_mpi.integrations.sb3_her import GearHerReplayBuffer
    env = bit_flipping(1)
    with pytest.raises(ValueError, match="'achieved_goal' and 'desired_goal'"):
        GearHerReplayBuffer(10, DICT_OBS, SPACES["discrete"], env)
    with pytest.raises(ValueError, match="goal_selection_strategy must be one of"):
        GearHerReplayBuffer(10, env.observation_space, env.action_space, env, goal_selection_strategy="later")
    with pytest.raises(ValueError, match="n_sampled_goal must be an integer"):
        GearHerReplayBuffer(10, env.observation_space, env.action_space, env, n_sampled_goal=-1)
    buf = GearHerReplayBuffer(20, env.observation_space, env.action_space, None, device="cpu")
    for step in her_steps(env, 12):
        buf.add(*step)
    with pytest.raises(RuntimeError, match="needs its VecEnv"):
        buf.sample(8)
    buf.set_env(env)
    assert buf.sample(8).rewards.shape == (8, 1)
    assert buf.infos is None  # kept only with copy_info_dict (SB3 keeps an empty dict a transition)
    kept = GearHerReplayBuffer(20, env.observation_space, env.action_space, env, device="cpu", copy_info_dict=True)
    for step in her_steps(env, 12):
        kept.add(*step)
    assert kept.infos.shape == (20, 1) and "TimeLimit.truncated" in kept.infos[0, 0]
    assert kept.sample(8).rewards.shape == (8, 1)
    # adds without samples: the record of drawability changes stays bounded (applied to the shard as it grows)
    for step in her_steps(env, 200, seed=5):
        kept.add(*step)
        assert kept._pending <= 20
    kept.sample(4)  # (staged adds enter the shard first)
    assert (kept.shard.priorities(kept.shard.live_keys()) > 0).sum() == (kept.ep_length > 0).sum()


def test_sb3_her_with_gear_buffer_learns_bit_flipping_and_its_buffer_saves_and_loads(tmp_path):
    """DQN + HER solves 8-bit BitFlippingEnv from 3,000 steps (random play: about 1 in 256 episodes succeed),
    SB3's measure of it (``ep_success_buffer``); then the buffer goes through SB3's save_replay_buffer /
    load_replay_buffer (the last episode truncated, with SB3's warning) and training goes on."""
    from gear_mpi.integrations.sb3_her import GearHerReplayBuffer
    env = bit_flipping(2, n_bits=8)
    model = DQN("MultiInputPolicy", env, replay_buffer_class=GearHerReplayBuffer,
                replay_buffer_kwargs=dict(n_sampled_goal=4, goal_selection_strategy="future"), learning_rate=5e-4,
                train_freq=1, gradient_steps=2, learning_starts=100, exploration_final_eps=0.02,
                target_update_interval=500, batch_size=32, buffer_size=10_000, seed=0, device="cpu")
    model.learn(total_timesteps=3000)
    assert np.mean(model.ep_success_buffer) > 0.9, list(model.ep_success_buffer)
    path = tmp_path / "her.pkl"
    model.save_replay_buffer(path)
    old = model.replay_buffer
    unfinished = (old._current_ep_start != old.pos).any()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_replay_buffer(path, truncate_last_traj=True)
    truncated = [w for w in caught if "last trajectory in the replay buffer will be truncated" in str(w.message)]
    assert len(truncated) == int(unfinished), [str(w.message) for w in caught]
    new = model.replay_buffer
    assert isinstance(new, GearHerReplayBuffer) and new.env is env and new is not old
    for key in ("observation", "achieved_goal", "desired_goal"):
        np.testing.assert_array_equal(new.observations[key], old.observations[key])
    ended = old.ep_length > 0  # ended episodes as they were; the truncated one ended now, and is drawable
    np.testing.assert_array_equal(new.ep_length[ended], old.ep_length[ended])
    assert (new.ep_length > 0).sum() == ended.sum() + (new.ep_length[~ended] > 0).sum()
    if unfinished:
        assert (new.ep_length > 0).sum() > ended.sum()
    model.learn(total_timesteps=200, reset_num_timesteps=False)
    assert model.replay_buffer.sample(16).rewards.shape == (16, 1)


@pytest.mark.parametrize("algo,image", [("SAC", True), ("TD3", False)])
def test_sb3_her_with_continuous_algorithms_and_a_full_buffer(algo, image):
    """SAC (image observations: a CNN over the bit string) and TD3 with GearHerReplayBuffer on the continuous
    BitFlippingEnv; then a buffer of 40 transitions that wraps many times under SAC (its sample must never take an
    unfinished episode's transition: one without a future to take goals from would fail SB3's goal draw)."""
    import stable_baselines3
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.envs import BitFlippingEnv
    from gear_mpi.integrations.sb3_her import GearHerReplayBuffer
    env = make_vec_env(lambda: BitFlippingEnv(n_bits=4, continuous=True, image_obs_space=image), 1, seed=0)
    model = getattr(stable_baselines3, algo)(
        "MultiInputPolicy", env, replay_buffer_class=GearHerReplayBuffer,
        replay_buffer_kwargs=dict(n_sampled_goal=2, goal_selection_strategy="future", copy_info_dict=True),
        train_freq=4, gradient_steps=1, policy_kwargs=dict(net_arch=[64]), learning_starts=100, buffer_size=20_000,
        seed=0, device="cpu")
    model.learn(total_timesteps=150)
    assert isinstance(model.replay_buffer, GearHerReplayBuffer) and model.replay_buffer.size() >= 150
    if algo == "SAC":
        env = make_vec_env(lambda: BitFlippingEnv(n_bits=4, continuous=True), 2, seed=0)
        model = stable_baselines3.SAC("MultiInputPolicy", env, replay_buffer_class=GearHerReplayBuffer,
                                      replay_buffer_kwargs=dict(n_sampled_goal=2), gradient_steps=1, train_freq=4,
                                      policy_kwargs=dict(net_arch=[64]), learning_starts=8, buffer_size=40, seed=757,
                                      device="cpu")
        model.learn(total_timesteps=100)
        buf = model.replay_buffer
        assert buf.full and model._n_updates > 0
        drawable = buf.shard.priorities(buf.shard.live_keys()) > 0
        assert drawable.sum() == (buf.ep_length > 0).sum() < buf.buffer_size * buf.n_envs
