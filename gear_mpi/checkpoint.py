"""Checkpoints of a distributed :class:`~gear_mpi.replay.Replay`: collective, checksummed, crash-safe.

``save(replay, path)`` (collective) writes one directory; ``load(path, comm)``
(collective) returns ``(replay, key_map)``. The directory must be on a file
system that every rank sees (a parallel file system on a cluster, any local
directory on one node). Layout::

    path/MANIFEST.json              format, version, spec, ranks, capacity, sampler, key tag,
                                    the shared random stream and the size and sha256 of every
                                    other file; written last, by rank 0
    path/rank-00000/column-000.bin  the ring steps in use of column 0, oldest first (raw bytes,
    path/rank-00000/column-001.bin  ``steps_used * step_bytes``; no free ring space is written)
    path/rank-00000/table.bin       trajectory-table rows in use, the order ring, the free-slot
                                    stack and the priority index (raw arrays, listed in shard.json)
    path/rank-00000/shard.json      ring counters, statistics and this rank's random streams
    path/rank-00001/...

Every file is streamed (columns in chunks of :data:`CHUNK_BYTES` straight from the
shard's memory, so saving holds no second copy of a shard), fsynced, and
checksummed while written.

Crash safety. A save writes everything under ``path.tmp-<random>``; once every
rank has finished its files (agreed collectively), rank 0 writes the manifest,
then renames an existing ``path`` to ``path.old``, renames the new directory to
``path`` and deletes ``path.old``. A process that dies at any moment therefore
leaves one of these states, and :func:`load` follows one rule:

- ``path`` exists: it is the checkpoint (a ``path.old`` beside it is the previous
  one, left by a crash just before its deletion; the next save removes it);
- ``path`` is missing but ``path.old`` exists: the save crashed between its two
  renames, and ``path.old`` -- the previous checkpoint, whole -- is loaded;
- ``path.tmp-*`` directories are never read: they are interrupted saves (the next
  successful save of the same path deletes them).

A checkpoint that is missing, partial or corrupted (missing file, wrong size, bad
checksum, unknown format version, a rank count that does not match its files)
raises :class:`CheckpointError` naming the file, on every rank.

Loading onto as many ranks as were saved restores every shard exactly: data,
table, priority index, counters, keys and every random stream, so the next
samples are the ones the saved replay would have drawn. Loading onto another
number of ranks (or with another ``capacity_steps``/``max_items``) reshards: the
live trajectories, taken in global insertion order, are dealt to the new ranks
balanced by steps, keeping their data, priorities, times sampled, insertion
stamps and per-shard order; keys change (``key_map`` says how, and the old keys
are refused by the new replay). If they do not fit, the oldest are dropped, as
FIFO eviction would have done (``key_map`` maps them to -1).

Not saved: what lives outside the shards (batches in flight, the node fence) and
trajectories already removed by ``max_times_sampled``.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import os
import secrets
import shutil
import time
from typing import Any, Iterable

import numpy as np

from . import selectors as selector_module
from .comm import MpiComm
from .errors import CheckpointError, CollectiveError
from .kernels import ring
from .selectors import PriorityIndex, Selector
from .spec import TrajectorySpec

FORMAT = "gear_mpi-checkpoint"
FORMAT_VERSION = 2  # 2: the priority index has line sums (l0_sum)
MANIFEST = "MANIFEST.json"
CHUNK_BYTES = 16 << 20
_MARK = "[checkpoint] "  # carried through comm.agree so every rank raises CheckpointError
_TABLE_ROWS = ("start", "length", "priority", "generation", "seq", "stamp", "times_sampled", "alive")
_INDEX_ARRAYS = ("l0_sum", "l1_sum", "l1_min", "l2_sum", "l2_min", "prefix")
LOAD_OPTIONS = ("mode", "timeout", "memory", "force_alltoallv", "seed", "capacity_steps", "max_items",
                "max_times_sampled", "device", "process_group")


def rank_dir(rank: int) -> str:
    return f"rank-{rank:05d}"


# ---- files ---------------------------------------------------------------------------------------
def _write_file(filename: str, chunks: Iterable) -> dict:
    """Write ``chunks`` (bytes-like) to a new file, fsync it; return its size and sha256.

    Every file of a checkpoint goes through here (tests wrap it to crash a save midway).
    """
    digest = hashlib.sha256()
    size = 0
    with open(filename, "xb") as f:
        for chunk in chunks:
            mv = memoryview(chunk).cast("B")
            if len(mv):
                digest.update(mv)
                f.write(mv)
                size += len(mv)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": size, "sha256": digest.hexdigest()}


def _rename(src: str, dst: str) -> None:
    """One step of installing a checkpoint (tests wrap it to crash between the two renames)."""
    os.rename(src, dst)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _slices(buf: np.ndarray, lo: int, hi: int, step: int = CHUNK_BYTES):
    for a in range(lo, hi, step):
        yield buf[a:min(hi, a + step)]


def _ring_segments(head: int, used: int, cap: int) -> list[tuple[int, int]]:
    """Ring step ranges ``[a, b)`` holding ``used`` steps from ``head``, oldest first (at most two)."""
    first = min(used, cap - head)
    segs = [(head, head + first)] if first else []
    if used > first:
        segs.append((0, used - first))
    return segs


class _Checked:
    """Reads one checkpoint file, checking its size first and its sha256 at the end."""

    def __init__(self, filename: str, entry: dict | None):
        self.filename = filename
        if entry is None:
            raise CheckpointError(f"{filename}: not listed in the manifest")
        if not os.path.isfile(filename):
            raise CheckpointError(f"{filename}: missing (the checkpoint is incomplete)")
        size = os.path.getsize(filename)
        if size != entry["bytes"]:
            raise CheckpointError(f"{filename}: {size} bytes, the manifest says {entry['bytes']} "
                                  f"(truncated or overwritten)")
        self.expect = entry["sha256"]
        self.digest = hashlib.sha256()
        self.f = open(filename, "rb")

    def read_into(self, dst: np.ndarray) -> None:
        if not dst.flags.c_contiguous:
            raise ValueError("read_into needs a contiguous destination")
        mv = memoryview(dst).cast("B")
        got = self.f.readinto(mv)
        if got != len(mv):
            raise CheckpointError(f"{self.filename}: ended early (truncated)")
        self.digest.update(mv)

    def read_bytes(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise CheckpointError(f"{self.filename}: ended early (truncated)")
        self.digest.update(data)
        return data

    def skip_all(self) -> None:
        """Hash the rest of the file without keeping it."""
        while True:
            data = self.f.read(CHUNK_BYTES)
            if not data:
                break
            self.digest.update(data)

    def finish(self) -> None:
        self.skip_all()
        self.f.close()
        if self.digest.hexdigest() != self.expect:
            raise CheckpointError(f"{self.filename}: sha256 does not match the manifest (corrupted)")

    def close(self) -> None:
        self.f.close()


def _read_json(filename: str, entry: dict) -> dict:
    c = _Checked(filename, entry)
    try:
        data = c.read_bytes(entry["bytes"])
        c.finish()
    finally:
        c.close()
    try:
        return json.loads(data)
    except ValueError:
        raise CheckpointError(f"{filename}: not valid JSON") from None


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def resolve(path) -> str:
    """The directory :func:`load` reads for ``path``: ``path``, else ``path.old`` (see the module docstring)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return path
    old = path + ".old"
    if not os.path.lexists(path) and os.path.isdir(old):
        return old
    if os.path.lexists(path):
        raise CheckpointError(f"{path}: not a directory, so not a gear_mpi checkpoint")
    raise CheckpointError(f"{path}: no checkpoint there (neither {path} nor {old} exists)")


def read_manifest(path) -> dict:
    """Parse and check ``MANIFEST.json`` of checkpoint directory ``path`` (format, version, self-checksum)."""
    filename = os.path.join(os.fspath(path), MANIFEST)
    if not os.path.isfile(filename):
        raise CheckpointError(f"{filename}: missing (an interrupted save, or not a gear_mpi checkpoint)")
    try:
        with open(filename, "rb") as f:
            doc = json.loads(f.read())
    except ValueError:
        raise CheckpointError(f"{filename}: not valid JSON (truncated or corrupted)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{filename}: not a gear_mpi checkpoint manifest")
    if doc.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{filename}: format version {doc.get('version')!r}; this gear_mpi reads "
                              f"version {FORMAT_VERSION}")
    body = doc.get("body")
    if not isinstance(body, dict) or hashlib.sha256(_canonical(body)).hexdigest() != doc.get("sha256"):
        raise CheckpointError(f"{filename}: sha256 of the manifest body does not match (corrupted)")
    shards = body.get("shards")
    if not isinstance(shards, list) or len(shards) != body.get("ranks") or \
            [s.get("rank") for s in shards] != list(range(len(shards))):
        raise CheckpointError(f"{filename}: says ranks={body.get('ranks')!r} but lists "
                              f"{len(shards) if isinstance(shards, list) else 'no'} shards")
    for s in shards:
        d = os.path.join(os.fspath(path), rank_dir(s["rank"]))
        if not os.path.isdir(d):
            raise CheckpointError(f"{d}: missing, but the manifest lists rank {s['rank']} of {body['ranks']}")
    extra = sorted(n for n in os.listdir(path) if n.startswith("rank-") and
                   n not in {rank_dir(s["rank"]) for s in shards})
    if extra:
        raise CheckpointError(f"{os.path.join(os.fspath(path), extra[0])}: not listed in the manifest, which "
                              f"says ranks={body['ranks']} (files of another save mixed in?)")
    doc["path"] = os.fspath(path)
    return doc


# ---- agreement -----------------------------------------------------------------------------------
def _agree(comm: MpiComm, err: BaseException | None, what: str, values=None) -> np.ndarray:
    """comm.agree, raising CheckpointError on every rank when the failing rank's error was one."""
    if isinstance(err, CheckpointError):
        err = RuntimeError(_MARK + str(err))
    try:
        return comm.agree(err, what, values)
    except CollectiveError:
        raise
    except Exception as e:
        text = str(e)
        if _MARK in text:
            raise CheckpointError(text.replace(_MARK, "")) from None
        raise


# ---- save ----------------------------------------------------------------------------------------
def _index_kind(index) -> str:
    if index is None:
        return "none"
    return "blocked" if isinstance(index, PriorityIndex) else "generic"


def _write_shard(replay, directory: str) -> dict:
    """Write this rank's files into ``directory``; return {file name: {bytes, sha256}}."""
    sh = replay.shard
    st = sh.store
    s = st.state
    cap = st.capacity
    hwm = int(s[ring.NEXT_FRESH])
    head, used = int(s[ring.STEP_HEAD]), int(s[ring.STEPS_USED])
    files = {}
    views = st.byte_views()
    for i, c in enumerate(sh.spec.columns):
        view, sb = views[c.name], c.step_bytes

        def chunks(view=view, sb=sb):
            for a, b in _ring_segments(head, used, cap):
                yield from _slices(view, a * sb, b * sb)
        name = f"column-{i:03d}.bin"
        files[name] = _write_file(os.path.join(directory, name), chunks())
    # the table: rows in use, the live part of the order ring, the free stack, the index
    n_slots = st.max_items
    o_head, o_count = int(s[ring.ORDER_HEAD]), int(s[ring.ORDER_COUNT])
    sections: list[tuple[str, np.ndarray]] = [(k, getattr(st, k)[:hwm]) for k in _TABLE_ROWS]
    for a, b in _ring_segments(o_head, o_count, n_slots):
        sections.append(("order", st.order[a:b]))
    sections.append(("free", st.free[:int(s[ring.FREE_TOP])]))
    kind = _index_kind(sh.index)
    if kind != "none":
        sections.append(("leaves", np.ascontiguousarray(sh.index.host_leaves(hwm), np.float64)))
    if kind == "blocked":
        sections += [(k, getattr(sh.index, k)) for k in _INDEX_ARRAYS]
    layout: list[list] = []
    for name, arr in sections:
        if layout and layout[-1][0] == name:
            layout[-1][2] += len(arr)
        else:
            layout.append([name, arr.dtype.str, len(arr)])
    files["table.bin"] = _write_file(os.path.join(directory, "table.bin"),
                                     (np.ascontiguousarray(a) for _, a in sections))
    meta = {"rank": replay.rank, "state": [int(v) for v in s], "hwm": hwm, "max_items": n_slots,
            "capacity_steps": cap, "table_layout": layout, "index": kind,
            "rng_shard": sh.rng.bit_generator.state, "rng_replay": replay.rng.bit_generator.state,
            "samples_drawn": int(sh.samples_drawn), "stale_updates": int(sh.stale_updates),
            "windows_shared": int(getattr(replay, "windows_shared", 0)),
            "windows_mpi": int(getattr(replay, "windows_mpi", 0))}
    files["shard.json"] = _write_file(os.path.join(directory, "shard.json"),
                                      [json.dumps(meta, sort_keys=True).encode()])
    return files


def _sampler_dict(sel: Selector) -> dict:
    return {"class": type(sel).__name__, "params": dict(vars(sel)), "repr": repr(sel)}


def _make_sampler(d: dict, where: str) -> Selector:
    cls = getattr(selector_module, d.get("class", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, Selector)):
        raise CheckpointError(f"{where}: unknown sampler {d.get('repr', d.get('class'))!r}")
    return cls(**d.get("params", {}))


def save(replay, path) -> None:
    """Collective: write a checkpoint of ``replay`` (every rank's shard) to directory ``path``.

    Replaces an existing checkpoint at ``path`` only once the new one is complete
    (see the module docstring for the exact protocol and what a crash leaves).
    Refuses to replace a non-empty directory that is not a checkpoint. Cost: each
    rank writes ``steps_used * step_bytes`` of columns plus ~70 bytes per table
    slot in use, in chunks of :data:`CHUNK_BYTES`; three small collectives.
    Raises the same error on every rank (:class:`CheckpointError` for file problems).
    Do not run two saves to the same path at once.
    """
    replay._check_open()
    comm: MpiComm = replay.comm
    rank = comm.rank
    err = None
    token = secrets.randbits(48)
    try:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        path = os.path.abspath(os.fspath(path))
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            raise CheckpointError(f"{parent}: no such directory (the checkpoint's parent must exist)")
        if os.path.lexists(path) and not os.path.isdir(path):
            raise CheckpointError(f"{path}: exists and is not a directory")
        if os.path.isdir(path) and os.listdir(path) and not os.path.exists(os.path.join(path, MANIFEST)):
            raise CheckpointError(f"{path}: a non-empty directory that is not a gear_mpi checkpoint; "
                                  f"refusing to replace it")
    except Exception as e:
        err = e
    table = _agree(comm, err, "save", [token])
    settle = getattr(replay, "_settle", None)
    if settle is not None:
        settle()
    tmp = f"{path}.tmp-{int(table[0, 0]):012x}"
    err, info = None, b""
    try:
        os.makedirs(tmp, exist_ok=True)
        d = os.path.join(tmp, rank_dir(rank))
        os.mkdir(d)
        files = _write_shard(replay, d)
        _fsync_dir(d)
        info = json.dumps({"rank": rank, "items": len(replay.shard), "steps_used": replay.shard.store.steps_used,
                           "files": files}).encode()
    except Exception as e:
        err = e if not isinstance(e, OSError) else CheckpointError(f"save: writing under {tmp}: {e}")
    try:
        _agree(comm, err, "save")
        gathered, counts = comm.gatherv(np.frombuffer(info, np.uint8), 0, "save (manifest)")
        err = None
        if rank == 0:
            try:
                _finish(replay, path, tmp, gathered, counts)
            except Exception as e:
                err = e if not isinstance(e, OSError) else CheckpointError(f"save: installing {path}: {e}")
        _agree(comm, err, "save (install)")
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _finish(replay, path: str, tmp: str, gathered: np.ndarray, counts: np.ndarray) -> None:
    """Rank 0: write the manifest into ``tmp`` and swap it in for ``path``."""
    offsets = np.concatenate([[0], np.cumsum(counts)])
    shards = [json.loads(bytes(gathered[offsets[r]:offsets[r + 1]])) for r in range(len(counts))]
    sh = replay.shard
    body = {
        "spec": replay.spec.to_dict(), "column_order": list(replay.spec.names), "ranks": replay.size,
        "capacity_steps": sh.capacity_steps, "max_items": sh.store.max_items,
        "max_times_sampled": sh.max_times_sampled or None, "sampler": _sampler_dict(replay.selector),
        "mode": replay.mode, "timeout": replay.comm.timeout, "force_alltoallv": bool(replay.force_alltoallv),
        "memory": getattr(sh.store.arena, "kind", None),
        "device": "cuda" if getattr(replay, "device", None) is not None else "cpu",
        "tag": int(sh.tag), "shared_rng": replay.shared_rng.bit_generator.state,
        "created": time.time(), "items": sum(s["items"] for s in shards), "shards": shards,
    }
    from . import __version__
    body["gear_mpi_version"] = __version__
    doc = {"format": FORMAT, "version": FORMAT_VERSION, "sha256": hashlib.sha256(_canonical(body)).hexdigest(),
           "body": body}
    _write_file(os.path.join(tmp, MANIFEST), [json.dumps(doc, indent=1).encode()])
    _fsync_dir(tmp)
    parent = os.path.dirname(path)
    old = path + ".old"
    if os.path.isdir(path):
        if os.path.lexists(old):  # left by a save that crashed after installing its checkpoint
            shutil.rmtree(old)
        _rename(path, old)
        _rename(tmp, path)
    else:  # first save, or an earlier save crashed between its renames (path.old is the checkpoint)
        _rename(tmp, path)
    _fsync_dir(parent)
    if os.path.lexists(old):
        shutil.rmtree(old)
    prefix = os.path.basename(path) + ".tmp-"
    for name in os.listdir(parent):  # interrupted saves of this path
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


# ---- load ----------------------------------------------------------------------------------------
def load(path, comm=None, **overrides) -> tuple[Any, tuple[np.ndarray, np.ndarray]]:
    """Collective: restore a checkpoint written by :func:`save`; returns ``(replay, key_map)``.

    ``comm``: the mpi4py communicator (default COMM_WORLD). ``overrides``: any of
    :data:`LOAD_OPTIONS` -- ``mode``, ``timeout``, ``memory``, ``force_alltoallv``,
    ``device``, ``process_group``, ``max_times_sampled`` change how the replay runs
    and keep an exact restore; ``capacity_steps`` or ``max_items`` different from
    the saved ones reshard (as does another number of ranks); ``seed`` seeds the
    streams of a resharded replay (default: derived from the saved streams).

    ``key_map`` is ``(old_keys, new_keys)``: two int64 arrays sorted by old key,
    one entry per live trajectory of the checkpoint (all ranks); -1 for a
    trajectory dropped because the new replay is too small. Exact restore: the
    identity. Use :func:`remap` to translate keys.
    Cost: exact restore reads each rank's own files once; resharding reads every
    rank's table (O(total items) memory on every rank) and the steps it receives.
    """
    from .replay import Replay

    unknown = sorted(set(overrides) - set(LOAD_OPTIONS))
    if unknown:
        raise TypeError(f"load: unexpected keyword argument(s) {unknown}; allowed: {list(LOAD_OPTIONS)}")
    timeout = overrides.get("timeout", 60.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    mc = MpiComm(comm, timeout)
    err, doc, digest = None, None, 0
    try:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        where = resolve(os.path.abspath(os.fspath(path)))
        doc = read_manifest(where)
        digest = int(doc["sha256"][:12], 16)
    except Exception as e:
        err = e
    table = _agree(mc, err, "load", [digest])
    if len(set(table[:, 0].tolist())) > 1:
        raise CheckpointError(f"load: the ranks read different manifests at {os.fspath(path)} (is it on a file "
                              f"system that every rank sees, and was it being replaced?)")
    body, where = doc["body"], doc["path"]
    columns = body["spec"]["columns"]  # in the saved column order (the files are numbered in it)
    spec = TrajectorySpec.from_dict({"columns": {k: columns[k] for k in body["column_order"]},
                                     "max_length": body["spec"]["max_length"]})
    sampler = _make_sampler(body["sampler"], os.path.join(where, MANIFEST))
    cap = int(overrides.get("capacity_steps", body["capacity_steps"]))
    max_items = int(overrides.get("max_items", body["max_items"]))
    exact = mc.size == body["ranks"] and cap == body["capacity_steps"] and max_items == body["max_items"]
    if exact:
        seed = 0  # every stream is restored from the checkpoint
    elif "seed" in overrides:
        seed = overrides["seed"]
    else:  # deterministic: the same checkpoint reshards to the same streams
        seed = int(hashlib.sha256(json.dumps(body["shared_rng"], sort_keys=True).encode()).hexdigest()[:15], 16)
    timeout = float(overrides.get("timeout", body["timeout"]))
    kw = dict(mode=overrides.get("mode", body["mode"]), comm=mc.comm, seed=seed, timeout=timeout,
              max_items=max_items, max_times_sampled=overrides.get("max_times_sampled", body["max_times_sampled"]),
              memory=overrides.get("memory"), force_alltoallv=overrides.get("force_alltoallv", body["force_alltoallv"]))
    device = overrides.get("device", body.get("device", "cpu"))
    if device != "cpu":
        kw["device"] = device
    if overrides.get("process_group") is not None:
        kw["process_group"] = overrides["process_group"]
    replay = Replay(spec, cap, sampler, **kw)
    try:
        if exact:
            key_map = _load_exact(replay, where, body)
        else:
            key_map = _load_resharded(replay, where, body)
    except BaseException:
        try:
            replay.close()
        except Exception:
            pass
        raise
    return replay, key_map


def _load_exact(replay, where: str, body: dict):
    comm: MpiComm = replay.comm
    rank = comm.rank
    err = None
    try:
        _restore_shard(replay, where, body, rank)
    except Exception as e:
        err = e
    _agree(comm, err, "load")
    st = replay.shard.store
    mine = st.keys_of(ring.live_in_order(st.state, st.alive, st.order, False, len(st)))
    counts = comm.allgather(np.array([len(mine)], np.int64), "load (keys)")[:, 0]
    keys = np.sort(comm.allgatherv(mine, counts, "load (keys)"))
    return keys, keys.copy()


def _shard_files(where: str, body: dict, r: int) -> tuple[str, dict]:
    d = os.path.join(where, rank_dir(r))
    return d, body["shards"][r]["files"]


def _read_meta(where: str, body: dict, r: int) -> dict:
    d, files = _shard_files(where, body, r)
    meta = _read_json(os.path.join(d, "shard.json"), files.get("shard.json"))
    if meta.get("rank") != r or len(meta.get("state", ())) != ring.STATE_SIZE:
        raise CheckpointError(f"{os.path.join(d, 'shard.json')}: not the description of rank {r}")
    return meta


def _read_table(where: str, body: dict, r: int, meta: dict, targets: dict | None = None) -> dict:
    """Read table.bin of rank ``r``: sections into ``targets[name]`` views when given, else new arrays."""
    d, files = _shard_files(where, body, r)
    c = _Checked(os.path.join(d, "table.bin"), files.get("table.bin"))
    out = {}
    try:
        for name, dtype, count in meta["table_layout"]:
            dst = targets.get(name) if targets else None
            if dst is None:
                dst = np.empty(count, np.dtype(dtype))
            elif len(dst) != count or dst.dtype != np.dtype(dtype):
                raise CheckpointError(f"{c.filename}: section {name!r} has {count} x {dtype}, "
                                      f"expected {len(dst)} x {dst.dtype.str}")
            c.read_into(dst)
            out[name] = dst
        c.finish()
    finally:
        c.close()
    return out


def _restore_shard(replay, where: str, body: dict, r: int) -> None:
    """Exact restore of rank ``r``'s shard into ``replay`` (same capacity and max_items)."""
    sh = replay.shard
    st = sh.store
    meta = _read_meta(where, body, r)
    d, files = _shard_files(where, body, r)
    if meta["capacity_steps"] != st.capacity or meta["max_items"] != st.max_items:
        raise CheckpointError(f"{os.path.join(d, 'shard.json')}: capacity or max_items differ from the manifest")
    state = np.array(meta["state"], np.int64)
    hwm = int(meta["hwm"])
    kind = meta["index"]
    if (kind == "none") != (sh.index is None):
        raise CheckpointError(f"{os.path.join(d, 'shard.json')}: priority index {kind!r} does not fit the "
                              f"sampler {sh.selector!r}")
    # table rows go straight into the store's arrays
    targets = {k: getattr(st, k)[:hwm] for k in _TABLE_ROWS}
    targets["free"] = st.free[:int(state[ring.FREE_TOP])]
    if kind == "blocked" and isinstance(sh.index, PriorityIndex):
        targets["leaves"] = sh.index.leaves[:hwm]
        targets.update({k: getattr(sh.index, k) for k in _INDEX_ARRAYS})
    got = _read_table(where, body, r, meta, targets)
    order = got.get("order", np.zeros(0, np.int64))
    if len(order) != state[ring.ORDER_COUNT]:
        raise CheckpointError(f"{os.path.join(d, 'table.bin')}: order ring has {len(order)} entries, "
                              f"shard.json says {int(state[ring.ORDER_COUNT])}")
    pos = (state[ring.ORDER_HEAD] + np.arange(len(order))) % st.max_items
    st.order[pos] = order
    if sh.index is not None and not (kind == "blocked" and isinstance(sh.index, PriorityIndex)):
        sh.index.set(np.arange(hwm, dtype=np.int64), got["leaves"])  # another index type: rebuilt from leaves
    st.state[:] = state
    # columns: the steps in use, streamed into the ring where they were
    views = st.byte_views()
    head, used = int(state[ring.STEP_HEAD]), int(state[ring.STEPS_USED])
    for i, c in enumerate(sh.spec.columns):
        chk = _Checked(os.path.join(d, f"column-{i:03d}.bin"), files.get(f"column-{i:03d}.bin"))
        try:
            if os.path.getsize(chk.filename) != used * c.step_bytes:
                raise CheckpointError(f"{chk.filename}: {os.path.getsize(chk.filename)} bytes, but {used} steps of "
                                      f"{c.step_bytes} bytes are in use")
            for a, b in _ring_segments(head, used, st.capacity):
                for part in _slices(views[c.name], a * c.step_bytes, b * c.step_bytes):
                    chk.read_into(part)
            chk.finish()
        finally:
            chk.close()
    st.tag = int(body["tag"])
    sh.rng.bit_generator.state = meta["rng_shard"]
    replay.rng.bit_generator.state = meta["rng_replay"]
    replay.shared_rng.bit_generator.state = body["shared_rng"]
    sh.samples_drawn = int(meta["samples_drawn"])
    sh.stale_updates = int(meta["stale_updates"])
    replay.windows_shared = int(meta["windows_shared"])
    replay.windows_mpi = int(meta["windows_mpi"])


def _load_resharded(replay, where: str, body: dict):
    """Deal the checkpoint's live trajectories to this replay's ranks (see the module docstring)."""
    comm: MpiComm = replay.comm
    rank, size = comm.rank, comm.size
    sh = replay.shard
    spec = sh.spec
    old_ranks = body["ranks"]
    old_cap = body["capacity_steps"]
    err = None
    tables: list[dict] = []
    metas: list[dict] = []
    try:
        for r in range(old_ranks):
            meta = _read_meta(where, body, r)
            metas.append(meta)
            tables.append(_read_table(where, body, r, meta))
            if r % size == rank:  # this rank checks the columns of old rank r
                d, files = _shard_files(where, body, r)
                used = int(meta["state"][ring.STEPS_USED])
                for i, c in enumerate(spec.columns):
                    chk = _Checked(os.path.join(d, f"column-{i:03d}.bin"), files.get(f"column-{i:03d}.bin"))
                    try:
                        if os.path.getsize(chk.filename) != used * c.step_bytes:
                            raise CheckpointError(f"{chk.filename}: {os.path.getsize(chk.filename)} bytes, but "
                                                  f"{used} steps of {c.step_bytes} bytes are in use")
                        chk.finish()
                    finally:
                        chk.close()
    except Exception as e:
        err = e
    _agree(comm, err, "load")
    # every live trajectory of the checkpoint, in global insertion order
    tag = int(body["tag"])
    from . import keys as keyspace
    recs = []
    for r, (t, meta) in enumerate(zip(tables, metas)):
        slots = np.flatnonzero(t["alive"] == ring.LIVE).astype(np.int64)
        slots = slots[np.argsort(t["seq"][slots], kind="stable")]
        stamp = np.maximum.accumulate(t["stamp"][slots]) if len(slots) else np.zeros(0, np.int64)
        head = int(meta["state"][ring.STEP_HEAD])
        recs.append(dict(rank=np.full(len(slots), r, np.int64), slot=slots, stamp=stamp,
                         raw_stamp=t["stamp"][slots], seq=t["seq"][slots], length=t["length"][slots],
                         priority=t["priority"][slots], times=t["times_sampled"][slots],
                         offset=(t["start"][slots] - head) % old_cap,
                         key=keyspace.encode(tag, r, slots, t["generation"][slots])))
    allr = {k: np.concatenate([x[k] for x in recs]) for k in recs[0]} if recs else {}
    n = len(allr["key"]) if allr else 0
    order = np.lexsort((allr["seq"], allr["rank"], allr["stamp"])) if n else np.zeros(0, np.int64)
    allr = {k: v[order] for k, v in allr.items()}
    # balanced by steps: each trajectory (oldest first) goes to the rank holding the fewest steps so far
    dest = np.empty(n, np.int64)
    heap = [(0, r) for r in range(size)]
    for i, length in enumerate(allr["length"].tolist() if n else []):
        steps, r = heapq.heappop(heap)
        dest[i] = r
        heapq.heappush(heap, (steps + length, r))
    # what does not fit a new shard: its oldest, exactly as FIFO eviction would drop them
    keep = np.ones(n, bool)
    cap, max_items = sh.capacity_steps, sh.store.max_items
    for r in range(size):
        idx = np.flatnonzero(dest == r)
        if len(idx) == 0:
            continue
        from_newest = np.cumsum(allr["length"][idx][::-1])[::-1]
        count_from_newest = np.arange(len(idx), 0, -1)
        keep[idx] = (from_newest <= cap) & (count_from_newest <= max_items)
    # the new replay's keys must not be confused with the old ones
    if sh.tag == tag:
        sh.store.tag = (tag + 1) & keyspace.TAG_MASK
    err = None
    mine = np.flatnonzero((dest == rank) & keep)
    new_keys = np.empty(len(mine), np.int64)
    try:
        _insert_from_files(replay, where, body, metas, allr, mine, new_keys)
    except Exception as e:
        err = e
    _agree(comm, err, "load")
    counts = comm.allgather(np.array([len(mine)], np.int64), "load (keys)")[:, 0]
    gathered = comm.allgatherv(new_keys, counts, "load (keys)")
    new_all = np.full(n, -1, np.int64)
    kept_dest = dest[keep]
    kept_idx = np.flatnonzero(keep)
    pos = 0
    for r in range(size):
        idx = kept_idx[kept_dest == r]
        new_all[idx] = gathered[pos:pos + len(idx)]
        pos += len(idx)
    o = np.argsort(allr["key"]) if n else np.zeros(0, np.int64)
    return (allr["key"][o] if n else np.zeros(0, np.int64)), new_all[o]


def _insert_from_files(replay, where, body, metas, allr, mine, new_keys) -> None:
    """Insert trajectories ``mine`` (indices into ``allr``, oldest first) into this rank's shard, in chunks."""
    sh = replay.shard
    spec = sh.spec
    maps: dict[tuple[int, int], np.ndarray] = {}

    def column(r: int, i: int) -> np.ndarray:
        if (r, i) not in maps:
            c = spec.columns[i]
            used = int(metas[r]["state"][ring.STEPS_USED])
            fn = os.path.join(where, rank_dir(r), f"column-{i:03d}.bin")
            maps[(r, i)] = np.memmap(fn, dtype=c.dtype, mode="r", shape=(used,) + c.shape)
        return maps[(r, i)]

    step_bytes = max(1, spec.step_bytes)
    limit = max(1, CHUNK_BYTES // step_bytes)
    pos = 0
    while pos < len(mine):
        end, steps = pos, 0
        while end < len(mine) and (end == pos or steps + allr["length"][mine[end]] <= limit):
            steps += int(allr["length"][mine[end]])
            end += 1
        part = mine[pos:end]
        trajs = []
        for j in part.tolist():
            r, off, length = int(allr["rank"][j]), int(allr["offset"][j]), int(allr["length"][j])
            trajs.append({c.name: column(r, i)[off:off + length] for i, c in enumerate(spec.columns)})
        keys = replay.insert_many(trajs, allr["priority"][part])
        slots, _ = sh.store.resolve(keys)
        sh.store.stamp[slots] = allr["raw_stamp"][part]
        sh.store.times_sampled[slots] = allr["times"][part]
        new_keys[pos:end] = keys
        pos = end
    maps.clear()


def remap(key_map: tuple[np.ndarray, np.ndarray], keys) -> np.ndarray:
    """Translate old keys through ``key_map`` (from :func:`load`); -1 for keys it does not hold. O(n log N)."""
    old, new = key_map
    k = np.asarray(keys, np.int64).reshape(-1)
    if len(old) == 0:
        return np.full(len(k), -1, np.int64)
    i = np.minimum(np.searchsorted(old, k), len(old) - 1)
    return np.where(old[i] == k, new[i], -1)
