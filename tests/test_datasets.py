"""gm.datasets: the episode split and shares, the two sources, make_dataset, and the collective load
on 1, 2 and 3 ranks (tests/mpi/test_dataset_ingest.py, over the files of tests/mpi/dataset_files.py).

- split_episodes ends episodes at terminals or timeouts and keeps an open last one;
  balanced_shares cuts contiguous runs within one episode of the mean; dataset_load.chunk_bounds
  groups whole episodes.
- The sources read the files' metadata only when opened and name the fault of a damaged
  file (in-process, no MPI).
- scripts/data/make_dataset.py writes a D4RL file the loader reads back as written,
  with episodes of mixed quality (skipped without gymnasium).
"""
from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest

from gear_mpi.datasets import balanced_shares, split_episodes
from gear_mpi.datasets import d4rl
from gear_mpi.datasets import load as dataset_load
from gear_mpi.datasets import npz
from mpi_util import MPI_TESTS, run_pytest_mpi

_spec = importlib.util.spec_from_file_location("dataset_files", MPI_TESTS / "dataset_files.py")
dataset_files = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dataset_files)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return dataset_files.write_all(tmp_path_factory.mktemp("datasets"))


def test_split_episodes():
    t = np.array([0, 0, 1, 0, 0, 0, 0, 1, 0, 0])
    o = np.zeros(10)
    o[5] = 1
    starts, lengths, open_last = split_episodes(t, o)
    assert starts.tolist() == [0, 3, 6, 8] and lengths.tolist() == [3, 3, 2, 2] and open_last
    starts, lengths, open_last = split_episodes(t[:8], None)
    assert starts.tolist() == [0, 3] and lengths.tolist() == [3, 5] and not open_last
    assert [len(a) for a in split_episodes(np.zeros(0), np.zeros(0))[:2]] == [0, 0]
    assert split_episodes(np.zeros(4), np.zeros(4))[1].tolist() == [4]  # no end at all: one open episode
    with pytest.raises(ValueError, match="timeouts"):
        split_episodes(t, o[:-1])


@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 64])
def test_balanced_shares(ranks):
    lengths = np.random.default_rng(ranks).integers(1, 300, 50)
    bounds = balanced_shares(lengths, ranks)
    assert bounds[0] == 0 and bounds[-1] == 50 and np.all(np.diff(bounds) >= 0)
    share = [lengths[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])]
    assert sum(share) == lengths.sum()
    assert max(abs(s - lengths.sum() / ranks) for s in share) <= lengths.max()


def test_chunk_bounds():
    lengths = np.array([5, 5, 5, 20, 1, 1, 1])
    b = dataset_load.chunk_bounds(lengths, step_bytes=10, chunk_bytes=100)  # chunks start every 10 steps
    assert b[0] == 0 and b[-1] == len(lengths) and np.all(np.diff(b) >= 1)
    assert b.tolist() == [0, 2, 4, 7]  # a chunk starts where a new 100 bytes begin; its last episode may run over
    assert dataset_load.chunk_bounds(np.zeros(0, np.int64), 10, 100).tolist() == [0]


def test_sources_read_metadata_and_name_faults(files):
    lengths, open_last = dataset_files.episodes()
    s = d4rl.D4RLSource(files / "good.hdf5")
    try:
        np.testing.assert_array_equal(s.lengths, lengths)
        assert s.open_last == open_last and s.columns["observations"] == ((3,), np.dtype(np.float32))
        buffers = {k: np.empty((100,) + shape, dtype) for k, (shape, dtype) in s.columns.items()}
        got = s.read(2, 4, buffers)
        a = lengths[:2].sum()
        np.testing.assert_array_equal(got["infos/step"], np.arange(a, a + lengths[2:4].sum()))
    finally:
        s.close()
    s = d4rl.D4RLSource(files / "text.hdf5", columns=["observations", "infos/step"])  # pick around a bad one
    assert list(s.columns) == ["observations", "infos/step"]
    s.close()
    with pytest.raises(ValueError, match=r"no dataset\(s\) \['nope'\]"):
        d4rl.D4RLSource(files / "good.hdf5", columns=["nope"])
    n = npz.NpzSource(files / "good_npz")
    np.testing.assert_array_equal(n.lengths, lengths)
    assert not n.open_last
    assert npz.npz_header(n.files[0])["observations"] == ((lengths[0], 3), np.dtype(np.float32))
    with pytest.raises(ValueError, match="not a directory"):
        npz.NpzSource(files / "good.hdf5")
    with pytest.raises(ValueError, match="not a readable .npz file"):
        npz.npz_header(files / "good.hdf5")


def test_d4rl_file_of_no_steps_is_refused(tmp_path):
    """A file whose datasets hold no steps gave an empty replay, as if the load had worked."""
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "empty.hdf5"
    with h5py.File(path, "w") as f:
        for name, shape in (("observations", (0, 3)), ("actions", (0, 2)), ("rewards", (0,))):
            f[name] = np.zeros(shape, np.float32)
        f["terminals"] = f["timeouts"] = np.zeros(0, bool)
    with pytest.raises(ValueError, match=r"'observations' holds no steps \(shape \(0, 3\)\): nothing to load"):
        d4rl.D4RLSource(path)


@pytest.mark.parametrize("flag_steps", [6, 14])
def test_d4rl_flags_of_another_length_are_refused_when_not_loaded(tmp_path, flag_steps):
    """``terminals``/``timeouts`` cut the episodes even when ``columns=`` leaves them out: their length is checked
    against ``observations``; before, shorter flags dropped the last steps silently and longer ones failed
    mid-read with h5py's "Can't broadcast". A string as ``columns`` is named (was read letter by letter)."""
    h5py = pytest.importorskip("h5py")
    path = tmp_path / "flags.hdf5"
    with h5py.File(path, "w") as f:
        for name, shape in (("observations", (10, 3)), ("actions", (10, 2)), ("rewards", (10,))):
            f[name] = np.zeros(shape, np.float32)
        f["terminals"] = np.arange(flag_steps) == flag_steps - 1
        f["timeouts"] = np.zeros(flag_steps, bool)
    with pytest.raises(ValueError, match=rf"'terminals' has shape \({flag_steps},\), but 'observations' has 10"):
        d4rl.D4RLSource(path, columns=["observations"])
    with pytest.raises(ValueError, match="got the string 'observations'"):
        d4rl.D4RLSource(path, columns="observations")


@pytest.mark.parametrize("max_length", [12.5, True, 0, "20"])
def test_a_max_length_that_is_not_a_positive_integer_is_refused(files, max_length):
    """``int(max_length)`` loaded 12.5 as 12 and True as 1 (then an episode was too long, or nothing said why)."""
    from gear_mpi.datasets import from_d4rl
    with pytest.raises(ValueError, match=r"max_length must be a positive integer \(or None: the longest episode\), "
                                         rf"got {re.escape(repr(max_length))}"):
        from_d4rl(files / "good.hdf5", max_length=max_length, timeout=20.0)


@pytest.mark.parametrize("capacity", [float("inf"), 500.5, "500", True])
def test_a_capacity_that_is_not_a_positive_integer_is_refused(files, capacity):
    """``capacity_steps=inf`` raised int()'s OverflowError, agreed as a bare ``Exception``; 500.5 was cut to 500."""
    from gear_mpi.datasets import from_d4rl
    with pytest.raises(ValueError, match=rf"from_d4rl: rank 0: capacity_steps must be an integer in \[1, .*"
                                         rf"got {re.escape(repr(capacity))}"):
        from_d4rl(files / "good.hdf5", capacity_steps=capacity, timeout=20.0)


def test_make_dataset_writes_what_the_loader_reads(tmp_path):
    pytest.importorskip("gymnasium")
    import h5py
    from scripts.data.make_dataset import make_dataset

    out = tmp_path / "cp.hdf5"
    summary = make_dataset(out, "CartPole-v1", steps=3000, noise=(0.0, 1.0), seed=3, max_episode_steps=200,
                           npz_dir=tmp_path / "npz")
    s = d4rl.D4RLSource(out)
    try:
        assert len(s.lengths) == summary["episodes"] and s.lengths.sum() == 3000
        assert summary["timeouts"] > 0 and summary["terminals"] > 0  # expert episodes time out, random ones fall
        returns = summary["mean_return"]
        assert returns[0.0] > 5 * returns[1.0]  # mixed quality
        with h5py.File(out) as f:
            assert f["metadata"].attrs["env"] == "CartPole-v1"
    finally:
        s.close()
    n = npz.NpzSource(tmp_path / "npz")
    assert n.lengths.sum() == 3000 and len(n.lengths) == summary["episodes"]


def test_make_dataset_phases_run_in_order(tmp_path):
    """``phases``: a learning agent's history, phase after phase, the last one until the steps are written;
    the bias leans the CartPole controller (shorter episodes, fewer of the unbiased controller's actions)."""
    pytest.importorskip("gymnasium")
    import h5py
    from gear_mpi.datasets import split_episodes
    from scripts.data.make_dataset import make_dataset, parse_phases

    phases = parse_phases("3:1:0, 4:0:0.15,1:0:0")
    assert phases == [(3, 1.0, 0.0), (4, 0.0, 0.15), (1, 0.0, 0.0)]
    out = tmp_path / "replay.hdf5"
    summary = make_dataset(out, "CartPole-v1", steps=2000, seed=1, phases=phases)
    with h5py.File(out) as f:
        starts, lengths, open_last = split_episodes(f["terminals"][:], f["timeouts"][:])
        phase, bias, noise = f["infos/phase"][:][starts], f["infos/bias"][:][starts], f["infos/noise"][:][starts]
        assert f["metadata"].attrs["phases"] == "3:1:0,4:0:0.15,1:0:0"
    assert phase.tolist() == [0] * 3 + [1] * 4 + [2] * (len(starts) - 7)  # the last phase goes on
    assert bias.tolist() == [0.0] * 3 + [pytest.approx(0.15)] * 4 + [0.0] * (len(starts) - 7)
    assert noise.tolist() == [1.0] * 3 + [0.0] * (len(starts) - 3)
    random, leaning, expert = summary["phase_mean_return"]
    assert random < 40 and 80 < leaning < 200 and expert == 500.0, summary  # the lean drives the cart off
    assert summary["controller_share"] < 0.9 and summary["steps"] == 2000 and open_last, summary
    # without phases: the noise levels cycle, no bias, as before
    plain = make_dataset(tmp_path / "plain.hdf5", "CartPole-v1", steps=1500, noise=(0.0, 1.0), seed=1)
    assert "phase_mean_return" not in plain and set(plain["mean_return"]) == {0.0, 1.0}, plain
    for bad in ("3:1", "0:1:0", "2:-1:0", "2:0:nan", "a:0:0", "1:0:0:0"):
        with pytest.raises(ValueError, match="phases"):
            parse_phases(bad)
    with pytest.raises(ValueError, match="probability"):
        make_dataset(tmp_path / "x.hdf5", "CartPole-v1", steps=100, phases=[(1, 2.0, 0.0)])
    assert not (tmp_path / "x.hdf5").exists()


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_ingest_on_ranks(files, nprocs):
    run = run_pytest_mpi(nprocs, "test_dataset_ingest.py", mpiexec=nprocs > 1, timeout=300,
                         env={dataset_files.ENV: str(files)})
    ran = run.passed(0)
    assert sum(t.startswith("test_dataset_ingest::") for t in ran) >= 12, sorted(ran)
