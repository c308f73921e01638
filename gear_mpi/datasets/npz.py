"""A directory of ``.npz`` files, one episode each, as a dataset source (for
:func:`gear_mpi.datasets.from_npz_dir`).

Each file holds one array per column, all of the episode's length on their first axis;
every file has the same columns with the same per-step shapes and dtypes. Files are taken
in the order of their names. Opening reads each file's directory and array headers, not
the arrays.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np


def npz_header(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Name -> (shape, dtype) of each array of an ``.npz`` file, read from the headers only. Local.

    Raises:
        ValueError: not a readable zip of ``.npy`` arrays (a truncated or damaged file).
    """
    out = {}
    try:
        with zipfile.ZipFile(path) as z:
            for member in z.namelist():
                if not member.endswith(".npy"):
                    continue
                with z.open(member) as f:
                    version = np.lib.format.read_magic(f)
                    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                                   else np.lib.format.read_array_header_2_0)
                    shape, _, dtype = read_header(f)
                out[member[:-4]] = (tuple(shape), np.dtype(dtype))
    except Exception as e:  # noqa: BLE001 -- zipfile, zlib and numpy each raise their own kinds
        raise ValueError(f"{path}: not a readable .npz file (truncated or damaged?): {type(e).__name__}: {e}") from None
    return out


class NpzSource:
    """A directory of one-episode ``.npz`` files: their columns and lengths, and reads of whole episodes.

    Args:
        path: the directory.
    Raises:
        ValueError: not a directory, no ``.npz`` file in it, a damaged file, or a file whose columns,
            per-step shapes or dtypes differ from the first file's, or whose arrays differ in length
            (or have none).
    """

    def __init__(self, path: str | Path):
        root = Path(path)
        self.description = str(root)
        if not root.is_dir():
            raise ValueError(f"{root}: not a directory")
        self.files = sorted(root.glob("*.npz"))
        if not self.files:
            raise ValueError(f"{root}: no .npz files")
        first = npz_header(self.files[0])
        if not first:
            raise ValueError(f"{self.files[0]}: holds no arrays")
        self.columns = {k: (shape[1:], dtype) for k, (shape, dtype) in first.items()}
        lengths = np.empty(len(self.files), np.int64)
        for i, f in enumerate(self.files):
            header = npz_header(f) if i else first
            if sorted(header) != sorted(self.columns):
                raise ValueError(f"{f}: columns {sorted(header)}, but {self.files[0].name} has {sorted(self.columns)}")
            steps = set()
            for k, (shape, dtype) in header.items():
                if len(shape) == 0 or (shape[1:], dtype) != self.columns[k]:
                    raise ValueError(f"{f}: array {k!r} has shape {shape} and dtype {dtype}, but "
                                     f"{self.files[0].name} has steps of {self.columns[k][0]} x {self.columns[k][1]}")
                steps.add(shape[0])
            if len(steps) != 1 or 0 in steps:
                raise ValueError(f"{f}: its arrays have {sorted(steps)} steps; an episode's arrays have one "
                                 f"length, at least 1 (mismatched lengths)")
            lengths[i] = steps.pop()
        self.lengths = lengths
        self.open_last = False

    def read(self, first: int, stop: int, buffers: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The steps of episodes (files) ``first:stop`` back to back, read into ``buffers``. Local.

        Args:
            first, stop: episode indices.
            buffers: column -> array of at least their steps, of the column's dtype.
        Returns:
            Column -> a view of the front of its buffer holding those steps.
        Raises:
            ValueError: a file cannot be read, or no longer matches its header (changed since opened).
        """
        pos = 0
        for i in range(first, stop):
            n = int(self.lengths[i])
            try:
                with np.load(self.files[i], allow_pickle=False) as z:
                    for name in self.columns:
                        buffers[name][pos:pos + n] = z[name]
            except Exception as e:  # noqa: BLE001 -- zipfile, zlib and numpy each raise their own kinds
                raise ValueError(f"{self.files[i]}: cannot be read (truncated or damaged?): "
                                 f"{type(e).__name__}: {e}") from None
            pos += n
        return {name: buf[:pos] for name, buf in buffers.items()}

    def close(self) -> None:
        """Nothing to release (files are opened per read)."""
