"""A Minari dataset (D4RL's successor, Farama's ``minari`` package) as a dataset source, read with h5py
(for :func:`gear_mpi.datasets.from_minari`; the ``minari`` package itself is not needed to read).

The layout Minari writes (its HDF5 storage): a dataset directory ``<root>/<dataset_id>/`` whose ``data/``
holds ``metadata.json`` (``total_episodes``, ``total_steps``, ``data_format``, the spaces, ...) and
``main_data.hdf5`` with one group ``episode_<i>`` per episode, ``i = 0 .. total_episodes - 1``. An episode
of ``T`` steps holds ``observations`` (``T + 1``: the reset's and each step's), ``actions``, ``rewards``,
``terminations`` and ``truncations`` (``T`` each) and, if recorded, ``infos`` (a group; ``T + 1`` entries,
the reset's first). ``observations`` and ``actions`` are a dataset for a Box or Discrete space, a group of
them for a Dict space (``_index_<k>`` members for a Tuple space), nested as the spaces are.

Columns, one row per step: ``observations`` (the first ``T`` observations), ``next_observations`` (the last
``T``: the last observation of a truncated episode is kept there), ``actions``, ``rewards``,
``terminations``, ``truncations``; a Dict or Tuple space gives one column per leaf, named by its path
(``observations/pos``, ``next_observations/pos``, ``actions/_index_0``). ``infos/<key>`` columns are read when
named (the info each step returned: entries ``1 .. T`` of ``T + 1``).

Opening reads the metadata, each episode's ``rewards`` shape (one HDF5 lookup per episode) and episode 0's
datasets' shapes and dtypes; each episode's other datasets are checked when its rank reads it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

METADATA = "metadata.json"
MAIN_FILE = "main_data.hdf5"
STEP_KEYS = ("actions", "rewards", "terminations", "truncations")


def _h5py():
    try:
        import h5py
    except ImportError:
        raise ImportError("reading Minari datasets needs h5py: pip install gear-mpi[datasets]") from None
    return h5py


def datasets_root() -> Path:
    """Where Minari keeps local datasets: ``$MINARI_DATASETS_PATH``, else ``~/.minari/datasets`` (the rule of
    ``minari.storage.get_dataset_path``). Local; creates nothing."""
    env = os.environ.get("MINARI_DATASETS_PATH")
    return Path(env) if env else Path.home() / ".minari" / "datasets"


def resolve(dataset: str | os.PathLike) -> Path:
    """The directory holding a Minari dataset's ``metadata.json``. Local.

    Args:
        dataset: a directory (the dataset's, or its ``data/``), or a dataset id (``"cartpole/random-v0"``)
            looked up under :func:`datasets_root` when no such directory exists.
    Raises:
        ValueError: a directory without ``metadata.json`` (nor ``data/metadata.json``), or an id that is no
            local dataset.
    """
    path = Path(dataset).expanduser()
    if path.is_dir():
        candidates = [path]
    elif path.is_absolute() or path.exists():
        raise ValueError(f"{path}: not a directory (a Minari dataset is a directory with data/metadata.json)")
    else:
        candidates = [datasets_root() / path]
        if not candidates[0].is_dir():
            raise ValueError(f"{dataset!r}: no such directory, and no local Minari dataset of that id under "
                             f"{datasets_root()} ($MINARI_DATASETS_PATH, else ~/.minari/datasets)")
    for c in candidates:
        for d in (c, c / "data"):
            if (d / METADATA).is_file():
                return d
    raise ValueError(f"{candidates[0]}: not a Minari dataset (no {METADATA} in it or in its data/ directory)")


def _leaves(h5py, node, prefix: str) -> list[tuple[str, str]]:
    """(column name, path inside the episode group) of every dataset under ``node``, groups flattened."""
    if isinstance(node, h5py.Dataset):
        return [(prefix, node.name.split("/", 2)[2])]
    out = []
    for key in node:  # h5py iterates in name order (or creation order when the file tracks it)
        out += _leaves(h5py, node[key], f"{prefix}/{key}")
    return out


class MinariSource:
    """One Minari dataset (HDF5 storage), opened read-only: its columns and episodes, and reads of whole episodes.

    Args:
        dataset: a dataset directory or id (:func:`resolve`).
        columns: the columns to load (names as the module docstring gives them, ``infos/<key>`` included);
            None: every observation, next-observation and action leaf, ``rewards``, ``terminations`` and
            ``truncations``.
        next_observations: with ``columns=None``, also the ``next_observations`` columns (False halves the
            observation memory and drops each episode's last observation).
    Raises:
        ValueError: no such dataset, unreadable or damaged ``metadata.json``, a data format other than HDF5,
            ``main_data.hdf5`` missing, not HDF5 or damaged, an episode group missing, no episodes, an episode
            of no steps, a required dataset missing in episode 0, a non-numeric column (text, JPEG-encoded
            images), or a named column that is not in the dataset.
        ImportError: h5py is not installed.
    """

    def __init__(self, dataset: str | os.PathLike, columns: Sequence[str] | None = None,
                 next_observations: bool = True):
        h5py = _h5py()
        self.data_dir = resolve(dataset)
        self.description = str(self.data_dir)
        where = self.description
        try:
            self.metadata = json.loads((self.data_dir / METADATA).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{where}: cannot read {METADATA}: {e}") from None
        if not isinstance(self.metadata, dict):
            raise ValueError(f"{where}: {METADATA} holds no JSON object")
        fmt = self.metadata.get("data_format", "hdf5")
        if fmt != "hdf5":
            raise ValueError(f"{where}: data_format {fmt!r}: only Minari's HDF5 storage is read (create the dataset "
                             f"with data_format='hdf5')")
        main = self.data_dir / MAIN_FILE
        if not main.is_file():
            raise ValueError(f"{where}: no {MAIN_FILE}")
        try:
            self.file = h5py.File(main, "r")
        except OSError as e:
            raise ValueError(f"{main}: cannot be opened as HDF5 (truncated or damaged?): {e}") from None
        try:
            self._inspect(h5py, columns, next_observations)
        except BaseException:
            self.file.close()
            raise
        self.open_last = False  # every Minari episode is a whole episode

    def _inspect(self, h5py, columns: Sequence[str] | None, next_observations: bool) -> None:
        f, where = self.file, self.description
        total = self.metadata.get("total_episodes")
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"{where}: {METADATA} has no valid total_episodes ({total!r})")
        if total == 0:
            raise ValueError(f"{where}: the dataset has no episodes")
        self.groups = [f"episode_{i}" for i in range(total)]
        lengths = np.empty(total, np.int64)
        for i, name in enumerate(self.groups):
            try:
                rewards = f[name]["rewards"]
            except KeyError:
                raise ValueError(f"{where}: {METADATA} says {total} episodes, but {MAIN_FILE} has no "
                                 f"'{name}/rewards'") from None
            except OSError as e:
                raise ValueError(f"{where}: cannot read {name} (truncated or damaged?): {e}") from None
            if rewards.ndim != 1 or rewards.shape[0] < 1:
                raise ValueError(f"{where}: {name}/rewards has shape {rewards.shape}: an episode has T >= 1 "
                                 f"rewards")
            lengths[i] = rewards.shape[0]
        self.lengths = lengths
        first = f[self.groups[0]]
        for key in ("observations",) + STEP_KEYS:
            if key not in first:
                raise ValueError(f"{where}: {self.groups[0]} has no {key!r}; a Minari episode has observations, "
                                 f"{', '.join(STEP_KEYS)}")
        available = {}  # column -> (path in the episode, first row of the episode's entries: 0 or 1 of T + 1)
        for name, path in _leaves(h5py, first["observations"], "observations"):
            available[name] = (path, 0)
            available["next_" + name] = (path, 1)
        for key in STEP_KEYS:
            for name, path in _leaves(h5py, first[key], key):
                available[name] = (path, 0)
        infos = first.get("infos")
        if isinstance(infos, h5py.Group):
            for name, path in _leaves(h5py, infos, "infos"):
                available[name] = (path, 1)
        if columns is None:
            names = [n for n in available if not n.startswith("infos/")
                     and (next_observations or not n.startswith("next_observations"))]
        else:
            names = list(columns)
            absent = [n for n in names if n not in available]
            if absent:
                raise ValueError(f"{where}: no column(s) {absent}; the dataset has {sorted(available)}")
        self.paths = {n: available[n] for n in names}
        self.columns = {}
        for name, (path, _) in self.paths.items():
            ds = first[path]
            if ds.dtype.kind not in "biuf" or h5py.check_vlen_dtype(ds.dtype) is not None:
                raise ValueError(f"{where}: column {name!r} has non-numeric dtype {ds.dtype} (text, or JPEG-encoded "
                                 f"images: create the dataset with jpeg_encoding=False); pick the columns to load "
                                 f"with columns=[...]")
            self.columns[name] = (tuple(ds.shape[1:]), ds.dtype)

    def read(self, first: int, stop: int, buffers: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The steps of episodes ``first:stop`` back to back, read into ``buffers``. Local.

        Args:
            first, stop: episode indices.
            buffers: column -> array of at least their steps, of the column's dtype, C-contiguous.
        Returns:
            Column -> a view of the front of its buffer holding those steps.
        Raises:
            ValueError: an episode whose datasets differ from episode 0's in per-step shape or dtype, or whose
                entries are not ``T`` (``T + 1`` for observations and infos), or a read that failed.
        """
        pos = 0
        for i in range(first, stop):
            n, name = int(self.lengths[i]), self.groups[i]
            try:
                group = self.file[name]
                for column, (path, offset) in self.paths.items():
                    ds = group.get(path)
                    shape, dtype = self.columns[column]
                    entries = n + 1 if column.startswith(("observations", "next_observations", "infos/")) else n
                    if ds is None or ds.dtype != dtype or tuple(ds.shape) != (entries,) + shape:
                        got = "nothing" if ds is None else f"shape {ds.shape} and dtype {ds.dtype}"
                        raise ValueError(f"{self.description}: {name}/{path} holds {got}, but an episode of {n} "
                                         f"steps needs ({entries}, {', '.join(map(str, shape))}) of {dtype} "
                                         f"(mismatched lengths or a different layout than episode 0)")
                    ds.read_direct(buffers[column][pos:pos + n], np.s_[offset:offset + n], np.s_[0:n])
            except OSError as e:
                raise ValueError(f"{self.description}: cannot read {name} (truncated or damaged?): {e}") from None
            pos += n
        return {column: buf[:pos] for column, buf in buffers.items()}

    def close(self) -> None:
        """Close the file. Idempotent."""
        if self.file is not None:
            self.file.close()
            self.file = None
