"""A bare :class:`~gear_mpi.shard.Shard` saved and loaded whole, without MPI: one ``.npz`` file, or the same
arrays in memory (what pickling a shard's owner needs).

The arrays (:func:`shard_arrays`): ``meta`` (the JSON of the spec, sizes, selector and the shard's
:meth:`~gear_mpi.shard.Shard.state`, as uint8), ``section/<name>`` for each part of the table and
priority index (:meth:`~gear_mpi.shard.Shard.sections`) and ``column/<i>`` for each column's ring steps in
use, oldest first (:meth:`~gear_mpi.shard.Shard.column_segments`); a compressed column
(:class:`~gear_mpi.spec.Compressed`) is saved as its chunks are stored, ``compressed/<i>/<part>`` for the
parts of :meth:`~gear_mpi.storage.compressed.CompressedRing.export` (no recompression; every chunk's CRC-32
is checked at load, a corrupted one raising :class:`~gear_mpi.errors.CheckpointError` naming the column
and trajectories). :func:`shard_from_arrays` builds a new
shard from them and puts everything back where it was: the same items at the same ring steps, the same
keys, priorities, counters and random stream, so the next samples are those the saved shard would have
drawn. The file is written under a temporary name, fsynced and renamed over ``path``: a crash leaves the
old file or the new one. Local: no communication. For a distributed :class:`~gear_mpi.replay.Replay` use
its collective ``save``/``load`` (:mod:`gear_mpi.checkpoint`).
"""
from __future__ import annotations

import copyreg
import json
import os
import zipfile
from typing import Any, Mapping

import numpy as np

from ..errors import CheckpointError
from ..shard import Shard
from ..spec import TrajectorySpec
from .protocol import _make_sampler, _sampler_dict

def _reduce(shard: Shard):
    """How ``pickle``, ``copy.copy`` and ``copy.deepcopy`` take a :class:`~gear_mpi.shard.Shard` (registered with
    ``copyreg`` when gear_mpi is imported): a new, independent shard in private host memory (a host index)
    holding the same items at the same ring steps, with the same keys, priorities, counters and stream. A copy
    that shared the original's memory (a shallow copy) would also share its closing. Cost: as
    :func:`shard_arrays`, then :func:`shard_from_arrays`. Raises: RuntimeError: the shard is closed."""
    return shard_from_arrays, (shard_arrays(shard),)


FORMAT = "gear_mpi.shard"
VERSION = 1
#: the arrays of a compressed column (``compressed/<i>/<part>``: ``CompressedRing.export``'s)
COMPRESSED_PARTS = ("sizes", "crc", "heap", "open", "geometry")


def shard_arrays(shard: Shard) -> dict[str, np.ndarray]:
    """Everything ``shard`` holds, as named arrays (copies: the shard may change afterwards).

    Args:
        shard: an open shard (its selection index on the host or the GPU).
    Returns:
        Name -> array, as the module docstring lists them.
    Raises:
        RuntimeError: the shard is closed.
    Cost: O(steps in use * step_bytes + slots used) copied. Local.
    """
    shard._check_open()
    meta = {"format": FORMAT, "version": VERSION, "spec": shard.spec.to_dict(), "capacity_steps": shard.capacity_steps,
            "max_items": shard.store.max_items, "max_times_sampled": shard.max_times_sampled or None,
            "sampler": _sampler_dict(shard.selector), "state": shard.state()}
    out = {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8).copy()}
    parts: dict[str, list[np.ndarray]] = {}
    for name, arr in shard.sections():  # a name may come twice (the order ring's two halves)
        parts.setdefault(name, []).append(np.asarray(arr))
    for name, arrs in parts.items():
        out["section/" + name] = np.concatenate(arrs) if len(arrs) > 1 else arrs[0].copy()
    for i, c in enumerate(shard.spec.columns):
        if c.compression is not None:  # its chunks as stored (no recompression), checked again at load
            for part, arr in shard.store.compressed[c.name].export().items():
                out[f"compressed/{i}/{part}"] = arr
            continue
        out[f"column/{i}"] = np.concatenate([np.asarray(v) for v in shard.column_segments(c.name)]
                                            or [np.zeros(0, np.uint8)])
    return out


def shard_from_arrays(arrays: Mapping[str, np.ndarray], **overrides: Any) -> Shard:
    """A new shard holding what :func:`shard_arrays` took from another.

    Args:
        arrays: as :func:`shard_arrays` returns them (or an ``np.load`` of a saved file).
        overrides: further :class:`~gear_mpi.shard.Shard` arguments (``memory``, ``path``,
            ``device_context``); the sizes, selector, rank and key tag are the saved ones.
    Returns:
        The shard (its owner closes it).
    Raises:
        CheckpointError: arrays that are not a saved shard, of an unknown version, or that do not fit together.
    Cost: O(steps in use * step_bytes + slots used). Local.
    """
    try:
        meta = json.loads(bytes(np.asarray(arrays["meta"], np.uint8)))
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"not a saved gear_mpi shard: no readable 'meta' ({e})") from None
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"not a saved gear_mpi shard of version {VERSION}: format {meta.get('format')!r}, "
                              f"version {meta.get('version')!r}")
    try:  # what the saved meta must hold: a missing or bad field is the file's fault, not the caller's
        spec = TrajectorySpec.from_dict(meta["spec"])
        state = meta["state"]
        sampler = _make_sampler(meta["sampler"], "saved shard")
        sizes = {name: meta[name] for name in ("capacity_steps", "max_items", "max_times_sampled")}
        for name, v in sizes.items():
            if not (v is None and name != "capacity_steps") and (isinstance(v, bool) or not isinstance(v, int)
                                                                 or v < (0 if name == "max_times_sampled" else 1)):
                raise ValueError(f"{name}={v!r} is not a valid size")
        kwargs = {"max_items": sizes["max_items"], "max_times_sampled": sizes["max_times_sampled"],
                  "rank": state["rank"], "tag": state["tag"], "seed": None, **overrides}
    except (KeyError, ValueError, TypeError) as e:
        why = f"lacks {e}" if isinstance(e, KeyError) else f"is invalid: {e}"
        raise CheckpointError(f"not a saved gear_mpi shard: its meta {why}") from None
    shard = Shard(spec, sizes["capacity_steps"], sampler, **kwargs)
    try:
        sections = {k[len("section/"):]: np.asarray(v) for k, v in arrays.items() if k.startswith("section/")}
        shard.restore_sections(state, sections)
        for i, c in enumerate(spec.columns):
            if c.compression is not None:
                parts = {p: np.asarray(arrays[f"compressed/{i}/{p}"]) for p in COMPRESSED_PARTS}
                shard.store.compressed[c.name].restore(
                    parts, lambda j, name=c.name: shard.store.describe_chunk(name, j))
                continue
            data = np.asarray(arrays[f"column/{i}"], np.uint8).reshape(-1)
            segments = shard.column_segments(c.name)
            if data.nbytes != sum(s.nbytes for s in segments):
                raise ValueError(f"column {c.name!r}: {data.nbytes} bytes saved for "
                                 f"{sum(s.nbytes for s in segments)} bytes of steps in use")
            at = 0
            for seg in segments:
                seg[:] = data[at:at + seg.nbytes]
                at += seg.nbytes
        shard.load_state(state)
    except (KeyError, ValueError, TypeError) as e:
        shard.close()
        raise CheckpointError(f"saved shard does not fit together: {e}") from None
    except BaseException:
        shard.close()
        raise
    return shard


def save_shard(shard: Shard, path: str | os.PathLike) -> None:
    """Write ``shard`` to the file ``path`` (``.npz``; crash-safe: written aside, fsynced, renamed).

    Args:
        shard: an open shard.
        path: the file to write (replaced if it exists).
    Raises:
        RuntimeError: the shard is closed.
        OSError: the file cannot be written (nothing is left at ``path`` but what was there).
    Cost: :func:`shard_arrays`' copy, then one sequential write. Local.
    """
    path = os.fspath(path)
    arrays = shard_arrays(shard)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_shard(path: str | os.PathLike, **overrides: Any) -> Shard:
    """The shard saved at ``path`` by :func:`save_shard`, exactly as it was.

    Args:
        path: the file.
        overrides: as :func:`shard_from_arrays`.
    Returns:
        A new shard.
    Raises:
        CheckpointError: the file is missing, truncated, corrupted (zip checksums) or not a saved shard.
    Cost: one read of the file, then :func:`shard_from_arrays`. Local.
    """
    path = os.fspath(path)
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path}: cannot read a saved shard ({type(e).__name__}: {e})") from None
    return shard_from_arrays(arrays, **overrides)


copyreg.pickle(Shard, _reduce)
