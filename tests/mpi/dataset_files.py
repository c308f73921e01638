"""Small hand-made datasets for the loader tests (tests/test_datasets.py and tests/mpi/test_dataset_ingest.py).

:func:`write_all` writes, under one directory, D4RL-layout HDF5 files and npz directories:
a good file with uneven episodes (lengths 1..40, one of 40 steps, and an open last
episode), a good npz directory of the same episodes, and damaged ones (a required dataset
missing, mismatched lengths, a truncated file, a non-numeric dataset, an npz file whose data is
shorter than its header says, npz files of different columns or lengths). Every file has ``infos/step``
numbering the steps ``0..N-1``, so a trajectory read back tells exactly where it came from.
"""
from __future__ import annotations

import atexit
import functools
import io
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import numpy as np

ENV = "GEAR_MPI_TEST_DATASETS"  # the directory, for the ranks of an mpiexec job
SEED = 11


def episodes(seed: int = SEED) -> tuple[np.ndarray, bool]:
    """The episode lengths of the good datasets (the last one open)."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(1, 41, 45), [40, 1, 1, 23]])
    return lengths.astype(np.int64), True


def step_table(lengths: np.ndarray, open_last: bool) -> dict[str, np.ndarray]:
    """A D4RL step table for these episodes (terminals and timeouts alternate as the ends)."""
    n = int(lengths.sum())
    rng = np.random.default_rng(3)
    ends = np.cumsum(lengths) - 1
    if open_last:
        ends = ends[:-1]
    terminals = np.zeros(n, np.bool_)
    timeouts = np.zeros(n, np.bool_)
    terminals[ends[::2]] = True
    timeouts[ends[1::2]] = True
    return {"observations": rng.standard_normal((n, 3)).astype(np.float32),
            "actions": rng.uniform(-1, 1, (n, 2)).astype(np.float32),
            "rewards": rng.standard_normal(n).astype(np.float32),
            "terminals": terminals, "timeouts": timeouts,
            "next_observations": rng.standard_normal((n, 3)).astype(np.float32),
            "infos/step": np.arange(n, dtype=np.int64)}


def write_h5(path: Path, table: dict[str, np.ndarray]) -> Path:
    import h5py
    with h5py.File(path, "w") as f:
        for name, arr in table.items():
            f.create_dataset(name, data=arr)
        f.create_group("metadata").attrs["what"] = "gear_mpi test dataset"
    return path


def write_npz_dir(path: Path, table: dict[str, np.ndarray], lengths: np.ndarray, compressed: bool = False) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save = np.savez_compressed if compressed else np.savez
    starts = np.cumsum(lengths) - lengths
    for e, (a, n) in enumerate(zip(starts, lengths)):
        save(path / f"ep_{e:04d}.npz", **{k.replace("/", "_"): v[a:a + n] for k, v in table.items()})
    return path


def write_all(root: Path) -> Path:
    """Write every test dataset under ``root``; returns ``root``."""
    import h5py
    root.mkdir(parents=True, exist_ok=True)
    lengths, open_last = episodes()
    table = step_table(lengths, open_last)
    good = write_h5(root / "good.hdf5", table)
    write_npz_dir(root / "good_npz", table, lengths)
    write_h5(root / "missing.hdf5", {k: v for k, v in table.items() if k != "timeouts"})
    write_h5(root / "mismatched.hdf5", {**table, "rewards": table["rewards"][:-5]})
    data = good.read_bytes()
    (root / "truncated.hdf5").write_bytes(data[:len(data) // 2])
    with h5py.File(root / "text.hdf5", "w") as f:  # a non-numeric dataset among the infos
        for name, arr in table.items():
            f.create_dataset(name, data=arr)
        f.create_dataset("infos/label", data=np.array([b"x"] * len(table["rewards"])))
    # npz: the last file's observations header promises more steps than its data holds (found only when read)
    short = write_npz_dir(root / "short_npz", table, lengths)
    victim = sorted(short.glob("*.npz"))[-1]
    arrays = dict(np.load(victim))
    obs = arrays.pop("observations")
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, np.lib.format.header_data_from_array_1_0(obs))
    with zipfile.ZipFile(victim, "w") as z:
        for k, v in arrays.items():
            one = io.BytesIO()
            np.save(one, v)
            z.writestr(k + ".npy", one.getvalue())
        z.writestr("observations.npy", buf.getvalue() + obs.tobytes()[:obs.nbytes // 2])
    odd = write_npz_dir(root / "odd_npz", table, lengths)
    np.savez(sorted(odd.glob("*.npz"))[3], observations=np.zeros((4, 3), np.float32))  # other columns
    ragged = write_npz_dir(root / "ragged_npz", table, lengths)
    f = sorted(ragged.glob("*.npz"))[2]
    arrays = dict(np.load(f))
    arrays["rewards"] = arrays["rewards"][:-1]
    np.savez(f, **arrays)
    (root / "empty_npz").mkdir(exist_ok=True)
    return root


@functools.lru_cache(maxsize=None)
def root_from_env() -> Path:
    """The datasets' directory: ``$GEAR_MPI_TEST_DATASETS`` (tests/test_datasets.py writes the files once for its
    jobs); without it (a run by hand, ``mpiexec -n N python -m pytest tests/mpi/test_dataset_ingest.py``), rank 0
    of ``MPI.COMM_WORLD`` writes them into a new temporary directory (removed at its exit) and every rank is told
    where (collective, once per process)."""
    if ENV in os.environ:
        return Path(os.environ[ENV])
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    root = None
    if comm.rank == 0:
        root = tempfile.mkdtemp(prefix="gear_datasets_")
        atexit.register(shutil.rmtree, root, True)
        write_all(Path(root))
    return Path(comm.bcast(root))
