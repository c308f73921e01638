"""A D4RL-layout HDF5 file as a dataset source (for :func:`gear_mpi.datasets.from_d4rl`).

The layout: datasets ``observations``, ``actions``, ``rewards``, ``terminals`` and
``timeouts`` of ``N`` steps each (the first axis), optionally ``next_observations`` and a
group ``infos`` of per-step datasets; other groups (``metadata``) are not steps and are
left alone. An episode ends at a step whose ``terminals`` or ``timeouts`` flag is set.
Needs h5py (``pip install gear-mpi[datasets]``), imported when a file is opened.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from .episodes import split_episodes

REQUIRED = ("observations", "actions", "rewards", "terminals", "timeouts")
OPTIONAL = ("next_observations",)


def _h5py():
    try:
        import h5py
    except ImportError:
        raise ImportError("reading D4RL files needs h5py: pip install gear-mpi[datasets]") from None
    return h5py


class D4RLSource:
    """One D4RL file, opened read-only: its columns and episodes, and reads of whole episodes.

    Opening reads the metadata and the ``terminals`` and ``timeouts`` flags (2 N bytes), not the steps.
    Args:
        path: the HDF5 file.
        columns: the datasets to load (paths inside the file, e.g. ``"infos/qpos"``); None: every
            required one, ``next_observations`` if present and every dataset of ``infos``.
    Raises:
        ValueError: the file is missing, not HDF5 or damaged (e.g. truncated), a required dataset is
            missing, a dataset has another number of steps than ``observations`` (``terminals`` and
            ``timeouts`` too, whether loaded or not) or a non-numeric dtype, ``columns`` is a string, or a
            named column is not in the file.
        ImportError: h5py is not installed.
    """

    def __init__(self, path: str | Path, columns: Sequence[str] | None = None):
        h5py = _h5py()
        self.description = str(path)
        try:
            self.file = h5py.File(path, "r")
        except FileNotFoundError:
            raise ValueError(f"{path}: no such file") from None
        except OSError as e:
            raise ValueError(f"{path}: cannot be opened as HDF5 (truncated or damaged?): {e}") from None
        try:
            self._inspect(h5py, columns)
        except BaseException:
            self.file.close()
            raise

    def _inspect(self, h5py, columns: Sequence[str] | None) -> None:
        f, where = self.file, self.description
        missing = [n for n in REQUIRED if not isinstance(f.get(n), h5py.Dataset)]
        if missing:
            raise ValueError(f"{where}: missing dataset(s) {missing}; a D4RL file has {list(REQUIRED)}")
        if columns is None:
            names = list(REQUIRED) + [n for n in OPTIONAL if isinstance(f.get(n), h5py.Dataset)]
            infos = f.get("infos")
            if isinstance(infos, h5py.Group):
                names += [f"infos/{k}" for k in sorted(infos) if isinstance(infos[k], h5py.Dataset)]
        else:
            if isinstance(columns, (str, bytes)):
                raise ValueError(f"columns must be a sequence of dataset names, got the string {columns!r} "
                                 f"(write [{columns!r}])")
            names = list(columns)
            absent = [n for n in names if not isinstance(f.get(n), h5py.Dataset)]
            if absent:
                raise ValueError(f"{where}: no dataset(s) {absent} in the file")
        n = f["observations"].shape[0] if f["observations"].ndim else 0
        if n == 0:  # else an empty replay, as if the load had worked
            raise ValueError(f"{where}: 'observations' holds no steps (shape {f['observations'].shape}): "
                             f"nothing to load")
        for name in ("terminals", "timeouts"):  # they cut the episodes, loaded as columns or not
            if f[name].shape != (n,):
                raise ValueError(f"{where}: dataset {name!r} has shape {f[name].shape}, but 'observations' has "
                                 f"{n} steps (mismatched lengths)")
        self.datasets = {}
        self.columns = {}
        for name in names:
            ds = f[name]
            if ds.ndim == 0 or ds.shape[0] != n:
                raise ValueError(f"{where}: dataset {name!r} has shape {ds.shape}, but 'observations' has "
                                 f"{n} steps (mismatched lengths)")
            if ds.dtype.kind not in "biufc":
                raise ValueError(f"{where}: dataset {name!r} has non-numeric dtype {ds.dtype}; pick the "
                                 f"columns to load with columns=[...]")
            self.datasets[name] = ds
            self.columns[name] = (tuple(ds.shape[1:]), ds.dtype)
        try:
            terminals, timeouts = f["terminals"][()], f["timeouts"][()]
        except OSError as e:
            raise ValueError(f"{where}: cannot read 'terminals'/'timeouts' (truncated or damaged?): {e}") from None
        self.starts, self.lengths, self.open_last = split_episodes(terminals, timeouts)

    def read(self, first: int, stop: int, buffers: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The steps of episodes ``first:stop`` (consecutive in the file), read into ``buffers``. Local.

        Args:
            first, stop: episode indices.
            buffers: column -> array of at least their steps, of the column's dtype, C-contiguous.
        Returns:
            Column -> a view of the front of its buffer holding those steps.
        Raises:
            ValueError: a read failed (a damaged file).
        """
        lo = int(self.starts[first])
        hi = int(self.starts[stop - 1] + self.lengths[stop - 1])
        out = {}
        for name, ds in self.datasets.items():
            view = buffers[name][:hi - lo]
            try:
                ds.read_direct(view, np.s_[lo:hi], np.s_[0:hi - lo])
            except OSError as e:
                raise ValueError(f"{self.description}: cannot read steps {lo}:{hi} of {name!r} "
                                 f"(truncated or damaged?): {e}") from None
            out[name] = view
        return out

    def close(self) -> None:
        """Close the file. Idempotent."""
        if self.file is not None:
            self.file.close()
            self.file = None
