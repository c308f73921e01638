"""Offline datasets into a replay: every rank reads its own share of the episodes, in parallel.

    replay = gm.datasets.from_d4rl("hopper-medium-v2.hdf5", comm, sampler=gm.Uniform(), seed=0)
    replay = gm.datasets.from_npz_dir("episodes/", comm)
    replay = gm.datasets.from_minari("D4RL/door/human-v2", comm)   # a local Minari dataset (id or directory)

All are collective and return a filled :class:`~gear_mpi.replay.Replay` (one trajectory
per episode, columns named after the datasets or arrays). The episodes are cut into one
contiguous run per rank, balanced by steps; each rank reads only its run, in chunks, each
inserted with one ``insert_packed``. ``replay.dataset_info`` tells what was read (see
:func:`gear_mpi.datasets.load.load_dataset`). Modules: :mod:`.episodes` (episode split, shares),
:mod:`.load` (the collective load), :mod:`.d4rl`, :mod:`.npz` and :mod:`.minari_files` (the sources).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..replay import Replay
from .d4rl import D4RLSource
from .episodes import balanced_shares, split_episodes
from .load import CHUNK_BYTES, load_dataset
from .minari_files import MinariSource
from .npz import NpzSource

__all__ = ["from_d4rl", "from_npz_dir", "from_minari", "split_episodes", "balanced_shares"]


def from_d4rl(path: str | Path, /, comm=None, *, columns: Sequence[str] | None = None, max_length: int | None = None,
              progress: bool | None = None, chunk_bytes: int = CHUNK_BYTES, headroom: int | None = None,
              **replay_kwargs) -> Replay:
    """A replay holding a D4RL-layout HDF5 file, one trajectory per episode (needs h5py:
    ``pip install gear-mpi[datasets]``).

    Episodes end at a step whose ``terminals`` or ``timeouts`` flag is set; steps after the last
    end form one more episode, kept and flagged (``replay.dataset_info["open_last_episode"]`` and
    ``["open_episode_key"]``). Columns are named after the datasets (``"observations"``, ...,
    ``"infos/qpos"``) with their dtypes. Collective: every rank opens the file and reads the
    steps of its own episodes only (see :func:`gear_mpi.datasets.load.load_dataset`).

    Args:
        path: the file (the same file on every rank, e.g. on a shared file system); positional only, so
            that ``path=`` goes to the replay (``memory="file", path=DIR``: shards in memory-mapped files).
        comm: the mpi4py communicator (None: ``MPI.COMM_WORLD``).
        columns: the datasets to load (None: the five required ones, ``next_observations`` if present,
            every dataset of ``infos``).
        max_length: the spec's max_length (None: the longest episode; a longer episode is an error).
        progress: report the bytes read by all ranks on rank 0's stderr once the load has lasted 2 s (a
            tqdm bar on a terminal, plain lines otherwise, e.g. under ``mpiexec``); None: yes unless
            ``GEAR_MPI_PROGRESS=0``; False: never (see :mod:`gear_mpi.progress`).
        chunk_bytes: steps read and inserted at a time (whole episodes).
        headroom: free steps each shard keeps beyond the largest rank's share, so that inserts after the
            load evict nothing until they fill it (None: ``max_length``, room for one more longest
            episode; 0: the shards are exactly full and the first insert evicts the oldest episode).
            Only without ``capacity_steps``.
        **replay_kwargs: :class:`~gear_mpi.replay.Replay`'s arguments (``sampler``, ``mode``, ``seed``,
            ``timeout``, ...); ``capacity_steps`` defaults to the largest rank's share plus ``headroom``.
    Returns:
        The filled replay.
    Raises:
        ValueError: on every rank: a missing, truncated or damaged file, a required dataset missing, a
            file of no steps, mismatched lengths, a non-numeric dataset, an episode over ``max_length``, a share over
            ``capacity_steps``, a bad ``headroom`` or one given with ``capacity_steps``, or a read that
            failed (the replay is then closed).
        ImportError: h5py is missing.
        CollectiveTimeoutError: a rank did not arrive within ``timeout``.
    """
    return load_dataset(lambda: D4RLSource(path, columns), "from_d4rl", comm, max_length, progress, chunk_bytes,
                        replay_kwargs, headroom)


def from_npz_dir(path: str | Path, /, comm=None, *, max_length: int | None = None, progress: bool | None = None,
                 chunk_bytes: int = CHUNK_BYTES, headroom: int | None = None, **replay_kwargs) -> Replay:
    """A replay holding a directory of ``.npz`` files, one episode per file (in name order), one
    trajectory per episode, columns named after the arrays.

    Collective, as :func:`from_d4rl`: every rank reads the files' headers, then the files of its own
    episodes only.

    Args:
        path: the directory (the same on every rank); positional only (``path=`` is the replay's, as in
            :func:`from_d4rl`).
        comm, max_length, progress, chunk_bytes, headroom, **replay_kwargs: as :func:`from_d4rl`.
    Returns:
        The filled replay.
    Raises:
        ValueError: on every rank: not a directory, no ``.npz`` file, a damaged file, files whose
            columns, shapes or dtypes differ, arrays of one file of different lengths, an episode over
            ``max_length``, a share over ``capacity_steps``, or a read that failed.
        CollectiveTimeoutError: a rank did not arrive within ``timeout``.
    """
    return load_dataset(lambda: NpzSource(path), "from_npz_dir", comm, max_length, progress, chunk_bytes, replay_kwargs,
                        headroom)


def from_minari(dataset: str | Path, /, comm=None, *, columns: Sequence[str] | None = None,
                next_observations: bool = True, max_length: int | None = None, progress: bool | None = None,
                chunk_bytes: int = CHUNK_BYTES, headroom: int | None = None, **replay_kwargs) -> Replay:
    """A replay holding a local Minari dataset (HDF5 storage), one trajectory per episode (needs h5py:
    ``pip install gear-mpi[datasets]``; the ``minari`` package is not needed to read).

    Each episode of ``T`` steps becomes a trajectory of ``T`` rows: ``observations`` (the first ``T`` of
    Minari's ``T + 1``), ``next_observations`` (the last ``T``), ``actions``, ``rewards``, ``terminations``,
    ``truncations``, with the dataset's dtypes; Dict/Tuple spaces give one column per leaf
    (``observations/pos``). Layout and column names: :mod:`gear_mpi.datasets.minari_files`. Collective, as
    :func:`from_d4rl`: every rank opens the dataset and reads the episodes of its own share only.

    Args:
        dataset: the dataset's directory (``<root>/<id>`` or its ``data/``), or a dataset id
            (``"cartpole/random-v0"``) under Minari's local root (``$MINARI_DATASETS_PATH``, else
            ``~/.minari/datasets``); the same on every rank. Positional only (``path=`` is the replay's).
        comm: the mpi4py communicator (None: ``MPI.COMM_WORLD``).
        columns: the columns to load (``infos/<key>`` included: the info each step returned); None: every
            observation, next-observation and action column, rewards, terminations, truncations.
        next_observations: with ``columns=None``, load ``next_observations`` too (False: half the observation
            memory; each episode's last observation is then not loaded).
        max_length, progress, chunk_bytes, headroom, **replay_kwargs: as :func:`from_d4rl`.
    Returns:
        The filled replay; ``replay.dataset_info`` as :func:`from_d4rl` gives it (``open_last_episode`` is
        False), plus ``"metadata"``: the dataset's ``metadata.json`` (``dataset_id``, ``env_spec``, ...).
    Raises:
        ValueError: on every rank: no such directory or local id, not a Minari dataset (no ``metadata.json``),
            a data format other than HDF5, a missing or damaged ``main_data.hdf5``, a missing episode, a
            non-numeric column (text, JPEG-encoded images), an unknown column, an episode whose datasets
            have mismatched lengths or another layout than episode 0 (found when read: the replay is then
            closed), an episode over ``max_length``, a share over ``capacity_steps``, a bad ``headroom``.
        ImportError: h5py is missing.
        CollectiveTimeoutError: a rank did not arrive within ``timeout``.
    """
    opened = []

    def open_source() -> MinariSource:
        opened.append(MinariSource(dataset, columns, next_observations))
        return opened[-1]

    replay = load_dataset(open_source, "from_minari", comm, max_length, progress, chunk_bytes, replay_kwargs,
                          headroom)
    replay.dataset_info["metadata"] = opened[-1].metadata
    return replay
