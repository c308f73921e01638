"""gm.datasets.from_minari: small Minari datasets written by minari's own writer from gymnasium rollouts
(tests/mpi/minari_datasets.py; nothing downloaded), read by the source in-process, then loaded on 1 and 2 ranks
(tests/mpi/test_minari_ingest.py: every episode equals what minari.load_dataset gives, exactly; bad input fails
on every rank); and examples/integrations/minari_offline.py runs on 2 ranks.

- The source finds a dataset by id under Minari's root (the root minari itself uses), by its directory and by its
  data/ directory; its episode lengths and columns are minari's; a read of a few episodes gives their steps.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from gear_mpi.datasets import minari_files
from example_util import run_example_job
from mpi_util import MPI_TESTS, ROOT, run_pytest_mpi

minari = pytest.importorskip("minari", reason="the minari extra (minari[hdf5]) is not installed")
pytest.importorskip("gymnasium")
pytest.importorskip("PIL", reason="minari 0.5's HDF5 storage imports PIL (pillow) to write or load a dataset")

_spec = importlib.util.spec_from_file_location("minari_datasets", MPI_TESTS / "minari_datasets.py")
minari_datasets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(minari_datasets)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return minari_datasets.write_all(tmp_path_factory.mktemp("minari"))


@pytest.fixture
def in_root(root, monkeypatch):
    monkeypatch.setenv(minari_datasets.ENV, str(root))
    return root


def test_the_root_is_minaris(in_root):
    from minari.storage import get_dataset_path
    assert minari_files.datasets_root() == get_dataset_path()
    data = in_root / "cartpole" / "random-v0" / "data"
    for where in ("cartpole/random-v0", in_root / "cartpole" / "random-v0", data):
        assert minari_files.resolve(where) == data


def test_source_lengths_columns_and_reads_are_minaris(in_root):
    episodes = list(minari.load_dataset("pendulum/random-v0").iterate_episodes())
    s = minari_files.MinariSource("pendulum/random-v0")
    try:
        np.testing.assert_array_equal(s.lengths, [len(e) for e in episodes])
        assert not s.open_last and s.metadata["total_steps"] == sum(len(e) for e in episodes)
        assert s.columns == {"observations": ((3,), np.dtype(np.float32)),
                             "next_observations": ((3,), np.dtype(np.float32)),
                             "actions": ((1,), np.dtype(np.float32)), "rewards": ((), np.dtype(np.float64)),
                             "terminations": ((), np.dtype(np.bool_)), "truncations": ((), np.dtype(np.bool_))}
        buffers = {k: np.empty((200,) + shape, dtype) for k, (shape, dtype) in s.columns.items()}
        got = s.read(1, 3, buffers)
        np.testing.assert_array_equal(got["next_observations"],
                                      np.concatenate([e.observations[1:] for e in episodes[1:3]]))
        np.testing.assert_array_equal(got["truncations"], np.concatenate([e.truncations for e in episodes[1:3]]))
        assert got["truncations"].sum() == 2  # Pendulum cut at 37 steps: each episode ends truncated
    finally:
        s.close()
    with pytest.raises(ValueError, match="not a directory"):
        minari_files.resolve(in_root / "cartpole" / "random-v0" / "data" / "metadata.json")


@pytest.mark.parametrize("nprocs", [1, 2])
def test_from_minari_on_ranks(root, nprocs):
    run = run_pytest_mpi(nprocs, "test_minari_ingest.py", mpiexec=nprocs > 1, timeout=240,
                         env={minari_datasets.ENV: str(root)})
    ran = run.passed(0)
    assert sum(t.startswith("test_minari_ingest::") for t in ran) >= 11, sorted(ran)


def test_minari_example_runs_on_two_ranks(tmp_path):
    result, _ = run_example_job(ROOT / "examples" / "integrations" / "minari_offline.py", "--root", str(tmp_path),
                                "--episodes", "12", "--steps", "80", ranks=2, timeout=240)
    assert result["episodes"] == result["episodes_minari"] and result["steps"] == result["steps_minari"]
    assert result["final_loss"] < result["first_loss"]
