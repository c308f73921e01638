"""Derived columns of a sample: where their frames come from, and their rebuild into a batch.

A spec's derived columns (:mod:`gear_mpi.frames`) are rebuilt by the process that fills the batch,
from a source it can read: its own ring or a node peer's mapped one (given by the choices and each
window's *context*, how many of its trajectory's steps before it may be read), or the context windows
an owner on another node sent (:func:`pack_context`): a window's ``before + n_valid + tail`` source steps,
fewer bytes than the rebuilt stacks (``context_steps`` against ``frames`` steps per window step and column).
"""
from __future__ import annotations

import numpy as np

from ..kernels import frames as frame_kernels
from ..kernels import gather as gather_kernels
from ..spec import TrajectorySpec


def context_of(spec: TrajectorySpec, slots: np.ndarray, choice_start: np.ndarray, traj_start: np.ndarray,
               capacity: int) -> np.ndarray:
    """Owner side: each window's context, ``min(its offset in its trajectory, spec.context_before)``. O(B), local.

    Args:
        spec: the columns.
        slots: the slot of each window's trajectory (int64).
        choice_start: each window's first ring step (int64, in the ring).
        traj_start: the table's ring start of every slot.
        capacity: steps in the ring.
    Returns:
        int64, one per window.
    """
    out = np.empty(len(slots), np.int64)
    frame_kernels.context_before(np.ascontiguousarray(slots, np.int64), np.ascontiguousarray(choice_start, np.int64),
                                 traj_start, capacity, spec.context_before, out)
    return out


def rebuild_derived(spec: TrajectorySpec, addresses: np.ndarray, capacity: int, win_start: np.ndarray,
                    before: np.ndarray, n_valid: np.ndarray, pad_front: np.ndarray, rows: np.ndarray,
                    outs: tuple[np.ndarray, ...], window: int) -> None:
    """Fill the derived columns of batch rows ``rows`` from a source ring (one kernel call per column).

    Cost: per derived column, ``frames`` step copies per real window step (parallel over windows); local.
    Args:
        spec: the columns.
        addresses: the address of each stored column's source ring (int64, in column order; kept mapped).
        capacity: steps in the source rings.
        win_start, before, n_valid, pad_front, rows: int64, one per window (see :mod:`gear_mpi.kernels.frames`).
        outs: the batch's derived columns as flat bytes (``Batch.derived_views``).
        window: steps per window.
    Raises:
        ValueError: a window outside the source or the batch (nothing written for that column).
    """
    if len(rows) == 0:
        return
    args = [np.ascontiguousarray(a, np.int64) for a in (win_start, before, n_valid, pad_front, rows)]
    for d, out in zip(spec.derived, outs):
        src = spec.names.index(d.source)
        frame_kernels.rebuild_frames(int(addresses[src]), capacity, spec[d.source].step_bytes, *args, d.frames,
                                     d.offset, d.pad == "zeros", out, window)


def context_steps(spec: TrajectorySpec, window: int) -> int:
    """Source steps a context window holds: ``context_before + window + tail_steps``. O(1)."""
    return spec.context_before + window + spec.tail_steps


def sources(spec: TrajectorySpec) -> tuple[str, ...]:
    """The stored columns the derived ones are made of, in column order. O(columns)."""
    used = {d.source for d in spec.derived}
    return tuple(n for n in spec.names if n in used)


def compressed_sources(spec: TrajectorySpec) -> bool:
    """Whether a derived column's source is stored compressed (``Column.compression``, where this gear_mpi
    has compressed columns): its ring holds no raw frames to read in place, so the frames are first
    decompressed into context windows (:func:`pack_context`). O(columns)."""
    return any(getattr(spec[name], "compression", None) is not None for name in sources(spec))


def pack_context(spec: TrajectorySpec, views: dict, capacity: int, win_start: np.ndarray, before: np.ndarray,
                 n_valid: np.ndarray, window: int, store=None, keys: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Owner side, for requesters on other nodes: each window's context window of each source column,
    ``before + n_valid + tail`` ring steps from ``win_start - before``, in rows of :func:`context_steps`
    steps (zero after the real ones). Cost: one gather per source column; local.

    Args:
        spec: the columns.
        views: stored column name -> the ring as flat bytes.
        capacity: steps in the ring.
        win_start, before, n_valid: int64, one per window sent.
        window: steps per window.
        store: the shard's store, for a compressed source (decompressed by its ``gather_compressed``).
        keys: each window's trajectory key, named by a corrupted chunk's error (None: "a sampled window").
    Returns:
        Source column name -> flat uint8 buffer of ``len(win_start) * context_steps * step_bytes`` bytes.
    """
    e = context_steps(spec, window)
    n = len(win_start)
    starts = (np.asarray(win_start, np.int64) - before) % capacity
    valid = np.where(n_valid > 0, before + n_valid + spec.tail_steps, 0).astype(np.int64)
    out = {}
    for name in sources(spec):
        sb = spec[name].step_bytes
        buf = np.empty(n * e * sb, np.uint8)
        if n and getattr(spec[name], "compression", None) is not None:
            store.gather_compressed(starts, valid, np.zeros(n, np.int64), np.arange(n, dtype=np.int64), {name: buf}, e,
                                    keys)
        elif n:
            gather_kernels.gather_windows(views[name], capacity, sb, starts, valid, np.zeros(n, np.int64),
                                          np.arange(n, dtype=np.int64), buf, e)
        out[name] = buf
    return out


def rebuild_local(spec: TrajectorySpec, store, addresses: np.ndarray, win_start: np.ndarray, before: np.ndarray,
                  n_valid: np.ndarray, pad_front: np.ndarray, rows: np.ndarray, outs: tuple[np.ndarray, ...],
                  window: int, stored: dict | None = None, keys: np.ndarray | None = None) -> None:
    """The derived columns of rows ``rows`` from this process's own store: read in place from the rings
    (:func:`rebuild_derived`), or, when a source is compressed, straight from its decoded chunks
    (:func:`fill_from_chunks`, which also fills the source columns named in ``stored``: the windows' chunks
    decoded once for both; where the compiled decoder does not load, through context windows decompressed
    first: :func:`pack_context`, :func:`rebuild_from_context`, and ``stored`` by ``store.gather_compressed``).
    Local; cost as those.

    Args:
        spec: the columns; store: the shard's store (its ``capacity`` and views).
        addresses: the address of each stored column's ring (``Shard.column_addresses()[0]``).
        win_start, before, n_valid, pad_front, rows: int64, one per window.
        outs: the batch's derived columns as flat bytes; window: steps per window.
        stored: source column name -> its batch bytes, for the sources :func:`chunk_sources` names (their
            windows written here); None: none.
        keys: each window's trajectory key (named by a corrupted chunk's error), or None.
    Raises:
        CorruptDataError: a compressed chunk read is corrupted.
    """
    stored = stored or {}
    if not compressed_sources(spec):
        rebuild_derived(spec, addresses, store.capacity, win_start, before, n_valid, pad_front, rows, outs, window)
        return
    args = [np.ascontiguousarray(a, np.int64) for a in (win_start, before, n_valid, pad_front, rows)]
    if fill_from_chunks(spec, store, *args, stored, outs, window, keys):  # stacks straight from the decoded chunks
        return
    if stored:
        store.gather_compressed(args[0], args[2], args[3], args[4], stored, window, keys)
    buffers = pack_context(spec, store.byte_views(), store.capacity, win_start, before, n_valid, window, store)
    rebuild_from_context(spec, buffers, before, n_valid, pad_front, rows, outs, window)


def chunk_sources(spec: TrajectorySpec, store) -> frozenset:
    """The compressed source columns of the derived ones whose windows :func:`fill_from_chunks` writes with the
    stacks (every source compressed and the compiled decoder loaded), or none: a caller leaves those to it
    rather than decoding their chunks twice. O(columns)."""
    if not spec.derived or not compressed_sources(spec):
        return frozenset()
    rings = [store.compressed.get(name) for name in sources(spec)]
    if any(r is None or r.decoder() is None for r in rings):
        return frozenset()
    return frozenset(sources(spec))


def rebuild_from_context(spec: TrajectorySpec, buffers: dict[str, np.ndarray], before: np.ndarray,
                         n_valid: np.ndarray, pad_front: np.ndarray, rows: np.ndarray, outs: tuple[np.ndarray, ...],
                         window: int) -> None:
    """Requester side: the derived columns of rows ``rows`` from received context windows (row ``i`` of each
    buffer is window ``i``'s, as :func:`pack_context` made it). Cost: as :func:`rebuild_derived`; local.

    Args:
        spec: the columns.
        buffers: source column name -> the received context windows (flat bytes, C-contiguous).
        before, n_valid, pad_front, rows: int64, one per received window.
        outs: the batch's derived columns as flat bytes.
        window: steps per window.
    """
    n = len(rows)
    if n == 0:
        return
    e = context_steps(spec, window)
    addresses = np.zeros(len(spec.names), np.int64)
    for name, buf in buffers.items():
        addresses[spec.names.index(name)] = buf.ctypes.data
    rebuild_derived(spec, addresses, n * e, np.arange(n, dtype=np.int64) * e + before, before, n_valid,
                    pad_front, rows, outs, window)


def fill_unstored(spec: TrajectorySpec, store, ring_addresses: np.ndarray, slots: np.ndarray, choices: np.ndarray,
                  batch, window: int) -> None:
    """A local sample's columns the gather kernel leaves out: compressed ones decompressed into the batch
    (``store.gather_compressed``), then derived ones rebuilt from this ring. Nothing to do without either.

    Cost: decompression of the chunks the windows cover; ``frames`` step copies per window step and derived
    column. Local.
    Args:
        spec: the columns; store: the shard's store; ring_addresses: its stored columns' ring addresses
        (``Shard.column_addresses()[0]``); slots, choices: the sample's (``Shard.make_choices``); batch: the
        :class:`~gear_mpi.batch.Batch` being filled; window: steps per window.
    """
    if not (store.compressed or spec.derived):
        return
    fields = gather_kernels.choice_records(choices)
    rows = np.arange(len(choices), dtype=np.int64)
    outs = dict(zip(spec.names, batch.byte_views()))
    if spec.derived and compressed_sources(spec):  # each chunk decoded once: the windows' own steps are in the context
        start, valid, pad = (np.ascontiguousarray(fields[f], np.int64) for f in ("start", "valid", "pad_front"))
        context = context_of(spec, slots, start, store.start, store.capacity)
        if fill_from_chunks(spec, store, start, context, valid, pad, rows, outs, batch.derived_views(), window,
                            fields["key"]):
            return
        buffers = pack_context(spec, store.byte_views(), store.capacity, start, context, valid, window, store,
                               fields["key"])
        store.gather_compressed(start, valid, pad, rows, {n: b for n, b in outs.items()
                                                          if n in store.compressed and n not in buffers},
                                window, fields["key"])
        e = context_steps(spec, window)
        for name, buf in buffers.items():
            if name in store.compressed:
                gather_kernels.gather_windows(buf, len(rows) * e, spec[name].step_bytes, rows * e + context, valid,
                                              pad, rows, outs[name], window)
        rebuild_from_context(spec, buffers, context, valid, pad, rows, batch.derived_views(), window)
        return
    if store.compressed:
        store.gather_compressed(fields["start"], fields["valid"], fields["pad_front"], rows, outs, window,
                                fields["key"])
    if spec.derived:
        context = context_of(spec, slots, fields["start"], store.start, store.capacity)
        rebuild_local(spec, store, ring_addresses, fields["start"], context, fields["valid"], fields["pad_front"],
                      rows, batch.derived_views(), window)


def fill_from_chunks(spec: TrajectorySpec, store, start: np.ndarray, before: np.ndarray, valid: np.ndarray,
                     pad: np.ndarray, rows: np.ndarray, outs: dict, derived_outs: tuple[np.ndarray, ...], window: int,
                     keys: np.ndarray) -> bool:
    """A local sample's compressed and derived columns when every derived column's source is compressed and
    the compiled decoder loads: per source ring, one call (``CompressedRing.fill``) decodes each window's
    chunks (its context included) and copies the source column's window and the derived stacks straight
    from them (:func:`gear_mpi.kernels.chunks.fill_windows`), no context windows in between. Local.

    Cost: one CRC-32 and decompression per chunk a window covers, ``frames`` step copies per window step and
    derived column; O(source columns) Python work.
    Args:
        spec: the columns; store: the shard's store.
        start, before, valid, pad, rows: int64 per window: ring start, context (:func:`context_of`), real
            steps, leading padding, batch row.
        outs: column name -> batch bytes (a compressed column named here gets its windows; others are left
            alone); derived_outs: ``Batch.derived_views()``; window: steps per window.
        keys: each window's trajectory key (named by a corrupted chunk's error), or None.
    Returns:
        False (nothing written) where a source is stored raw or the decoder does not load: use the other path.
    Raises:
        CorruptDataError: a chunk that fails its checksum or does not decompress, naming column and trajectory.
    """
    from .compressed import ChunkError
    plan = _chunk_plan(spec)
    rings = [(name, store.compressed.get(name)) for name, _ in plan]
    if any(r is None or r.decoder() is None for _, r in rings):
        return False
    names = {name for name, _ in plan}
    others = {n: b for n, b in outs.items() if n in store.compressed and n not in names}
    if others:
        store.gather_compressed(start, valid, pad, rows, others, window, keys)
    for (name, ring), (_, (derived_at, columns)) in zip(rings, plan):
        own = name in outs
        targets = ((outs[name],) if own else ()) + tuple(derived_outs[d] for d in derived_at)
        try:
            ring.fill(ring.decoder(), start, before, valid, pad, rows, targets, columns[0 if own else 1], window)
        except ChunkError as err:
            w = getattr(err, "window", None)
            raise store.corrupt(name, err, f"trajectory key {int(keys[w])}" if w is not None and keys is not None
                                else "a sampled window") from None
    return True


_plans: dict = {}


def _chunk_plan(spec: TrajectorySpec) -> list:
    """Per source column of the derived ones: ``(name, (indices of its derived columns, (the rule with the
    column's own window first, the rule without it)))``, the rules as ``CompressedRing.fill`` takes
    them. Built once per spec (kept for the last few specs). O(columns)."""
    hit = _plans.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    got = []
    for name in sources(spec):
        at = tuple(i for i, d in enumerate(spec.derived) if d.source == name)
        rule = [(spec.derived[i].frames, spec.derived[i].offset, spec.derived[i].pad == "zeros") for i in at]
        both = tuple((np.array([r[0] for r in rules], np.int64), np.array([r[1] for r in rules], np.int64),
                      np.array([r[2] for r in rules], np.bool_)) for rules in ([(1, 0, False)] + rule, rule))
        got.append((name, (at, both)))
    if len(_plans) >= 64:
        _plans.clear()
    _plans[id(spec)] = (spec, got)
    return got
