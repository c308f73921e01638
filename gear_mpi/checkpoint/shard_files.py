"""One rank's part of a checkpoint: its column files, ``table.bin`` and ``shard.json``.

A rank's directory holds (format version 3)::

    columns.bin     the step columns laid out as the shard's arena (header, each column's ring at
                    its offset, steps at their ring positions, unused steps left as holes), so
                    that a load can map it (:mod:`~gear_mpi.checkpoint.arena_file`)
    table.bin       the shard's sections back to back: table rows in use, the order ring,
                    the free-slot stack, the priority index (names, dtypes and counts in
                    shard.json's ``table_layout``)
    shard.json      ring counters, sizes, index kind, the shard's and the rank's random
                    streams and counters; ``"column_layout": "arena"`` (absent in version 2)

Version 4 (background checkpoints, :mod:`~gear_mpi.checkpoint.segment_file`) has ``seg-NNNNN.bin``
files instead of ``columns.bin``, ``"column_layout": "segments"``.

Version 2 (still read) had ``column-NNN.bin`` per column instead of ``columns.bin``: the
ring steps in use, oldest first (``steps_used * step_bytes``).

The shard hands out and takes back its own state (:meth:`Shard.state`,
:meth:`Shard.sections`, :meth:`Shard.column_segments`, :meth:`Shard.load_state`,
:meth:`Shard.restore_sections`); this module only maps it to and from these files.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

import numpy as np

from ..errors import CheckpointError
from ..kernels import ring
from ..spec import TrajectorySpec
from . import arena_file, compressed_file, files, segment_file, table_blocks
from .files import SHARD_JSON, TABLE, CheckedFile, column_file, rank_dir, read_json, slices


# ---- writing -------------------------------------------------------------------------------------
def write_rank(directory: str, shard, rank_state: Mapping[str, Any]) -> dict[str, dict]:
    """Write ``shard``'s files into ``directory`` (which exists and is empty).

    Args:
        directory: this rank's directory of the checkpoint being assembled.
        shard: the rank's :class:`~gear_mpi.shard.Shard`.
        rank_state: the rank's own state beside the shard (:meth:`Replay.state`:
            ``rng``, ``windows_shared``, ``windows_mpi``).
    Returns:
        ``{file name: {"bytes", "sha256"}}`` for the manifest.
    Raises:
        OSError: writing failed.
    Cost: streams ``steps_used * step_bytes`` of columns (to their ring positions in ``columns.bin``) in chunks of
    :data:`~gear_mpi.checkpoint.files.CHUNK_BYTES` straight from the shard's memory,
    plus the table sections (about 70 bytes per slot in use).
    """
    out = {arena_file.COLUMNS: arena_file.write(os.path.join(directory, arena_file.COLUMNS), shard)}
    sections = shard.sections()
    meta = rank_meta(shard.state(), rank_state, sections)
    out[TABLE] = files.write_file(os.path.join(directory, TABLE), (np.ascontiguousarray(a) for _, a in sections))
    if shard.store.compressed:  # their chunks as stored, in a file of their own
        out[compressed_file.COMPRESSED], meta["compressed"] = compressed_file.write(
            os.path.join(directory, compressed_file.COMPRESSED), shard)
    out[SHARD_JSON] = files.write_file(os.path.join(directory, SHARD_JSON),
                                       [json.dumps(meta, sort_keys=True).encode()])
    return out


def rank_meta(state: Mapping[str, Any], rank_state: Mapping[str, Any], sections) -> dict[str, Any]:
    """A rank's ``shard.json`` (version-3 arena layout) from the shard's state and sections. O(sections).

    Args:
        state: :meth:`Shard.state`; rank_state: :meth:`Replay.state`; sections: :meth:`Shard.sections`.
    Returns:
        The JSON-able description (callers may change ``column_layout`` and add to it).
    """
    layout: list[list] = []  # consecutive sections of one name (the order ring's two halves) are one entry
    for name, arr in sections:
        if layout and layout[-1][0] == name:
            layout[-1][2] += len(arr)
        else:
            layout.append([name, arr.dtype.str, len(arr)])
    return {"rank": state["rank"], "state": [int(v) for v in state["ring"]], "hwm": int(state["hwm"]),
            "max_items": state["max_items"], "capacity_steps": state["capacity_steps"], "table_layout": layout,
            "index": state["index"], "rng_shard": state["rng"], "rng_replay": rank_state["rng"],
            "samples_drawn": int(state["samples_drawn"]), "stale_updates": int(state["stale_updates"]),
            "windows_shared": int(rank_state.get("windows_shared", 0)),
            "windows_mpi": int(rank_state.get("windows_mpi", 0)), "column_layout": "arena"}


def bytes_to_write(shard) -> int:
    """Bytes :func:`write_rank` will write for ``shard``, within a few kB (shard.json is left out). Local, O(columns).

    Args:
        shard: the rank's :class:`~gear_mpi.shard.Shard`.
    Returns:
        The columns' steps in use plus the table sections, in bytes.
    """
    total = sum(int(seg.nbytes) for c in shard.spec.columns if c.compression is None
                for seg in shard.column_segments(c.name))
    total += compressed_file.stored_bytes(shard)
    return total + sum(int(arr.nbytes) for _, arr in shard.sections())


# ---- reading -------------------------------------------------------------------------------------
def rank_files(where: str, body: dict, r: int) -> tuple[str, dict]:
    """Rank ``r``'s directory in checkpoint ``where`` and its files' manifest entries. O(1).

    Args:
        where: the checkpoint directory.
        body: the manifest body.
        r: the saved rank.
    Returns:
        ``(directory, {file name: {"bytes", "sha256"}})``.
    Raises:
        KeyError, IndexError: the manifest lists no such rank.
    """
    return os.path.join(where, rank_dir(r)), body["shards"][r]["files"]


def saved_bytes(body: dict, r: int, names=None) -> int:
    """Bytes of saved rank ``r``'s files (all, or those in ``names``), from the manifest. O(files).

    Args:
        body: the manifest body.
        r: the saved rank.
        names: file names to count (None: every file of the rank); ``table.bin`` among them counts a
            background checkpoint's table blocks too (:mod:`~gear_mpi.checkpoint.table_blocks`).
    Returns:
        The byte count.
    """
    entries = body["shards"][r]["files"]  # a v3 columns.bin: the bytes it holds, not its size with holes
    blocks = names is not None and TABLE in names
    return sum(int(e.get("data", e["bytes"])) for n, e in entries.items()
               if names is None or n in names or (blocks and table_blocks.is_table_file(n)))


def read_meta(where: str, body: dict, r: int) -> dict:
    """Read and check rank ``r``'s ``shard.json``. O(file size). Local.

    Args:
        where: the checkpoint directory.
        body: the manifest body.
        r: the saved rank.
    Returns:
        The parsed ``shard.json``.
    Raises:
        CheckpointError: missing, damaged, or not rank ``r``'s description.
    """
    d, entries = rank_files(where, body, r)
    meta = read_json(os.path.join(d, SHARD_JSON), entries.get(SHARD_JSON))
    if meta.get("rank") != r or len(meta.get("state", ())) != ring.STATE_SIZE:
        raise CheckpointError(f"{os.path.join(d, SHARD_JSON)}: not the description of rank {r}")
    return meta


def steps_used(meta: dict) -> int:
    """Ring steps in use by the shard ``meta`` describes (the length of each column file in steps). O(1).

    Args:
        meta: a rank's ``shard.json``.
    Returns:
        The step count.
    """
    return int(meta["state"][ring.STEPS_USED])


def ring_head(meta: dict) -> int:
    """The ring step of the oldest step in use (where each column file starts). O(1).

    Args:
        meta: a rank's ``shard.json``.
    Returns:
        The ring step.
    """
    return int(meta["state"][ring.STEP_HEAD])


def read_table(where: str, body: dict, r: int, meta: dict) -> dict[str, np.ndarray]:
    """Read and check rank ``r``'s ``table.bin`` (or its table blocks: :mod:`~gear_mpi.checkpoint.table_blocks`).
    O(file size). Local.

    Args:
        where: the checkpoint directory.
        body: the manifest body.
        r: the saved rank.
        meta: its ``shard.json`` (``table_layout`` names the sections).
    Returns:
        A new array per section name.
    Raises:
        CheckpointError: the file is missing, damaged or shorter than its layout.
    """
    d, entries = rank_files(where, body, r)
    if meta.get("table_block"):
        return table_blocks.read(d, entries, meta["table_layout"], int(meta["table_block"]))
    out = {}
    with CheckedFile(os.path.join(d, TABLE), entries.get(TABLE)) as c:
        for name, dtype, count in meta["table_layout"]:
            dst = np.empty(int(count), np.dtype(dtype))
            c.read_into(dst)
            out[name] = dst
        c.finish()
    return out


def _open_column(where: str, body: dict, r: int, meta: dict, index: int, step_bytes: int) -> CheckedFile:
    d, entries = rank_files(where, body, r)
    chk = CheckedFile(os.path.join(d, column_file(index)), entries.get(column_file(index)))
    used = steps_used(meta)
    if chk.size != used * step_bytes:
        chk.close()
        raise CheckpointError(f"{chk.filename}: {chk.size} bytes, but {used} steps of {step_bytes} bytes are in use")
    return chk


def check_columns(where: str, body: dict, r: int, meta: dict, spec: TrajectorySpec) -> None:
    """Check the size and sha256 of every column file of rank ``r``, reading each once and keeping nothing.

    Cost: reads ``steps_used * step_bytes`` bytes. Local.
    Args:
        where: the checkpoint directory.
        body: the manifest body.
        r: the saved rank.
        meta: its ``shard.json``.
        spec: the saved spec.
    Raises:
        CheckpointError: a column file missing, of the wrong size, or damaged.
    """
    if meta.get("column_layout") == segment_file.LAYOUT:
        d, entries = rank_files(where, body, r)
        compressed_file.check(d, entries, meta)
        segment_file.verify_rank(d, entries, meta, spec)
        return
    if is_arena(meta):
        d, entries = rank_files(where, body, r)
        compressed_file.check(d, entries, meta)
        arena_file.verify_file(os.path.join(d, arena_file.COLUMNS), entries.get(arena_file.COLUMNS), spec,
                               int(meta["capacity_steps"]), meta)
        return
    for i, c in enumerate(spec.columns):
        with _open_column(where, body, r, meta, i, c.step_bytes) as chk:
            chk.finish()


def is_arena(meta: dict) -> bool:
    """Whether rank ``meta``'s columns are one ``columns.bin`` laid out as the arena (version 3). O(1).

    Args:
        meta: a rank's ``shard.json``.
    Returns:
        True for version 3, False for version 2's ``column-NNN.bin`` files.
    """
    return meta.get("column_layout") == "arena"


def map_column(where: str, r: int, meta: dict, index: int, spec: TrajectorySpec, entries: dict | None = None):
    """Column ``index`` of rank ``r``'s files mapped read-only, read by place after the oldest step.

    Not checked here: call :func:`check_columns` first. O(1); pages are read on use.
    Args:
        where: the checkpoint directory.
        r: the saved rank.
        meta: its ``shard.json``.
        index: the column's position in the spec.
        spec: the saved spec.
        entries: the rank's manifest file entries (needed for a compressed column: its file is checked).
    Returns:
        ``steps(offset, length)`` -> ``[length, *shape]`` steps from ``offset`` steps after the
        oldest one in use (a view; a copy where a version-3 ring wraps).
    Raises:
        OSError, ValueError: the file is missing or too short.
    """
    if spec.columns[index].compression is not None:  # decompressed from the saved chunks
        return compressed_file.ring_reader(os.path.join(where, rank_dir(r)), entries or {}, meta, spec, index)
    if meta.get("column_layout") == segment_file.LAYOUT:
        return segment_file.ring_reader(os.path.join(where, rank_dir(r)), spec, meta, index)
    if is_arena(meta):
        return arena_file.ring_reader(os.path.join(where, rank_dir(r), arena_file.COLUMNS), spec,
                                      int(meta["capacity_steps"]), meta, index)
    column = spec.columns[index]
    filename = os.path.join(where, rank_dir(r), column_file(index))
    flat = np.memmap(filename, dtype=column.dtype, mode="r", shape=(steps_used(meta),) + column.shape)
    return lambda offset, length: flat[offset:offset + length]


def shard_state(meta: dict, tag: int) -> dict[str, Any]:
    """The :meth:`Shard.state` dictionary that ``shard.json`` and the manifest's ``tag`` describe. O(1).

    Args:
        meta: a rank's ``shard.json``.
        tag: the replay's key tag (from the manifest).
    Returns:
        As :meth:`Shard.state <gear_mpi.shard.Shard.state>` returns it.
    Raises:
        KeyError: a field missing from ``meta``.
    """
    return {"rank": meta["rank"], "capacity_steps": meta["capacity_steps"], "max_items": meta["max_items"],
            "hwm": int(meta["hwm"]), "ring": [int(v) for v in meta["state"]], "index": meta["index"],
            "rng": meta["rng_shard"], "samples_drawn": int(meta["samples_drawn"]),
            "stale_updates": int(meta["stale_updates"]), "tag": int(tag)}


def restore_rank(shard, where: str, body: dict, r: int, mapped: bool = False, verify: bool = True) -> dict:
    """Exact restore of rank ``r``'s shard into ``shard`` (of the saved capacity and max_items).

    Args:
        shard: a new, empty shard built with the saved spec, sampler and sizes.
        where: the checkpoint directory.
        body: the manifest body.
        r: the saved rank to restore.
        mapped: ``shard``'s arena is this rank's ``columns.bin`` mapped (``load(mmap=True)``):
            the steps are not read.
        verify: check the columns' sha256 (reading every step in use from the file, also when
            ``mapped``). Version-2 column files are always checked.
    Returns:
        The rank's ``shard.json`` (the rank's own streams are in it: ``rng_replay``,
        ``windows_shared``, ``windows_mpi``).
    Raises:
        CheckpointError: a file is missing or damaged, or does not fit ``shard``; the message names it.
    Cost: reads the rank's files once; the columns straight into the shard's ring (``mapped``:
    only the table and, with ``verify``, a hashing pass over the mapped steps).
    """
    meta = read_meta(where, body, r)
    d, _ = rank_files(where, body, r)
    own = shard.state()
    if meta["capacity_steps"] != own["capacity_steps"] or meta["max_items"] != own["max_items"]:
        raise CheckpointError(f"{os.path.join(d, SHARD_JSON)}: capacity or max_items differ from the manifest")
    if (meta["index"] == "none") != (own["index"] == "none"):
        raise CheckpointError(f"{os.path.join(d, SHARD_JSON)}: priority index {meta['index']!r} does not fit the "
                              f"sampler {shard.selector!r}")
    state = shard_state(meta, body["tag"])
    sections = read_table(where, body, r, meta)
    order = len(sections.get("order", ()))
    if order != meta["state"][ring.ORDER_COUNT]:
        raise CheckpointError(f"{os.path.join(d, TABLE)}: order ring has {order} entries, "
                              f"shard.json says {int(meta['state'][ring.ORDER_COUNT])}")
    try:
        shard.restore_sections(state, sections)
    except ValueError as e:
        raise CheckpointError(f"{os.path.join(d, TABLE)}: {e}") from None
    columns = os.path.join(d, arena_file.COLUMNS)
    entries = body["shards"][r]["files"]
    if mapped:
        if verify:
            arena_file.verify_file(columns, entries.get(arena_file.COLUMNS), shard.spec, shard.capacity_steps, meta)
    elif meta.get("column_layout") == segment_file.LAYOUT:
        segment_file.read_into(d, entries, shard, meta, verify)
    elif is_arena(meta):
        arena_file.read_into(columns, entries.get(arena_file.COLUMNS), shard, meta, verify)
    else:
        for i, c in enumerate(shard.spec.columns):
            with _open_column(where, body, r, meta, i, c.step_bytes) as chk:
                for seg in shard.column_segments(c.name):
                    for part in slices(seg):
                        chk.read_into(part)
                chk.finish()
    if shard.store.compressed:
        compressed_file.restore(shard, d, entries, meta, verify, mapped)
    shard.load_state(state)
    return meta
