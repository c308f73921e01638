"""Checkpoints of a distributed :class:`~gear_mpi.replay.Replay`: collective, checksummed, crash-safe.

``save(replay, path)`` (collective) writes one directory; ``load(path, comm,
build)`` (collective; ``Replay.load`` and ``gear_mpi.load_checkpoint`` pass
``build=Replay``) returns ``(replay, key_map)``. The directory must be on a file
system that every rank sees (a parallel file system on a cluster, any local
directory on one node). Layout (format version 3)::

    path/MANIFEST.json              format, version, spec, ranks, capacity, sampler, key tag,
                                    the shared random stream and the size and sha256 of every
                                    other file; written last, by rank 0
    path/rank-00000/columns.bin     the step columns laid out as the shard's arena (header, each
                                    column's ring at its offset, steps at their ring positions,
                                    unused steps left as holes), so that ``load(mmap=True)`` maps
                                    it (:mod:`~gear_mpi.checkpoint.arena_file`)
    path/rank-00000/table.bin       trajectory-table rows in use, the order ring, the free-slot
                                    stack and the priority index (raw arrays, listed in shard.json)
    path/rank-00000/shard.json      ring counters, statistics and this rank's random streams
    path/rank-00001/...

Version 2 (still loaded) had one ``column-NNN.bin`` per column instead of ``columns.bin``:
the ring steps in use, oldest first.

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
number of ranks (or with another ``capacity_steps``/``max_items``) reshards
(:mod:`~gear_mpi.checkpoint.reshard`); keys change (``key_map`` says how, and
the old keys are refused by the new replay).

Not saved: what lives outside the shards (batches in flight, the node fence) and
trajectories already removed by ``max_times_sampled``.

Modules, one concept each (none imports the replay; each component saves and
restores its own state through its ``state()``/``load_state()``/``sections()``):

- :mod:`~gear_mpi.checkpoint.files`: format constants, checksummed files, the manifest;
- :mod:`~gear_mpi.checkpoint.shard_files`: one rank's files from and into its shard;
- :mod:`~gear_mpi.checkpoint.protocol`: save and load as collectives, the crash-safe install;
- :mod:`~gear_mpi.checkpoint.reshard`: dealing the trajectories to another number of ranks;
- :mod:`~gear_mpi.checkpoint.arena_file`: the version-3 ``columns.bin`` (written, read, mapped, verified);
- :mod:`~gear_mpi.checkpoint.segment_file`: version 4's ring segment files (background checkpoints);
- :mod:`~gear_mpi.checkpoint.table_blocks`: version 5's table in blocks, those unchanged linked (background);
- :mod:`~gear_mpi.checkpoint.incremental`: one rank's snapshot of what changed (copied on write), and its files;
- :mod:`~gear_mpi.checkpoint.pacing`: the background writer's budget (CPU share, bytes/s) and low priority;
- :mod:`~gear_mpi.checkpoint.series`: a directory of numbered checkpoints: newest complete, install, prune;
- :mod:`~gear_mpi.checkpoint.background`: ``Replay.checkpoint_every``: the schedule carried by ``sample``;
- :mod:`~gear_mpi.checkpoint.arrival`: deadlines scaled by the bytes each rank moves, heartbeats,
  slow ranks told from absent ones, all on a duplicate of the replay's communicator.
"""
from __future__ import annotations

from ..errors import CheckpointError
from .files import CHUNK_BYTES, FORMAT, FORMAT_VERSION, MANIFEST, rank_dir, read_manifest, resolve
from .protocol import LOAD_OPTIONS, load, save, verify
from .reshard import remap
from . import background
from .background import BackgroundCheckpoints
from .series import agree_latest, latest

__all__ = ["BackgroundCheckpoints", "CHUNK_BYTES", "CheckpointError", "FORMAT", "FORMAT_VERSION", "LOAD_OPTIONS",
           "MANIFEST", "agree_latest", "background", "latest", "load", "rank_dir", "read_manifest", "remap",
           "resolve", "save", "verify"]
