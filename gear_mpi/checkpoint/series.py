"""A directory of numbered checkpoints: names, the newest complete one, installing and pruning.

Background checkpoints (:mod:`~gear_mpi.checkpoint.background`) go to ``directory/ckpt-00000001``,
``ckpt-00000002``, ... A checkpoint is *complete* once its ``MANIFEST.json`` exists: rank 0 writes it
last (to a temporary name, fsynced, then renamed, so it is whole or absent), after every rank has
finished its files (each rank says so with ``rank-NNNNN/done.json``, also written aside and renamed).
A directory without a manifest is an interrupted or failed checkpoint: never read, removed by a later
prune. Each complete checkpoint is a checkpoint of its own (:func:`gear_mpi.checkpoint.load` reads it),
whatever happens to the others: files shared with other checkpoints are hard links, so deleting one
checkpoint never takes another's data.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

from ..errors import CheckpointError
from . import files
from .files import MANIFEST, rank_dir, read_manifest

PREFIX = "ckpt-"
_NAME = re.compile(r"^ckpt-(\d{8})$")
DONE = "done.json"      # a rank's files are whole: its manifest entries, items and steps
FAILED = "failed.json"  # a rank could not write its files: the error


def dir_name(seq: int) -> str:
    """The directory name of checkpoint number ``seq`` (``ckpt-00000007``). O(1)."""
    return f"{PREFIX}{int(seq):08d}"


def listing(directory) -> list[tuple[int, str]]:
    """The numbered checkpoint directories in ``directory``, complete or not, oldest first. O(entries).

    Args:
        directory: a directory of checkpoints (missing: an empty list).
    Returns:
        ``(number, path)`` pairs.
    """
    directory = os.fspath(directory)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        m = _NAME.match(n)
        if m and os.path.isdir(os.path.join(directory, n)):
            out.append((int(m[1]), os.path.join(directory, n)))
    return sorted(out)


def is_complete(path: str) -> bool:
    """Whether checkpoint directory ``path`` has a valid manifest that matches its rank directories.
    Local; reads the manifest only (the files' checksums are checked by a load or ``verify``)."""
    try:
        read_manifest(path)
        return True
    except (CheckpointError, OSError, ValueError, KeyError, TypeError):
        return False


def latest(directory) -> Path | None:
    """The newest complete checkpoint in a directory of checkpoints, or None. Local, no communication.

    A checkpoint is complete once its manifest is written (see the module docstring); interrupted ones
    (a job killed while writing) are passed over. Only the numbered ``ckpt-NNNNNNNN`` directories of
    background checkpoints count (not a ``Replay.save`` directory placed there).

    Args:
        directory: the directory given to ``Replay.checkpoint_every`` (str or os.PathLike).
    Returns:
        The checkpoint's path (load it with ``Replay.load``), or None when there is none (or no directory).
    Raises:
        TypeError: ``directory`` is not a path.
    Cost: one directory listing and a manifest read per checkpoint tried, newest first.
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a str or os.PathLike, got {type(directory).__name__}")
    for _, path in reversed(listing(directory)):
        if is_complete(path):
            return Path(path)
    return None


def next_number(directory) -> int:
    """One more than the highest checkpoint number in ``directory``, complete or not (1 when none). O(entries)."""
    found = listing(directory)
    return found[-1][0] + 1 if found else 1


def write_marker(rank_directory: str, name: str, doc: dict) -> None:
    """Write ``doc`` as JSON to ``rank_directory/name`` atomically (aside, fsynced, renamed). O(doc)."""
    tmp = os.path.join(rank_directory, name + ".tmp")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    files.write_file(tmp, [json.dumps(doc, sort_keys=True).encode()])
    os.rename(tmp, os.path.join(rank_directory, name))
    files.fsync_dir(rank_directory)


def collect(path: str, ranks: int, deadline: float, poll: float = 0.1, stop=None) -> list[dict]:
    """Rank 0: wait for every rank's ``done.json`` in checkpoint ``path``; return them in rank order.

    Args:
        path: the checkpoint directory; ranks: how many ranks write into it;
        deadline: ``time.monotonic()`` past which to give up;
        stop: a :class:`threading.Event` whose setting means give up now (None: none).
    Returns:
        Each rank's ``{"rank", "items", "steps_used", "files"}``.
    Raises:
        CheckpointError: a rank wrote ``failed.json`` (its error), the deadline passed (naming the
            ranks not finished), or ``stop`` was set.
    Cost: a stat per rank not yet finished every 5 ms at first, then less and less often (every ``poll``
    seconds at most: each stat is a GIL handover of the thread calling it); a small read per rank.
    """
    found: dict[int, dict] = {}
    wait = 0.005
    while True:
        for r in range(ranks):
            if r in found:
                continue
            d = os.path.join(path, rank_dir(r))
            failed = os.path.join(d, FAILED)
            if os.path.exists(failed):
                with open(failed) as f:
                    raise CheckpointError(f"{path}: rank {r} could not write its files: {json.load(f)['error']}")
            done = os.path.join(d, DONE)
            if os.path.exists(done):
                with open(done) as f:
                    found[r] = json.load(f)
        if len(found) == ranks:
            return [found[r] for r in range(ranks)]
        if time.monotonic() > deadline:
            missing = [r for r in range(ranks) if r not in found]
            raise CheckpointError(f"{path}: ranks {missing} did not finish their files in time (dead or hung?)")
        if stop is not None and stop.wait(wait):
            raise CheckpointError(f"{path}: stopped waiting for the files of ranks "
                                  f"{[r for r in range(ranks) if r not in found]} (they failed)")
        if stop is None:
            time.sleep(wait)
        wait = min(poll, wait * 1.5)


def install(path: str, body: dict, version: int) -> None:
    """Rank 0: make checkpoint ``path`` complete: its manifest written aside, fsynced, renamed in. O(body).

    Raises:
        OSError: the file system refused.
    """
    tmp = MANIFEST + ".tmp"
    if os.path.lexists(os.path.join(path, tmp)):
        os.unlink(os.path.join(path, tmp))
    files.write_manifest(path, body, version, tmp)
    os.rename(os.path.join(path, tmp), os.path.join(path, MANIFEST))
    files.fsync_dir(path)


def prune(directory, keep: int, busy: int | None = None) -> list[str]:
    """Rank 0: delete all but the newest ``keep`` complete checkpoints, and incomplete ones older than the
    newest complete one (interrupted or failed: nothing links to them any more). Never ``busy`` (the
    checkpoint being written) nor anything newer than the newest complete one.

    Returns:
        The directories removed. Cost: a listing, a manifest read per checkpoint, the deletions.
    """
    found = listing(directory)
    complete = [seq for seq, p in found if is_complete(p)]
    if not complete:
        return []
    kept = set(complete[-keep:])
    newest = complete[-1]
    gone = []
    for seq, p in found:
        if seq in kept or seq == busy or seq > newest:
            continue
        shutil.rmtree(p, ignore_errors=True)
        gone.append(p)
    if gone:
        files.fsync_dir(os.fspath(directory))
    return gone


def agree_latest(directory, comm=None, timeout: float = 60.0) -> Path | None:
    """Collective: :func:`latest` on every rank, checked to be the same checkpoint everywhere.

    Args:
        directory: a directory of checkpoints; comm: the mpi4py communicator (default COMM_WORLD);
        timeout: seconds to wait for every rank.
    Returns:
        The newest complete checkpoint, or None (on every rank alike).
    Raises:
        TypeError: ``directory`` is not a path (every rank).
        CheckpointError: the ranks see different newest checkpoints (is the directory on a file system
            every rank sees?), on every rank.
        CollectiveTimeoutError: a rank did not arrive within ``timeout``.
    Cost: a listing and manifest reads per rank, one allgather of 16 bytes a rank.
    """
    from ..distributed.comm import MpiComm
    mc = MpiComm(comm, timeout)
    mc.check_usable()
    err, seq = None, -1
    try:
        found = latest(directory)
        seq = -1 if found is None else int(_NAME.match(found.name)[1])
    except Exception as e:
        err = e
    table = mc.agree(err, "load_latest", [seq])
    seqs = sorted({int(v) for v in table[:, 0].tolist()})
    if len(seqs) > 1:
        raise CheckpointError(f"load_latest: the ranks see different newest checkpoints in {os.fspath(directory)} "
                              f"(numbers {seqs}); is it on a file system that every rank sees?")
    return None if seqs[0] < 0 else Path(os.path.abspath(os.fspath(directory))) / dir_name(seqs[0])
