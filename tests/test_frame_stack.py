"""Frames stored once: FrameStack and NextStep columns rebuilt at sample time (gear_mpi.frames).

Every sampled value is compared with a naive numpy reconstruction from the episode's frames; the
padding choices, episode starts, the ring's wrap-around, windows that never cover the final step,
the time-limit truncation case of cleanrl #460, checkpoints and Replay on 2 ranks (shared memory and
forced alltoallv, where context windows travel) are checked.
"""
from __future__ import annotations

import numpy as np
import pytest

import gear_mpi as gm
from mpi_util import run_pytest_mpi

FRAME = (6, 5)


def make_spec(pad: str = "first", frames: int = 4, max_length: int = 40) -> gm.TrajectorySpec:
    return gm.TrajectorySpec({"frame": (FRAME, "uint8"), "t": ((), "int64"), "ep": ((), "int64"),
                              "obs": gm.FrameStack("frame", frames, pad), "next_obs": gm.NextStep("obs")},
                             max_length=max_length)


def episode(ident: int, transitions: int) -> dict[str, np.ndarray]:
    """``transitions + 1`` steps: frames o_0..o_T (the last the final observation), step index and id."""
    rng = np.random.default_rng(ident)
    n = transitions + 1
    return {"frame": rng.integers(0, 256, (n,) + FRAME, dtype=np.uint8), "t": np.arange(n, dtype=np.int64),
            "ep": np.full(n, ident, np.int64)}


def naive_stack(frames: np.ndarray, t: int, depth: int, pad: str) -> np.ndarray:
    """The stack of frames t-depth+1..t, padded before step 0 as ``pad`` says."""
    out = []
    for k in range(depth):
        s = t - depth + 1 + k
        if s < 0:
            out.append(np.zeros_like(frames[0]) if pad == "zeros" else frames[0])
        else:
            out.append(frames[s])
    return np.stack(out)


def check_batch(batch: gm.Batch, episodes: dict[int, dict], pad: str, depth: int = 4) -> int:
    """Every real step's obs and next_obs equal the naive reconstruction; padded steps are zero. Returns the
    real steps checked."""
    d = batch.numpy()
    mask = batch.mask.numpy()
    checked = 0
    for i in range(mask.shape[0]):
        for j in range(mask.shape[1]):
            if not mask[i, j]:
                assert not d["obs"][i, j].any() and not d["next_obs"][i, j].any()
                continue
            ep, t = int(d["ep"][i, j]), int(d["t"][i, j])
            frames = episodes[ep]["frame"]
            assert t < len(frames) - 1, "a window covered the final-observation step"
            np.testing.assert_array_equal(d["obs"][i, j], naive_stack(frames, t, depth, pad))
            np.testing.assert_array_equal(d["next_obs"][i, j], naive_stack(frames, t + 1, depth, pad))
            np.testing.assert_array_equal(d["frame"][i, j], frames[t])
            checked += 1
    return checked


@pytest.mark.parametrize("pad", ["first", "zeros"])
@pytest.mark.parametrize("window,align", [(1, "random"), (3, "random"), (5, "head"), (8, "tail"), (40, "head")])
def test_stacks_match_naive_reconstruction(pad, window, align):
    spec = make_spec(pad)
    # a small ring: later episodes evict earlier ones and wrap around the ring's end
    shard = gm.Shard(spec, 90, seed=3)
    episodes = {}
    for ident, t in enumerate([1, 2, 3, 7, 12, 30, 5, 9, 17, 4, 1, 25]):
        episodes[ident] = episode(ident, t)
        shard.insert(episodes[ident])
    assert shard.stored_bytes() < 90 * spec.step_bytes + 4096  # nothing stored for obs / next_obs
    checked = 0
    for _ in range(4):
        checked += check_batch(shard.sample(64, window, align), episodes, pad)
    assert checked > 64


def test_episode_start_pads_and_window_never_covers_the_final_step():
    spec = make_spec("first")
    shard = gm.Shard(spec, 200, seed=0)
    ep = episode(7, 3)  # 3 transitions, 4 frames
    shard.insert(ep)
    seen = set()
    for _ in range(20):
        b = shard.sample(32, 1)
        seen.update(b["t"].numpy().reshape(-1).tolist())
        check_batch(b, {7: ep}, "first")
    assert seen == {0, 1, 2}  # step 3 holds only the final observation
    b = shard.sample(1, 1, "head")
    f = ep["frame"]
    np.testing.assert_array_equal(b["obs"][0, 0].numpy(), np.stack([f[0], f[0], f[0], f[0]]))
    np.testing.assert_array_equal(b["next_obs"][0, 0].numpy(), np.stack([f[0], f[0], f[0], f[1]]))


def test_truncated_episode_next_obs_is_the_final_observation():
    """cleanrl #460: at a time-limit truncation, next_obs of the last step is the observation the env
    returned with truncated=True, not the reset observation of the next episode (which follows it in the ring)."""
    spec = gm.TrajectorySpec({"frame": (FRAME, "uint8"), "action": ((), "int64"), "truncated": ((), "bool"),
                              "obs": gm.FrameStack("frame", 4), "next_obs": gm.NextStep("obs")}, max_length=20)
    shard = gm.Shard(spec, 100, seed=0)
    rng = np.random.default_rng(0)
    limit = 6  # a TimeLimit wrapper's max_episode_steps
    final_obs = []
    for _ in range(3):
        obs = [rng.integers(0, 256, FRAME, dtype=np.uint8)]  # env.reset()
        actions, truncs = [], []
        for step in range(limit):
            obs.append(rng.integers(0, 256, FRAME, dtype=np.uint8))  # env.step(a) -> obs, r, term, trunc, info
            actions.append(step % 3)
            truncs.append(step == limit - 1)
        final_obs.append(obs[-1])  # what step() returned with truncated=True (a vector env would already reset)
        shard.insert({"frame": np.stack(obs), "action": np.array(actions + [0]),
                      "truncated": np.array(truncs + [False])})
    b = shard.sample(64, 1, "tail")  # every window is an episode's last transition
    assert b["truncated"].numpy().all()
    for i in range(64):
        got = b["next_obs"][i, 0, -1].numpy()
        assert any(np.array_equal(got, f) for f in final_obs)
        ep = next(k for k, f in enumerate(final_obs) if np.array_equal(got, f))
        np.testing.assert_array_equal(b["obs"][i, 0, 1:].numpy(), b["next_obs"][i, 0, :-1].numpy())
        assert ep >= 0


def test_next_step_of_a_stored_column_and_one_frame_stack():
    spec = gm.TrajectorySpec({"state": ((3,), "float32"), "next_state": gm.NextStep("state"),
                              "one": gm.FrameStack("state", 1)}, max_length=10)
    assert spec["state"].step_bytes == 12 and spec.context_before == 0 and spec.tail_steps == 1
    shard = gm.Shard(spec, 50, seed=0)
    states = np.arange(18, dtype=np.float32).reshape(6, 3)
    shard.insert({"state": states})
    b = shard.sample(16, 5, "head").numpy()
    np.testing.assert_array_equal(b["state"][0], states[:5])
    np.testing.assert_array_equal(b["next_state"][0], states[1:6])
    np.testing.assert_array_equal(b["one"][0, :, 0], states[:5])


def test_spec_declarations_checked_and_saved():
    spec = make_spec("zeros", frames=3)
    assert spec.names == ("frame", "t", "ep") and spec.batch_names == ("frame", "t", "ep", "obs", "next_obs")
    assert spec["frame"].step_bytes * 1 == spec.step_bytes - 16  # derived columns take no storage
    again = gm.TrajectorySpec.from_dict(spec.to_dict())
    assert again == spec and again.derived == spec.derived and again != make_spec("first", frames=3)
    assert "FrameStack" in repr(spec)
    with pytest.raises(ValueError, match="not a stored column"):
        gm.TrajectorySpec({"x": ((2,), "uint8"), "obs": gm.FrameStack("nope", 4)}, 5)
    with pytest.raises(ValueError, match="pad must be one of"):
        gm.TrajectorySpec({"x": ((2,), "uint8"), "obs": gm.FrameStack("x", 4, "edge")}, 5)
    with pytest.raises(ValueError, match="positive integer"):
        gm.TrajectorySpec({"x": ((2,), "uint8"), "obs": gm.FrameStack("x", 0)}, 5)
    with pytest.raises(ValueError, match="another NextStep"):
        gm.TrajectorySpec({"x": ((2,), "uint8"), "n": gm.NextStep("x"), "nn": gm.NextStep("n")}, 5)
    with pytest.raises(ValueError, match="max_length must be at least 2"):
        gm.TrajectorySpec({"x": ((2,), "uint8"), "n": gm.NextStep("x")}, 1)
    with pytest.raises(ValueError, match="at least one stored column"):
        gm.TrajectorySpec({"n": gm.FrameStack("x", 2)}, 5)


def test_bad_inserts_refused_and_nothing_stored():
    spec = make_spec()
    shard = gm.Shard(spec, 100, seed=0)
    with pytest.raises(gm.InvalidTrajectoryError, match="final observation"):
        shard.insert(episode(1, 0))  # one step: no transition
    with pytest.raises(gm.InvalidTrajectoryError, match="derived"):
        shard.insert({**episode(1, 3), "obs": np.zeros((4, 4) + FRAME, np.uint8)})
    ep = episode(2, 3)
    with pytest.raises(gm.InvalidTrajectoryError, match="final observation"):
        shard.insert_packed({k: np.concatenate([v, v[:1]]) for k, v in ep.items()}, [4, 1])
    assert len(shard) == 0 and shard.store.steps_used == 0


def test_checkpoint_keeps_the_declarations_not_the_stacks(tmp_path):
    spec = make_spec("zeros")
    shard = gm.Shard(spec, 120, seed=5)
    episodes = {i: episode(i, 3 + 2 * i) for i in range(6)}
    for e in episodes.values():
        shard.insert(e)
    gm.save_shard(shard, tmp_path / "s.npz")
    back = gm.load_shard(tmp_path / "s.npz")
    assert back.spec == spec and back.spec.derived == spec.derived
    a, b = shard.sample(32, 4), back.sample(32, 4)
    for name in spec.batch_names:
        np.testing.assert_array_equal(a[name].numpy(), b[name].numpy())
    check_batch(b, episodes, "zeros")


@pytest.mark.parametrize("force", [False, True], ids=["shm", "alltoallv"])
def test_replay_on_two_ranks(force):
    run = run_pytest_mpi(2, "test_frames.py", *(["--force-alltoallv"] if force else []), timeout=300)
    assert any(t.startswith("test_frames::") for t in run.passed(0))
