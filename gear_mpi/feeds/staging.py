"""The shared-memory layout between writers and the shard that owns them.

Two kinds of POSIX shared-memory segment (``/dev/shm``, names from a per-replay
token, so :func:`gear_mpi.storage.arenas.cleanup` finds stale ones after a killed job):

- the **registry** ``gear_mpi_in_<token>`` (one per rank, made by the owner; its
  name is the *writer address*): the owner's pid, a closed flag, the *hold* word
  (the rate limiter's cap on each writer's staged episodes, 0: none), the spec as
  JSON, and one *announce* word per writer slot;
- one **staging area** ``gear_mpi_in_<token>_w<k>`` per writer: a single-producer,
  single-consumer ring. The writer alone writes the steps, the episode records and
  its "published" counters; the owner alone writes its "consumed" counters. No lock
  crosses processes.

A writer claims slot ``k`` by creating segment ``..._w<k>`` with ``O_CREAT | O_EXCL``
(the file system makes the claim atomic), fills its header, then announces its pid
in the registry. The owner frees the slot by clearing the announce word *before*
unlinking the segment, so a new writer can never be announced into a slot that is
still being freed.

Steps go into per-column rings of ``S`` steps; an ended episode gets a record
``(first step, length, priority, end time)`` in a ring of ``E`` records and becomes visible
when the writer moves its published counter past it, after a full memory fence
(:func:`gear_mpi.kernels.hints.publish`). So a writer killed mid-episode leaves its
open steps unpublished: they are never read. The owner advances its consumed
counters (after a fence) once the steps are copied out; the writer reuses room only
behind them.

The hold word is how the owner's rate limiter reaches the writers (issue 30, item 7):
the owner stores ``k >= 1`` there when a writer may have at most ``k`` ended episodes
staged and not yet ingested (its share of the rank's insert allowance plus slack;
:mod:`gear_mpi.feeds.replay_feeds`), and each writer's ``end_episode`` waits while it has
that many. The end time is ``time.monotonic_ns()`` at ``end_episode`` (one clock for
every process of a node), so the owner can tell how old the newest ingested step is.

Everything here is local. Cost: creating or attaching a segment is a few system
calls and one mmap; the counters are plain loads and stores.
"""
from __future__ import annotations

import json
import os

import numpy as np

from ..errors import WriterError
from ..kernels.hints import fence, publish
from ..storage.arenas import ALIGN, SHM_PREFIX, SharedArena
from ..spec import TrajectorySpec

REGISTRY_PREFIX = SHM_PREFIX + "in_"
MAX_WRITERS = 128  # writer slots per rank
_MAGIC_REGISTRY = int.from_bytes(b"GEARREG1", "little")
_MAGIC_STAGING = int.from_bytes(b"GEARSTG2", "little")  # 2: records carry the end time

# registry: int64 words
R_MAGIC, R_OWNER_PID, R_CLOSED, R_SLOTS, R_SPEC_BYTES, R_HOLD = range(6)
_ANNOUNCE_WORD = 64  # the announce words start at byte 512
_SPEC_OFFSET = 4096
_REGISTRY_BYTES = _SPEC_OFFSET + (60 << 10)

# staging header: int64 words, the writer's and the owner's counters on cache lines of their own
S_MAGIC, S_PID, S_STEPS, S_EPISODES, S_CLOSED, S_SPEC_HASH = range(6)
S_PUBLISHED, S_PUBLISHED_STEPS = 8, 9  # written by the writer
S_CONSUMED, S_CONSUMED_STEPS = 16, 17  # written by the owner
_RECORDS_OFFSET = 256
RECORD_WIDTH = 4  # first step, length, priority (float64 bits), end time (time.monotonic_ns())


def spec_hash(spec: TrajectorySpec) -> int:
    """A 63-bit fingerprint of a spec, column order included (it decides the layout). O(columns)."""
    text = json.dumps(spec.to_dict()).encode()
    h = 1469598103934665603
    for b in text:  # FNV-1a, reduced to 63 bits
        h = ((h ^ b) * 1099511628211) & ((1 << 63) - 1)
    return h


_HAS_PROC = os.path.isdir("/proc")


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: it exists and is not a zombie (``os.kill(pid, 0)`` succeeds on a
    zombie, whose parent has not waited for it yet). O(1): one signal check and a read of ``/proc/PID/stat``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not _HAS_PROC:  # nothing to tell a zombie by: believe the signal check
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]  # the field after "(comm)"
    except (OSError, IndexError):  # gone since
        return False
    return state not in (b"Z", b"X")


class Registry:
    """A rank's ingest point: made by the owner (:meth:`create`), opened by writers (:meth:`open`)."""

    def __init__(self, arena: SharedArena):
        self.arena = arena
        self.words = arena.buffer[:_SPEC_OFFSET].view(np.int64)
        self.announce = self.words[_ANNOUNCE_WORD:_ANNOUNCE_WORD + MAX_WRITERS]

    @property
    def name(self) -> str:
        """The segment's name: the writer address."""
        return self.arena.name

    @classmethod
    def create(cls, token: str, spec: TrajectorySpec) -> "Registry":
        """The owner's registry for ``spec`` (this process owns the segment and unlinks it on close).

        Raises:
            ValueError: the spec's description does not fit the registry (over 60 KiB of JSON).
        """
        text = json.dumps(spec.to_dict()).encode()
        if len(text) > _REGISTRY_BYTES - _SPEC_OFFSET:
            raise ValueError(f"the spec's description is {len(text)} bytes, too long for a writer registry")
        arena = SharedArena(_REGISTRY_BYTES, REGISTRY_PREFIX + token)
        reg = cls(arena)
        arena.buffer[_SPEC_OFFSET:_SPEC_OFFSET + len(text)] = np.frombuffer(text, np.uint8)
        reg.words[R_OWNER_PID], reg.words[R_SLOTS], reg.words[R_SPEC_BYTES] = os.getpid(), MAX_WRITERS, len(text)
        publish(reg.words[R_MAGIC:R_MAGIC + 1], _MAGIC_REGISTRY)
        return reg

    @classmethod
    def open(cls, address: str) -> "Registry":
        """A writer's view of the registry named ``address``.

        Raises:
            WriterError: no such ingest point (never made, or its replay closed), or not a gear_mpi one.
        """
        if (not isinstance(address, str) or not address.startswith(REGISTRY_PREFIX) or "/" in address
                or "\x00" in address or len(address.encode(errors="replace")) > 255):
            raise WriterError(f"{address!r:.80} is not a writer address (use replay.writer_address())")
        try:
            arena = SharedArena.attach(address)
        except FileNotFoundError:
            raise WriterError(f"no ingest point {address!r}: its replay was closed, or it is on another node "
                              f"(writers must run on the node of the rank that gave the address)") from None
        except (OSError, ValueError) as e:
            raise WriterError(f"writer address {address!r} cannot be opened: {e}") from None
        if arena.nbytes != _REGISTRY_BYTES:  # checked before any view of the words: a short segment has none
            arena.close()
            raise WriterError(f"shared-memory segment {address!r} is not a gear_mpi writer registry "
                              f"({arena.nbytes} bytes, a registry has {_REGISTRY_BYTES})")
        reg = cls(arena)
        if reg.words[R_MAGIC] != _MAGIC_REGISTRY:
            arena.close()
            raise WriterError(f"shared-memory segment {address!r} is not a gear_mpi writer registry")
        return reg

    @property
    def spec(self) -> TrajectorySpec:
        """The owner's spec. O(spec)."""
        n = int(self.words[R_SPEC_BYTES])
        return TrajectorySpec.from_dict(json.loads(bytes(self.arena.buffer[_SPEC_OFFSET:_SPEC_OFFSET + n])))

    def owner_gone(self) -> str | None:
        """Why the owner can take no more episodes (closed, or its process died or is a zombie), or None.
        O(1) syscalls."""
        if self.words[R_CLOSED]:
            return "its replay was closed"
        if not process_alive(int(self.words[R_OWNER_PID])):
            return f"its owner process (pid {int(self.words[R_OWNER_PID])}) died"
        return None

    def set_hold(self, cap: int) -> None:
        """The owner's cap on each writer's staged episodes: a writer with ``cap`` ended episodes not yet
        ingested waits in ``end_episode``/``insert`` (0: no cap). O(1): one store, fenced when it changes."""
        if int(self.words[R_HOLD]) != cap:
            publish(self.words[R_HOLD:R_HOLD + 1], int(cap))

    def unlink(self) -> None:
        """Remove the registry's name (the owner does at close; a writer does when the owner died). Idempotent."""
        try:
            os.unlink(self.arena.path)
        except (FileNotFoundError, TypeError, AttributeError):
            pass

    def staging_name(self, slot: int) -> str:
        """The segment name of writer slot ``slot``."""
        return f"{self.name}_w{slot}"

    def close(self) -> None:
        """Unmap (the owner also unlinks the registry). Idempotent."""
        self.arena.close()


class Staging:
    """One writer's staging ring (see the module docstring): made by the writer, attached by the owner."""

    def __init__(self, arena: SharedArena, spec: TrajectorySpec, slot: int):
        self.arena, self.spec, self.slot = arena, spec, slot
        self.header = arena.buffer[:_RECORDS_OFFSET].view(np.int64)
        self.steps, self.episodes = int(self.header[S_STEPS]), int(self.header[S_EPISODES])
        end = _RECORDS_OFFSET + self.episodes * RECORD_WIDTH * 8
        self.records = arena.buffer[_RECORDS_OFFSET:end].view(np.int64).reshape(self.episodes, RECORD_WIDTH)
        self.columns: dict[str, np.ndarray] = {}
        pos = -(-end // ALIGN) * ALIGN
        for c in spec.columns:
            nbytes = c.step_bytes * self.steps
            self.columns[c.name] = arena.buffer[pos:pos + nbytes].view(c.dtype).reshape((self.steps,) + c.shape)
            pos += -(-nbytes // ALIGN) * ALIGN

    @staticmethod
    def nbytes(spec: TrajectorySpec, steps: int, episodes: int) -> int:
        """Bytes of a staging segment of ``steps`` steps and ``episodes`` records."""
        pos = -(-(_RECORDS_OFFSET + episodes * RECORD_WIDTH * 8) // ALIGN) * ALIGN
        return pos + sum(-(-(c.step_bytes * steps) // ALIGN) * ALIGN for c in spec.columns)

    @classmethod
    def claim(cls, registry: Registry, spec: TrajectorySpec, steps: int, episodes: int) -> "Staging":
        """Create a staging ring in the first free slot of ``registry`` and announce it (the writer's side).

        Raises:
            WriterError: every slot is taken. MemoryBudgetError: ``/dev/shm`` has no room.
        """
        nbytes = cls.nbytes(spec, steps, episodes)
        for slot in range(int(registry.words[R_SLOTS])):
            if registry.announce[slot]:
                continue
            try:
                arena = SharedArena(nbytes, registry.staging_name(slot))
            except FileExistsError:
                continue
            # reserved at creation (a full /dev/shm raises MemoryBudgetError); the owner unlinks it once
            # drained, so no unlink at this process's exit
            arena._finalizer.detach()
            words = arena.buffer[:_RECORDS_OFFSET].view(np.int64)
            words[S_PID], words[S_STEPS], words[S_EPISODES] = os.getpid(), steps, episodes
            words[S_SPEC_HASH] = spec_hash(spec)
            publish(words[S_MAGIC:S_MAGIC + 1], _MAGIC_STAGING)
            publish(registry.announce[slot:slot + 1], os.getpid())
            return cls(arena, spec, slot)
        raise WriterError(f"ingest point {registry.name!r} has all its {MAX_WRITERS} writer slots taken")

    @classmethod
    def attach(cls, registry: Registry, spec: TrajectorySpec, slot: int) -> "Staging | None":
        """The owner's view of the writer announced in ``slot`` (None when it is not there or not valid)."""
        try:
            arena = SharedArena.attach(registry.staging_name(slot))
        except FileNotFoundError:
            return None
        words = arena.buffer[:_RECORDS_OFFSET].view(np.int64) if arena.nbytes >= _RECORDS_OFFSET else None
        if words is None or words[S_MAGIC] != _MAGIC_STAGING or words[S_SPEC_HASH] != spec_hash(spec) or \
                arena.nbytes < cls.nbytes(spec, int(words[S_STEPS]), int(words[S_EPISODES])):
            arena.close()
            return None
        return cls(arena, spec, slot)

    # ---- the owner's reads -------------------------------------------------------------
    def published(self) -> int:
        """Episodes the writer has published (an acquire: the records and steps before it are visible)."""
        n = int(self.header[S_PUBLISHED])
        fence()
        return n

    def pending(self) -> tuple[int, int]:
        """Episodes and steps the writer has published that the owner has not consumed (never negative). O(1)."""
        steps = int(self.header[S_PUBLISHED_STEPS]) - int(self.header[S_CONSUMED_STEPS])
        return max(self.published() - int(self.header[S_CONSUMED]), 0), max(steps, 0)

    def writer_gone(self) -> bool:
        """Whether the writer closed, or its process no longer runs (exited, killed, or a zombie). O(1) syscalls."""
        if self.header[S_CLOSED]:
            return True
        return not process_alive(int(self.header[S_PID]))

    def mark_consumed(self, episodes: int, steps: int) -> None:
        """Hand room back to the writer: every step before ``steps`` and record before ``episodes`` is copied out."""
        publish(self.header[S_CONSUMED_STEPS:S_CONSUMED_STEPS + 1], steps)
        publish(self.header[S_CONSUMED:S_CONSUMED + 1], episodes)

    def close(self, unlink: bool) -> None:
        """Unmap; ``unlink``: also remove the segment's name."""
        path = self.arena.path
        self.arena.close()
        if unlink:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
