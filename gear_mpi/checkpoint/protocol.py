"""Saving and loading as collectives: agreement, the crash-safe install, the exact restore.

:func:`save` has every rank write its files under ``path.tmp-<token>``; once all
ranks agree that they succeeded, rank 0 writes the manifest and installs the new
directory with two renames (:func:`_install`). :func:`load` agrees on one
manifest, builds a replay through the factory it is given, and restores it
exactly (same ranks and sizes) or hands it to :mod:`~gear_mpi.checkpoint.reshard`.

Every step that can fail on one rank ends in ``comm.agree``, so every rank raises
the same error (:class:`~gear_mpi.errors.CheckpointError` for file problems).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
import shutil
import time
import warnings
import zlib
from typing import Any, Callable

import numpy as np

from ..selection import selectors as selector_module
from ..distributed.comm import DEFAULT_TIMEOUT, MpiComm, check_timeout, differing_ranks, displacements
from ..errors import CheckpointError
from ..progress import Meter, log, wanted
from ..selection.selectors import Selector
from ..spec import TrajectorySpec, whole_number
from . import arena_file, files, reshard, shard_files
from .arrival import Channel, CheckpointComm, human
from .files import MANIFEST, path_digest, rank_dir, read_manifest, resolve

LOAD_OPTIONS = ("mode", "timeout", "memory", "force_alltoallv", "seed", "capacity_steps", "max_items",
                "max_times_sampled", "device", "process_group", "progress", "memory_path", "mmap", "verify",
                "allow_drop")


#: load's overrides that may differ between ranks (a rank's own GPU, file or process group; rank 0 reports)
PER_RANK_OPTIONS = ("device", "process_group", "progress", "memory_path")


def _options_digest(overrides: dict) -> int:
    """A CRC-32 of the overrides every rank must give alike (all but :data:`PER_RANK_OPTIONS`). O(overrides)."""
    same = sorted((k, repr(v)) for k, v in overrides.items() if k not in PER_RANK_OPTIONS)
    return zlib.crc32(repr(same).encode())


def _whole(value, name: str) -> int:
    """``value`` as a positive int (an override of a size), else ValueError naming ``name``. O(1)."""
    if not whole_number(value):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def agree_on_manifest(mc: MpiComm, err: BaseException | None, digest: int, label: str, who: str, path: Any,
                      options: int = 0) -> None:
    """Agree, collectively, that every rank read the same manifest: ``err`` (a rank's failure to read it) is
    raised on every rank as :meth:`MpiComm.agree` does, then differing ``digest`` s raise.

    Args:
        mc: the communicator of the ranks that read it.
        err: this rank's exception while reading the manifest, or None.
        digest: an integer digest of the manifest this rank read (0 where it read none).
        label: the collective's name in its errors ("load", "recover (checkpoint)"); its first word names the
            operation in the mismatch message.
        who: what the ranks are called in the message ("ranks", "survivors").
        path: the path they were given, for the message.
        options: a digest of the options the ranks must give alike (:func:`_options_digest`; 0: none).

    Raises:
        CheckpointError: the ranks read different manifests (the same on every rank).
        ValueError: the ranks gave different ``options`` (the same on every rank).
        Exception: any rank's ``err``, on every rank (as ``MpiComm.agree``).

    Cost: one small allgather (``MpiComm.agree``).
    """
    table = mc.agree(err, label, [digest, options])
    if len(set(table[:, 0].tolist())) > 1:
        raise CheckpointError(f"{label.split()[0]}: the {who} read different manifests at {os.fspath(path)} (is it "
                              f"on a file system that every rank sees, and was it being replaced?)")
    others = differing_ranks(table[:, 1])
    if others:
        raise ValueError(f"{label.split()[0]}: the overrides must be the same on every rank (all but "
                         f"{', '.join(PER_RANK_OPTIONS)}); rank(s) {others} gave others than rank 0")

def saved_spec(body: dict) -> TrajectorySpec:
    """The spec a manifest body saved: its stored columns in the saved order (the files are numbered in it) and
    its derived columns (``FrameStack``, ``NextStep``: part of the arena header's fingerprint). O(columns)."""
    columns = body["spec"]["columns"]
    return TrajectorySpec.from_dict({"columns": {k: columns[k] for k in body["column_order"]},
                                     "derived": body["spec"].get("derived", {}),
                                     "max_length": body["spec"]["max_length"]})


@functools.lru_cache(maxsize=1)
def _package_version() -> str | None:
    """The installed gear-mpi's version (read once: importlib.metadata takes milliseconds, a background
    checkpoint's snapshot in the training loop asks at every checkpoint)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("gear-mpi")
    except (ImportError, PackageNotFoundError):
        return None


def _sampler_dict(sel: Selector) -> dict:
    return {"class": type(sel).__name__, "params": dict(vars(sel)), "repr": repr(sel)}


def _make_sampler(d: dict, where: str) -> Selector:
    cls = getattr(selector_module, d.get("class", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, Selector)):
        raise CheckpointError(f"{where}: unknown sampler {d.get('repr', d.get('class'))!r}")
    return cls(**d.get("params", {}))


# ---- save ----------------------------------------------------------------------------------------
def save(replay, path, progress: bool | None = None) -> None:
    """Collective: write a checkpoint of ``replay`` (every rank's shard) to directory ``path``.

    Replaces an existing checkpoint at ``path`` only once the new one is complete
    (see :mod:`gear_mpi.checkpoint` for the protocol and what a crash leaves).
    Do not run two saves to the same path at once.

    Deadlines: the start waits ``timeout`` (the replay's) for every rank; then each
    rank waits for rank r's files until ``timeout + bytes_r / rate`` (or ``timeout``
    after r's last progress report), ``bytes_r`` agreed at the start and ``rate``
    a low assumed file-system speed (:mod:`~gear_mpi.checkpoint.arrival`). After a
    deadline passes, the error names the late rank as absent or slow, with its byte
    count, and the replay's communicator stays usable (the save's own collectives
    run on a duplicate of it).

    Args:
        replay: an open :class:`~gear_mpi.replay.Replay`; every rank passes its own.
        path: the checkpoint directory (str or os.PathLike), the same on every rank,
            on a file system every rank sees; its parent must exist.
        progress: report progress on rank 0's stderr, bytes of all ranks, once the save has lasted
            ``GEAR_MPI_PROGRESS_DELAY`` (2) seconds: a tqdm bar on a terminal, plain lines otherwise
            (None: yes unless ``GEAR_MPI_PROGRESS=0``; False: never; see :mod:`gear_mpi.progress`).
    Raises:
        CheckpointError: the path cannot hold a checkpoint (e.g. a non-empty directory
            that is not one), writing failed, or a rank's columns map a checkpoint
            (``load(mmap=True)``) that another process wrote or truncated since; the same
            on every rank.
        TypeError: ``path`` is not a path, or ``progress`` not None or a bool.
        ValueError: ranks gave different paths (compared after ``os.path.abspath``; on every rank, before
            anything is written).
        RuntimeError: the replay is closed.
        CollectiveTimeoutError: a rank did not arrive at the start within the timeout,
            or missed its deadline for its files (named: absent or slow).
        CollectiveError: an earlier collective of the replay failed, or another rank is in another call.
    Cost: each rank writes ``steps_used * step_bytes`` of columns plus ~70 bytes per
    table slot in use, in chunks of :data:`~gear_mpi.checkpoint.files.CHUNK_BYTES`;
    a duplication of the communicator, four small collectives, one gather of the
    file list at rank 0, and a heartbeat (24 bytes to each peer) at most every
    ``min(1 s, timeout / 4)`` while writing.
    """
    if replay.closed:
        raise RuntimeError("this Replay is closed")
    replay.comm.check_usable()
    with replay.shard.hold(strict=False) as problem:  # mapped columns: read until the save ends (Shard.hold)
        _save(replay, path, progress, problem)


def _save(replay, path, progress: bool | None, problem: Exception | None) -> None:
    """:func:`save`, with this rank's error already known (``problem``: its mapped columns changed), agreed."""
    comm: MpiComm = replay.comm
    show = wanted(progress, comm.rank)
    rank = comm.rank
    started = time.monotonic()
    err, mine, where = problem, 0, 0
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
        mine = shard_files.bytes_to_write(replay.shard)
        where = path_digest(path)  # compared below: the same path everywhere
    except Exception as e:
        err = e
    table = replay.calls.agree(err, "save", [token, mine, where])  # the save's head (gear_mpi.distributed.calls)
    others = differing_ranks(table[:, 2])
    if others:  # each rank would write its shard under its own path, and rank 0 install only its own
        raise ValueError(f"save: every rank must give the same path (after os.path.abspath); rank(s) "
                         f"{others} gave another than rank 0's: nothing was written")
    replay.settle()
    tmp = f"{path}.tmp-{int(table[0, 0]):012x}"
    nbytes = table[:, 1]
    ck = CheckpointComm(comm, "save")
    try:
        err, info = None, b""
        with Meter(int(nbytes.sum()), "gear_mpi save", show, comm.size) as meter:  # every rank's bytes
            channel = Channel(ck, "save", nbytes, "write", meter)
            try:
                os.makedirs(tmp, exist_ok=True)
                d = os.path.join(tmp, rank_dir(rank))
                os.mkdir(d)
                written = shard_files.write_rank(d, replay.shard, replay.state())
                files.fsync_dir(d)
                stats = replay.shard.stats()
                info = json.dumps({"rank": rank, "items": stats["items"], "steps_used": stats["steps_used"],
                                   "files": written}).encode()
            except Exception as e:
                err = e if not isinstance(e, OSError) else CheckpointError(f"save: writing under {tmp}: {e}")
            wrote = time.monotonic() - started
            channel.arrive()
            channel.await_peers()
            ck.agree(err, "save")
        gathered, counts = ck.gatherv(np.frombuffer(info, np.uint8), 0, "save (manifest)")
        err = None
        if rank == 0:
            try:
                starts = displacements(counts)
                shards = [json.loads(bytes(gathered[a:a + n])) for a, n in zip(starts.tolist(), counts.tolist())]
                _install(_manifest_body(replay, shards), path, tmp)
            except Exception as e:
                err = e if not isinstance(e, OSError) else CheckpointError(f"save: installing {path}: {e}")
        ck.timeout = comm.timeout + float(nbytes.sum()) / channel.rate  # rank 0 may delete an old checkpoint
        ck.agree(err, "save (install)")
    except BaseException as e:
        log.warning("save of %s failed on rank %d: %s", path, rank, e)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        ck.close()
    log.info("save: rank %d wrote %s in %.2f s to %s", rank, human(mine), wrote, path)
    if rank == 0:
        log.info("save: %s installed: %d ranks, %s in all, %.2f s", path, comm.size, human(nbytes.sum()),
                 time.monotonic() - started)


def _manifest_body(replay, shards: list[dict]) -> dict:
    """What the manifest says about the whole replay (rank 0's view; the same on every rank)."""
    sh = replay.shard
    own = sh.state()
    how = replay.describe()
    return {
        "spec": replay.spec.to_dict(), "column_order": list(replay.spec.names), "ranks": replay.ranks,
        "capacity_steps": own["capacity_steps"], "max_items": own["max_items"],
        "max_times_sampled": sh.max_times_sampled or None, "sampler": _sampler_dict(replay.selector),
        "mode": how["mode"], "timeout": how["timeout"], "force_alltoallv": bool(how["force_alltoallv"]),
        "memory": how["memory"], "device": how["device"],
        "tag": int(own["tag"]), "shared_rng": replay.state()["shared_rng"],
        "created": time.time(), "items": sum(s["items"] for s in shards), "shards": shards,
        "gear_mpi_version": _package_version(),
    }


def _install(body: dict, path: str, tmp: str) -> None:
    """Rank 0: write the manifest into ``tmp`` and swap ``tmp`` in for ``path``.

    The two renames go through :func:`files.rename`; a crash between them leaves
    only ``path.old``, which :func:`~gear_mpi.checkpoint.files.resolve` then picks.
    """
    files.write_manifest(tmp, body)
    files.fsync_dir(tmp)
    parent = os.path.dirname(path)
    old = path + ".old"
    if os.path.isdir(path):
        if os.path.lexists(old):  # left by a save that crashed after installing its checkpoint
            shutil.rmtree(old)
        files.rename(path, old)
        files.rename(tmp, path)
    else:  # first save, or an earlier save crashed between its renames (path.old is the checkpoint)
        files.rename(tmp, path)
    files.fsync_dir(parent)
    if os.path.lexists(old):
        shutil.rmtree(old)
    prefix = os.path.basename(path) + ".tmp-"
    for name in os.listdir(parent):  # interrupted saves of this path
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


# ---- load ----------------------------------------------------------------------------------------
def load(path, comm=None, build: Callable[..., Any] | None = None,
         **overrides) -> tuple[Any, tuple[np.ndarray, np.ndarray]]:
    """Collective: restore a checkpoint written by :func:`save`; returns ``(replay, key_map)``.

    ``gear_mpi.load_checkpoint(path, comm, **overrides)`` and
    ``Replay.load(path, comm, **overrides)`` call this with ``build=Replay``.

    Args:
        path: the checkpoint directory (str or os.PathLike), the same on every rank.
        comm: the mpi4py communicator (default COMM_WORLD).
        build: the replay factory, called as ``build(spec, capacity_steps, sampler,
            mode=..., comm=..., seed=..., timeout=..., ...)`` (the Replay class).
        **overrides: any of :data:`LOAD_OPTIONS`. ``mode``, ``timeout``, ``memory``,
            ``force_alltoallv``, ``device``, ``process_group``, ``max_times_sampled``
            change how the replay runs and keep an exact restore; ``capacity_steps``
            or ``max_items`` other than the saved ones reshard (as does another
            number of ranks); ``seed`` seeds the streams of a resharded replay
            (default: derived from the saved streams); ``progress`` (None, True or
            False): progress of all ranks' bytes on rank 0 as :func:`save` reports it;
            ``memory="file"`` with ``memory_path`` (the new replay's ``path=``; the name
            ``path`` is the checkpoint's) loads into file-backed shards.
            ``mmap=True``: an exact restore of a version-3 checkpoint maps each rank's
            ``columns.bin`` as its shard's memory, copy-on-write (no step is read; the files
            are never written; node peers' windows then travel through MPI); a reshard or a
            version-2 checkpoint cannot be mapped and is copied, with a warning (into
            ``memory``/``memory_path`` when given). ``verify``: check the columns' sha256 (default
            True, or False with ``mmap``: reading every step is what mapping avoids; the
            table and shard.json are always checked, the columns' sizes and headers too;
            :func:`gear_mpi.checkpoint.verify` checks the rest at any time).
            ``allow_drop``: a reshard whose new shards cannot hold every live trajectory raises
            :class:`~gear_mpi.errors.CheckpointError` (how many would be lost, and the
            ``capacity_steps``/``max_items`` that hold them all); ``allow_drop=True`` keeps the
            newest that fit instead, as FIFO eviction would, and logs how many were dropped.
    Returns:
        ``(replay, key_map)``: ``key_map = (old_keys, new_keys)``, two int64 arrays
        sorted by old key, one entry per live trajectory of the checkpoint (all
        ranks), the same on every rank; -1 for a trajectory dropped because the new
        replay is too small (only with ``allow_drop=True``). The identity for an exact restore. See :func:`remap`.
    Raises:
        CheckpointError: missing, partial or damaged checkpoint, or ranks that read
            different manifests; the same on every rank, naming the file. A reshard that
            would drop trajectories without ``allow_drop=True`` (the replay is closed).
        TypeError: an unknown override, ``path`` not a path, ``progress`` not None or
            a bool, or no ``build``.
        ValueError: ``timeout`` not a positive number, ``capacity_steps`` or ``max_items`` not a positive
            integer, or overrides that differ between ranks (all but ``device``, ``process_group``,
            ``progress`` and ``memory_path`` must be alike). Like the errors above, on every rank at once.
        CollectiveTimeoutError: a rank did not arrive within the timeout, or missed
            its deadline for reading its files (named: absent or slow; the deadlines
            are those of :func:`save`, with the bytes each rank reads).
        CollectiveError: a rank failed, or the communicator has a collective pending
            from an earlier timeout (raised at once).
    Cost: an exact restore reads each rank's own files once; resharding reads every
    rank's table (O(total items) memory on every rank) and the steps it receives.
    A duplication of the communicator; heartbeats while reading, as in :func:`save`.
    """
    if build is None:
        raise TypeError("load: build (the Replay class) is required; gear_mpi.load_checkpoint and Replay.load "
                        "pass it")
    # this rank's overrides are checked before the first collective and agreed with the manifest: a bad or
    # differing one on any rank raises on every rank at once (not a timeout on the others)
    err, doc, digest, timeout = None, None, 0, overrides.get("timeout", DEFAULT_TIMEOUT)
    try:
        unknown = sorted(set(overrides) - set(LOAD_OPTIONS))
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; allowed: {list(LOAD_OPTIONS)}")
        check_timeout(timeout)
    except Exception as e:
        err, timeout = e, DEFAULT_TIMEOUT
    mc = MpiComm(comm, timeout)
    mc.check_usable()
    started = time.monotonic()
    cap = max_items = 0
    show = False
    try:
        if err is not None:
            raise err
        show = wanted(overrides.get("progress"), mc.rank)
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        doc = read_manifest(resolve(os.path.abspath(os.fspath(path))))
        digest = int(doc["sha256"][:12], 16)
        cap = _whole(overrides.get("capacity_steps", doc["body"]["capacity_steps"]), "capacity_steps")
        max_items = _whole(overrides.get("max_items", doc["body"]["max_items"]), "max_items")
    except Exception as e:
        err = e
    agree_on_manifest(mc, err, digest, "load", "ranks", path, options=_options_digest(overrides))
    body, where = doc["body"], doc["path"]
    spec = saved_spec(body)
    sampler = _make_sampler(body["sampler"], os.path.join(where, MANIFEST))
    exact = mc.size == body["ranks"] and cap == body["capacity_steps"] and max_items == body["max_items"]
    mapped = _wants_map(overrides.get("mmap", False), exact, doc["version"], body, mc.size)
    verify = overrides.get("verify")
    verify = (not mapped) if verify is None else bool(verify)
    if mapped:  # this rank's columns.bin must be mappable as its arena; agreed before the replay maps it
        err = None
        try:
            d, entries = shard_files.rank_files(where, body, mc.rank)
            arena_file.check_mappable(os.path.join(d, arena_file.COLUMNS), entries.get(arena_file.COLUMNS), spec, cap)
        except Exception as e:
            err = e
        mc.agree(err, "load")
    if exact:
        seed = 0  # every stream is restored from the checkpoint
    elif "seed" in overrides:
        seed = overrides["seed"]
    else:  # deterministic: the same checkpoint reshards to the same streams
        seed = int(hashlib.sha256(json.dumps(body["shared_rng"], sort_keys=True).encode()).hexdigest()[:15], 16)
    kw = dict(mode=overrides.get("mode", body["mode"]), comm=mc.comm, seed=seed,
              timeout=float(overrides.get("timeout", body["timeout"])), max_items=max_items,
              max_times_sampled=overrides.get("max_times_sampled", body["max_times_sampled"]),
              memory="mapped" if mapped else overrides.get("memory"),
              force_alltoallv=overrides.get("force_alltoallv", body["force_alltoallv"]))
    if mapped or overrides.get("memory_path") is not None:
        kw["path"] = where if mapped else overrides["memory_path"]
    device = overrides.get("device", body.get("device", "cpu"))
    if device != "cpu":
        kw["device"] = device
    if overrides.get("process_group") is not None:
        kw["process_group"] = overrides["process_group"]
    replay = build(spec, cap, sampler, **kw)
    ck = None
    try:
        ck = CheckpointComm(replay.comm, "load")
        if exact:
            key_map = _restore_exact(replay, ck, where, body, show, mapped, verify)
        else:
            key_map = reshard.reshard(replay, ck, where, body, show, bool(overrides.get("allow_drop", False)))
    except BaseException as e:
        log.warning("load of %s failed on rank %d: %s", where, mc.rank, e)
        try:
            replay.close()
        except Exception:
            pass
        raise
    finally:
        if ck is not None:
            ck.close()
    log.info("load: rank %d restored %s of %s (%s) in %.2f s", mc.rank, "its shard" if exact else "its part",
             where, ("mapped" if mapped else "exact") if exact else f"resharded from {body['ranks']} ranks",
             time.monotonic() - started)
    return replay, key_map


def _wants_map(mmap: bool, exact: bool, version: int, body: dict, ranks: int) -> bool:
    """Whether this load maps the columns (``mmap=True`` and an exact restore of a version-3 checkpoint);
    warns when ``mmap=True`` must copy instead. The same answer on every rank (all read one manifest)."""
    if not isinstance(mmap, bool):
        raise TypeError(f"mmap must be True or False, got {mmap!r}")
    if not mmap:
        return False
    if version != 3:
        warnings.warn(f"load(mmap=True): this checkpoint has format version {version}, whose column files "
                      f"cannot be mapped; its steps are read (copied) instead", stacklevel=4)
        return False
    if not exact:
        warnings.warn(f"load(mmap=True): the checkpoint was saved on {body['ranks']} ranks with capacity_steps="
                      f"{body['capacity_steps']}, max_items={body['max_items']}; loading it onto {ranks} ranks or "
                      f"other sizes reshards, which copies the steps (into memory= and memory_path= when given)",
                      stacklevel=4)
        return False
    return True


def verify(path, ranks=None) -> None:
    """Check a checkpoint's files against its manifest: sizes and every sha256 (what ``load(mmap=True)``
    skips by default). Local, no communication: any process may run it, e.g. in a thread beside training.

    Args:
        path: the checkpoint directory (the crash-recovery rule applies, as for :func:`load`).
        ranks: the saved ranks whose files to check (None: all).
    Raises:
        CheckpointError: a file missing, of the wrong size, or corrupted; the message names it.
    Cost: reads every file of the given ranks once.
    """
    doc = read_manifest(resolve(os.path.abspath(os.fspath(path))))
    body, where = doc["body"], doc["path"]
    spec = saved_spec(body)
    for r in range(body["ranks"]) if ranks is None else ranks:
        meta = shard_files.read_meta(where, body, r)
        shard_files.read_table(where, body, r, meta)
        shard_files.check_columns(where, body, r, meta, spec)


def _restore_exact(replay, ck: CheckpointComm, where: str, body: dict, show: bool, mapped: bool = False,
                   verify: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Every rank restores its own saved shard and streams; key_map is the identity."""
    rank = ck.rank
    read = None if (verify or not mapped) else (files.TABLE, files.SHARD_JSON)  # mapped: the columns are not read
    nbytes = [shard_files.saved_bytes(body, r, read) for r in range(ck.size)]
    err = None
    with Meter(sum(nbytes), "gear_mpi load", show, ck.size) as meter:  # every rank's bytes
        channel = Channel(ck, "load", nbytes, "read", meter)
        try:
            meta = shard_files.restore_rank(replay.shard, where, body, rank, mapped, verify)
            replay.load_state({"rng": meta["rng_replay"], "shared_rng": body["shared_rng"],
                               "windows_shared": int(meta["windows_shared"]), "windows_mpi": int(meta["windows_mpi"])})
            with replay.shard.hold():  # mapped: raises if another process wrote or truncated the file meanwhile
                pass
        except Exception as e:
            err = e
        channel.finish(err, "load")
    mine = replay.shard.live_keys()
    counts = ck.allgather(np.array([len(mine)], np.int64), "load (keys)")[:, 0]
    keys = np.sort(ck.allgatherv(mine, counts, "load (keys)"))
    return keys, keys.copy()
