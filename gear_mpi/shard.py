"""Shard: one rank's replay -- storage, selection and window collection."""
from __future__ import annotations

import secrets
import threading
from typing import Any, Mapping, Sequence

import numpy as np

from . import batch_memory
from .batch import Batch, check_batch_bytes, check_batch_size, check_window
from .errors import EmptyReplayError, InvalidKeyError
from .kernels import gather as gather_kernels
from .kernels import local_sample, ring
from .keys import GEN_MASK, SLOT_BITS, TAG_MASK, as_key_array, key_head
from .storage.arenas import memory_kind
from .selection import one_call, small_update
from .selection.priority_index import DevicePriorityIndex, PriorityIndex
from .selection.selectors import Selector, Uniform, rank_by_priority
from .storage.shard_insert import ShardInserter
from .checkpoint.shard_state import ShardCheckpointState
from .spec import TrajectorySpec, check_count
from .storage import table as table_layout
from .storage.store import TrajectoryStore
from .storage.file_guard import Hold
from .storage.columns import column_addresses
from .storage.derived import context_of, fill_unstored

_NO_UNIFORMS = np.zeros(0)
_ONE_OWNER = np.ones(1, np.bool_)


class Shard:
    """One rank's replay: a columnar step ring, a trajectory table, a selector. Its parts, built here and
    called explicitly: ``store`` (:class:`~gear_mpi.storage.store.TrajectoryStore`), ``index`` (a priority
    index or None), ``inserter`` (:class:`~gear_mpi.storage.shard_insert.ShardInserter`: the ``insert*``
    methods) and ``checkpoint_state`` (:class:`~gear_mpi.checkpoint.shard_state.ShardCheckpointState`:
    :meth:`state`, :meth:`sections` and their inverses).

    Local: no method communicates. Once closed, inserts, samples, updates and reads raise RuntimeError. One call
    at a time runs kernels over the memory (``lock``, a re-entrant lock that every sample, insert, priority update,
    :meth:`get`, :meth:`locate`, :meth:`priorities`, :meth:`clear` and :meth:`hold` takes; about 0.1 us a call):
    :meth:`close` from another thread waits for the call in flight (a TorchRL prefetch thread's sample) before it
    frees anything, and the calls after it raise. (The numpy views :meth:`columns` returns keep their memory.)
    Memory: ``capacity_steps * step_bytes`` plus 65 bytes per item slot (75 with a priority index).
    ``pickle``, ``copy.copy`` and ``copy.deepcopy`` make a new, independent shard in private host memory with the
    same items, keys and stream (:mod:`gear_mpi.checkpoint.shard_archive`).
    Args:
        spec: the columns and the longest trajectory.
        capacity_steps: steps the ring holds (at least ``spec.max_length``).
        sampler: any :mod:`gear_mpi.selection.selectors` selector (default :class:`Uniform`).
        max_items: trajectory slots (default ``capacity_steps``).
        max_times_sampled: remove an item once it has been sampled that many times (None: never).
        memory: ``"private"`` (anonymous mapping), ``"shm"`` (POSIX shared memory) or ``"file"`` (memory-mapped
            files under ``path``, see :mod:`gear_mpi.storage.file_arenas`); ``"numpy"``: deprecated.
        path: ``memory="file"``: an existing directory; this shard's files go in ``path/rank-NNNNN/``.
        seed: the seed of this shard's random stream (None: fresh entropy).
        rank: the owner rank written into the keys.
        tag: the key tag, 0-255 (None: drawn at random).
        device_context: a ``DeviceContext`` to keep a proportional selector's index on the GPU.
    Raises:
        TypeError: ``spec`` is not a TrajectorySpec or ``sampler`` not a selector.
        ValueError: a size, rank, tag or ``max_times_sampled`` out of range, or an unknown ``memory``.
        StorageError: ``memory="file"``: ``path`` missing or not writable, or not enough disk.
    """

    def __init__(self, spec: TrajectorySpec, capacity_steps: int, sampler: Selector | None = None, *,
                 max_items: int | None = None, max_times_sampled: int | None = None, memory: str = "private",
                 seed: int | None = 0, rank: int = 0, tag: int | None = None, device_context=None, path=None):
        if not isinstance(spec, TrajectorySpec):
            raise TypeError(f"spec must be a TrajectorySpec, got {type(spec).__name__}")
        sampler = Uniform() if sampler is None else sampler
        if not isinstance(sampler, Selector):
            raise TypeError(f"sampler must be a gear_mpi selector (Uniform(), Prioritized(...), ...), got {sampler!r}")
        self.max_times_sampled = check_count(max_times_sampled, "max_times_sampled", optional=True) or 0
        check_count(tag, "tag", 0, optional=True, most=TAG_MASK)
        memory = memory_kind(memory, stacklevel=3)
        self.spec = spec
        self.selector = sampler
        derived = table_layout.derives_priority(sampler)  # the index gives raw priorities back
        self.store = TrajectoryStore(spec, capacity_steps, max_items, memory, rank,
                                     secrets.randbits(8) if tag is None else tag, path=path,
                                     max_times_sampled=self.max_times_sampled, priority_row=not derived,
                                     lazy_priority=sampler.proportional,  # their draws ignore raw priorities
                                     stamp_row=table_layout.stamps_per_item(sampler))
        self.device_context = device_context
        if not sampler.proportional:
            self.index = None
        elif device_context is None:
            self.index = PriorityIndex(self.store.max_items)
        else:  # selection in CUDA kernels over a device-resident index
            self.index = DevicePriorityIndex(self.store.max_items, threads=device_context.threads)
        if derived:
            self.store.priority = table_layout.DerivedPriority(self.index, sampler.alpha)
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.samples_drawn = 0
        self.stale_updates = 0
        self._addresses = None
        self._fused = None  # whether samples go through one kernel (see _one_call)
        self._repeat = None  # the last one-kernel sample's arguments (one_call.Repeat)
        self.lock = threading.RLock()  # held by every call that uses the memory, and by close (see hold)
        self.inserter = ShardInserter(spec, self.store, self.index, sampler)
        self.checkpoint_state = ShardCheckpointState(self.store, self.index, sampler, self.rng)

    # ---- properties -------------------------------------------------------------------
    @property
    def capacity_steps(self) -> int:
        """Steps the ring holds. O(1)."""
        return self.store.capacity

    @property
    def rank(self) -> int:
        """The owner rank in this shard's keys. O(1)."""
        return self.store.rank

    @property
    def tag(self) -> int:
        """The key tag (8 bits) of this shard's keys. O(1)."""
        return self.store.tag

    @property
    def shm_name(self) -> str | None:
        """Name another process maps the columns by: the shared-memory segment's, or (``memory="file"``)
        the columns file's path; None for private memory. O(1)."""
        return self.store.shm_name

    def __len__(self) -> int:
        """Live trajectories (0 once closed). O(1)."""
        return len(self.store)

    @property
    def total_weight(self) -> float:
        """Selection mass: sum of index weights (proportional) or the live count (ordered). O(1)."""
        return self.index.total if self.index is not None else float(len(self))

    @property
    def min_weight(self) -> float:
        """Smallest positive index weight (inf when none; 1 for ordered selectors). O(slots / 4096)."""
        return self.index.min_positive if self.index is not None else (1.0 if len(self) else np.inf)

    def raw_bytes(self) -> int:
        """Bytes of the live trajectories' steps, as inserted. O(1)."""
        return self.store.live_steps * self.spec.step_bytes

    def stored_bytes(self) -> int:
        """Bytes this shard uses to hold them: ring steps in use (of compressed columns: their chunks'
        compressed bytes and open chunk), table rows and index leaves. O(columns)."""
        per_item = (self.store.table_bytes + (self.index.nbytes if self.index is not None else 0)) / self.store.max_items
        raw = int(self.store.gather_step_bytes.sum())
        return self.store.steps_used * raw + self.store.compressed_bytes + int(len(self) * per_item)

    def reserved_bytes(self) -> int:
        """Bytes this shard reserved at construction: the ring's arena, the table and the index. O(1)."""
        index = self.index.nbytes if self.index is not None else 0
        return self.store.arena.nbytes + self.store.table_bytes + index if self.store.arena else 0

    # ---- insertion (ShardInserter) ------------------------------------------------------
    @property
    def bytes_inserted(self) -> int:
        """Bytes of the steps ever stored in this shard, by every insert path (:mod:`gear_mpi.stats`). O(1)."""
        return self.inserter.bytes_inserted

    def insert(self, trajectory: Mapping[str, Any], priority: float = 1.0, *, check_finite: bool = False,
               casting: str = "safe") -> int:
        """Add one trajectory; evicts the oldest (FIFO) when full. Cost: O(L) copy of the steps,
        O(1 + evictions) table work, one index update.

        Args:
            trajectory: column name -> ``[L, *shape]`` array (numpy, torch or nested lists).
            priority: its priority (finite, >= 0).
            check_finite: refuse NaN and infinite step values (off by default, as in numpy; on: one more
                read of the float columns' steps).
            casting: as :meth:`insert_many`.
        Returns:
            Its key (int).
        Raises:
            InvalidTrajectoryError, InvalidPriorityError: as :meth:`insert_many`.
            RuntimeError: the shard is closed.
        """
        return int(self.insert_many([trajectory], [priority], check_finite=check_finite, casting=casting)[0])

    def insert_many(self, trajectories: Sequence[Mapping[str, Any]], priorities: Any = None, *,
                    check_finite: bool = False, casting: str = "safe") -> np.ndarray:
        """Add several trajectories, evicting the oldest (FIFO) to make room; one bad one stores none.
        Cost: one ring copy per column, O(n + evictions) table work in a kernel, one batched index update.

        Args:
            trajectories: a sequence of trajectories (each as :meth:`insert` takes it).
            priorities: one priority per trajectory (None: all 1).
            check_finite: as :meth:`insert`.
            casting: which dtypes a column takes: ``"safe"`` (safe casts, plus any number into a float
                column), ``"same_kind"`` or ``"unsafe"`` (any number into any numeric column, truncating or
                wrapping as numpy's assignment does, as Stable-Baselines3's buffers store).
        Returns:
            Their keys (int64), in order.
        Raises:
            InvalidTrajectoryError: a bad trajectory (see ``TrajectorySpec.validate``), a mapping, or too many;
                with ``check_finite``, a NaN or inf step value (naming the trajectory, column and step).
            InvalidPriorityError: a NaN, infinite or negative priority, or the wrong number of them.
            ValueError: an unknown ``casting``.
            RuntimeError: the shard is closed.
            CheckpointError: the columns map a checkpoint that another process wrote or truncated (:meth:`hold`).
        """
        with self.hold():  # (the open check under the lock)
            return self.inserter.insert_many(trajectories, priorities, check_finite, casting)

    def insert_packed(self, columns: Mapping[str, Any], lengths: Any, priorities: Any = None, *,
                      check_finite: bool = False, casting: str = "safe") -> np.ndarray:
        """Add many trajectories laid end to end: one array per column holding all their steps, and their
        lengths. Checked as :meth:`insert_many` checks a list (the same error classes; one bad input stores
        none), but in whole-array operations: no Python loop over the trajectories.
        Cost: O(n) vectorized checks, then as :meth:`store_packed` -- one ring copy per column (a dtype
        cast happens inside that copy), O(n + evictions) table work in a kernel, one batched index update.

        A batch of more steps than ``capacity_steps`` or more trajectories than ``max_items`` is refused
        whole (it would evict its own head); split it and call again.

        Args:
            columns: column name -> ``[sum(lengths), *shape]`` array (numpy, torch or anything
                ``np.asarray`` takes), any dtype that casts safely to the column's (any number into a float).
            lengths: the steps of each trajectory, in order (integers, each in ``[1, max_length]``).
            priorities: one priority per trajectory (None: all 1).
            check_finite: refuse NaN and infinite step values, as given (see :meth:`insert`).
            casting: as :meth:`insert_many` (``"unsafe"``: the ring copy casts as numpy's assignment).
        Returns:
            Their keys (int64), in order.
        Raises:
            ValueError: an unknown ``casting``.
            InvalidTrajectoryError: a column missing or unknown, of a non-numeric, uncastable dtype or of the
                wrong shape; columns of different step counts; lengths that are not integers, one out of
                ``[1, max_length]``, or a sum other than the columns' steps; too many steps or trajectories;
                with ``check_finite``, a NaN or inf step value (naming the column, trajectory and step).
            InvalidPriorityError: a NaN, infinite or negative priority, or the wrong number of them.
            RuntimeError: the shard is closed.
            CheckpointError: the columns map a checkpoint that another process wrote or truncated (:meth:`hold`).
        """
        with self.hold():  # (the open check under the lock)
            return self.inserter.insert_packed(columns, lengths, priorities, check_finite, casting)

    def append_step(self, step: Mapping[str, Any], priority: float = 1.0) -> int:
        """Add one one-step trajectory (an environment step, as SB3's or CleanRL's buffers add them): the fast
        path of :meth:`insert_packed` for one step. Each column is checked only for what a step needs -- present
        and not unknown, numeric and castable safely to the column's dtype (any number into a float column, as
        :meth:`insert_packed`; a cached answer per dtype pair),
        the column's shape or that shape with a leading 1 -- and the priority, if not the default 1.0; a bad
        step raises before anything is stored. Values are not checked for NaN (use ``insert_packed(...,
        check_finite=True)`` for that). Cost: O(columns) checks and item writes and one numba call (the slot,
        the evictions, O(log n) index work): about 4.5 us for six columns on the reference VM, where SB3's ``add``
        takes 2.6 (:mod:`gear_mpi.storage.step_append`); a store that path does not cover (compressed columns, a
        device index or mirror) takes :meth:`store_packed` for one item. Local; no communication.

        Args:
            step: column name -> the step's value (numpy array or scalar, a CPU tensor, a list), of shape
                ``shape`` or ``(1, *shape)``.
            priority: its priority (finite, >= 0).
        Returns:
            Its key.
        Raises:
            InvalidTrajectoryError: not a mapping; a column missing or unknown, non-numeric, of a dtype that
                does not cast safely, or of another shape.
            InvalidPriorityError: a NaN, infinite or negative priority.
            RuntimeError: the shard is closed.
            CheckpointError: the columns map a checkpoint that another process wrote or truncated (:meth:`hold`).
        """
        with self.lock:  # (the open check and the file guard's hold are the appender's)
            return self.inserter.appender.append(step, priority)

    def store_packed(self, columns: Mapping[str, np.ndarray], lengths: np.ndarray, priorities: np.ndarray,
                     steps: int | None = None) -> np.ndarray:
        """Store already-validated trajectories laid end to end (the common tail of every insert path).
        Cost: one ring copy per column, O(n + evictions) table work in a kernel, one batched index update,
        all in chunks of ``store_insert.CHUNK_ITEMS`` trajectories: besides the keys returned, the
        temporaries are bounded (about 3 MB), whatever the batch.

        Args:
            columns: column name -> all their steps back to back, ``[rows, *shape]``, of a dtype that casts
                to the column's (the ring copy casts: no copy is made before it).
            lengths: int64 steps of each trajectory (each in ``[1, max_length]``, summing to the rows).
            priorities: float64 priorities, validated (finite, >= 0), one per trajectory (or one shared,
                as a stride-0 array).
            steps: ``lengths.sum()`` where the caller knows it (None: summed here), so that a large batch
                reads its lengths once more, not once per use of the sum (each pass over 1e7 lengths: ~8 ms).
        Returns:
            Their keys (int64), in order.
        Raises:
            InvalidTrajectoryError: more steps than ``capacity_steps`` or more trajectories than ``max_items``
                (nothing is stored).
            RuntimeError: the shard is closed.
            CheckpointError: the columns map a checkpoint that another process wrote or truncated (:meth:`hold`).
        """
        with self.hold():  # (the open check under the lock)
            return self.inserter.store_packed(columns, lengths, priorities, steps)

    def clear(self) -> int:
        """Remove every item: the shard is as new (empty, its ring starting again at step 0), its keys
        stale, its memory kept (counted as removed in :meth:`stats`; streams and counters go on). Local.
        Cost: O(items held) table work, one index update.

        Returns:
            How many live items were removed.
        Raises:
            RuntimeError: the shard is closed.
        """
        with self.lock:
            self._check_open()
            live = self.store.clear()
            if self.index is not None and len(live):
                self.index.set(live, np.zeros(len(live)))
            return int(len(live))

    def columns(self, writable: bool = False) -> dict[str, np.ndarray]:
        """The column rings (of the columns stored raw) as numpy arrays over the shard's memory, no copy: column name ->
        ``[capacity_steps, *shape]``, row ``s`` holding ring step ``s`` (a key's steps start at
        ``locate(key)[0]`` and wrap around; rows that hold no live step hold whatever was last written).
        Valid until :meth:`close`. Local. O(columns).

        Args:
            writable: views that write the shard's steps in place (no key, priority or selection changes;
                a Replay's node peers may be reading them); default read-only.
        Returns:
            Column name -> array.
        Raises:
            RuntimeError: the shard is closed.
        """
        self._check_open()
        out = {}
        for name, col in self.store.columns.items():  # compressed columns have no raw ring: not among them
            view = col.view()
            view.flags.writeable = bool(writable) and col.flags.writeable
            out[name] = view
        return out

    # ---- checkpoint state (ShardCheckpointState) ------------------------------------------
    @property
    def index_kind(self) -> str:
        """The priority index's ``KIND`` (``"blocked"`` host, ``"generic"`` device), or ``"none"``. O(1)."""
        return self.checkpoint_state.index_kind

    def state(self) -> dict[str, Any]:
        """Everything this shard holds besides its arrays, JSON-able. O(1); local.

        Returns:
            ``rank``, ``capacity_steps``, ``max_items``, ``hwm`` (slots ever used), ``ring``
            (the ``ring.STATE_SIZE`` counters), ``index`` (:attr:`index_kind`), ``rng``
            (the stream's state), ``samples_drawn``, ``stale_updates``, ``tag`` (key tag).
        """
        return self.checkpoint_state.state(self.samples_drawn, self.stale_updates)

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Take back the stream, counters and key tag of a :meth:`state` (the table and index
        come back through :meth:`restore_sections`). O(1); local.

        Args:
            state: as :meth:`state` returns it (``rng``, ``samples_drawn``, ``stale_updates``, ``tag``).
        Raises:
            KeyError, TypeError, ValueError: a field is missing or the stream's state is invalid.
        """
        self.samples_drawn, self.stale_updates = self.checkpoint_state.load_state(state)

    def sections(self) -> list[tuple[str, np.ndarray]]:
        """The table in use then the priority index, as ``(name, array)`` pairs in checkpoint order.

        Returns:
            The store's ``table_sections()`` then the index's ``sections(hwm)``. Views where
            possible (write them out before the shard changes). Cost: O(1) for a host index;
            a device index copies ``hwm`` weights to the host. Local.
        """
        return self.checkpoint_state.sections()

    def restore_sections(self, state: Mapping[str, Any], sections: Mapping[str, np.ndarray]) -> None:
        """Put :meth:`sections` back into this new, empty shard of the same sizes; then load the
        steps through :meth:`column_segments`. O(hwm); local.

        Args:
            state: the saved shard's :meth:`state` (``ring``, ``hwm``, ``index`` are used).
            sections: the sections by name (the order ring as one array, oldest first); an
                index of another kind than this shard's is rebuilt from ``leaves``.
        Raises:
            ValueError: a section missing or misshapen, counters that do not fit, or an index
                kind that does not fit this shard's selector.
        """
        self.checkpoint_state.restore_sections(state, sections)

    def column_segments(self, name: str) -> list[np.ndarray]:
        """Column ``name``'s ring steps in use as flat byte views, oldest first: read to save,
        filled to load after :meth:`restore_sections`. O(1); local.

        Args:
            name: a column of the spec.
        Returns:
            At most two uint8 views (the ring wraps), ``steps_used * step_bytes`` bytes in all.
        Raises:
            KeyError: no column ``name``.
        """
        return self.checkpoint_state.column_segments(name)

    def live_keys(self) -> np.ndarray:
        """The keys of the live trajectories, oldest first. O(slots used); local.

        Returns:
            int64 keys, one per live trajectory.
        """
        return self.checkpoint_state.live_keys()

    def restore_history(self, keys: Any, stamps: Any, times_sampled: Any) -> None:
        """Give trajectories re-inserted by a reshard their insertion stamps and use counts. O(n); local.

        Args:
            keys: this shard's keys of the re-inserted trajectories (int, sequence, array or tensor).
            stamps: each one's original insertion time (ns, int64).
            times_sampled: each one's original use count.
        Raises:
            TypeError: the keys are not integers.
            InvalidKeyError: a key of another shard or replay.
            StaleKeyError: a key whose trajectory is gone.
        """
        self.checkpoint_state.restore_history(keys, stamps, times_sampled)

    # ---- selection --------------------------------------------------------------------
    def check_can_sample(self) -> None:
        """Check that a draw can be made. O(1).

        Raises:
            EmptyReplayError: no live item, or (proportional selectors) every live item has priority 0.
        """
        if len(self) == 0:
            raise EmptyReplayError("cannot sample: the replay is empty")
        if self.index is not None and self.index.total <= 0.0:
            raise EmptyReplayError("cannot sample: every live item has priority 0")

    def select(self, count: int) -> np.ndarray:
        """Choose ``count`` slots with this shard's selector and stream. Cost: proportional O(count log n)
        (draws with replacement), Fifo/Lifo O(count) (cycling), Max/MinPriority O(N + count log count).

        Args:
            count: how many slots (>= 0).
        Returns:
            The chosen slots (int64, ``count`` of them).
        Raises:
            EmptyReplayError: ``count > 0`` and nothing can be drawn (see :meth:`check_can_sample`).
        """
        if count == 0:
            return np.zeros(0, np.int64)
        self.check_can_sample()
        sel = self.selector
        if self.index is not None:
            if isinstance(self.index, PriorityIndex):
                return self.index.draw(self.rng.random(count))
            return self.index.draw_to_host(self.rng.random(count))  # (their weights kept for make_choices)
        st = self.store
        if sel.by_priority:
            live = ring.live_in_order(st.state, st.alive, st.order, False, len(st))
            picked = rank_by_priority(live, st.layout.priority, count, sel.by_priority > 0)
        else:
            picked = ring.live_in_order(st.state, st.alive, st.order, sel.newest_first, count)
        return np.resize(picked, count) if len(picked) < count else picked

    def ordered_candidates(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Returns up to ``count`` best slots of an ordered selector, best first, and their int64 sort
        keys (smaller is better; exact, so shards merge without rounding). O(N) at most.

        Args:
            count: the most candidates wanted.
        """
        st = self.store
        sel = self.selector
        if len(self) == 0 or count == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        if sel.by_priority:
            live = ring.live_in_order(st.state, st.alive, st.order, False, len(st))
            picked = rank_by_priority(live, st.layout.priority, count, sel.by_priority > 0)
            bits = st.layout.priority[picked].view(np.int64)  # IEEE order == integer order for values >= +0.0
            return picked, -bits if sel.by_priority > 0 else bits.copy()
        picked = ring.live_in_order(st.state, st.alive, st.order, sel.newest_first, count)
        stamps = st.stamp[picked]  # insertion time (ns); ties keep the shard's insertion order
        return picked, -stamps if sel.newest_first else stamps.copy()

    def live_weights(self) -> tuple[np.ndarray, np.ndarray]:
        """Returns the slots with positive index weight (int64) and their weights (float64), for
        proportional selectors. O(slots used).
        """
        leaves = self.index.host_leaves(int(self.store.state[ring.NEXT_FRESH]))
        slots = np.flatnonzero(leaves > 0.0).astype(np.int64)
        return slots, leaves[slots].astype(np.float64)  # a host index's leaves are float32

    def place(self, slots: np.ndarray, window: int, align_code: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ring coordinates of each window. O(B), one kernel.

        Args:
            slots: the chosen slots (int64).
            window: steps per window.
            align_code: the align code (see :func:`~gear_mpi.batch.check_window`).
        Returns:
            ``(start step, real steps, leading padding)``, int64 each, one entry per slot.
        """
        st = self.store
        b = len(slots)
        win_start = np.empty(b, np.int64)
        n_valid = np.empty(b, np.int64)
        pad_front = np.empty(b, np.int64)
        uniforms = self.rng.random(b) if align_code == 0 else _NO_UNIFORMS  # read only by "random"
        gather_kernels.place_slots(np.ascontiguousarray(slots, np.int64), st.start, st.length, st.capacity, window,
                                   align_code, uniforms, win_start, n_valid, pad_front, self.spec.tail_steps)
        return win_start, n_valid, pad_front

    def after_sampling(self, slots: np.ndarray) -> None:
        """Count uses; remove items that reached ``max_times_sampled``. O(B).

        Args:
            slots: the slots just sampled (int64; each occurrence counts as one use).
        """
        self.samples_drawn += len(slots)
        st = self.store
        removed = st.count_samples(slots, self.max_times_sampled)
        if self.index is not None and len(removed):
            self.index.set(removed, np.zeros(len(removed)))

    def sample(self, batch_size: int, window: int | None = None, align: str = "random",
               out: Batch | None = None, squeeze: bool = False) -> Batch:
        """Sample windows; shorter trajectories are zero-padded (at the end, or at the front for ``"tail"``)
        and ``mask`` marks real steps. Cost: :meth:`select` plus one parallel copy of ``B * W`` steps; a new
        batch is one allocation (:meth:`Batch.empty <gear_mpi.batch.Batch.empty>`). A call with the arguments
        of the last one-kernel call (into the same ``out=``, or again into a new batch) skips the argument
        checks (:mod:`gear_mpi.selection.one_call`).

        Args:
            batch_size: windows to sample (>= 0).
            window: steps per window (None: ``max_length``).
            align: ``"random"`` (start uniform over the windows inside the trajectory), ``"head"`` or ``"tail"``.
            out: a batch to fill and reuse (None: a new one).
            squeeze: one-step windows as ``[B, *shape]`` columns (a squeezed batch; ``window`` must be 1, or
                None on a spec of ``max_length`` 1).
        Returns:
            The :class:`~gear_mpi.batch.Batch` (``out`` when given).
        Raises:
            ValueError, EmptyReplayError: a bad argument (a batch larger than the machine's memory included) or an
                ``out`` that does not fit; nothing to draw. TypeError: ``out`` is not a Batch.
            CheckpointError: the columns map a checkpoint that another process wrote or truncated (:meth:`hold`).
        """
        with self.lock:
            rep = self._repeat  # the same arguments (and out= batch) as a call that took one kernel: skip the checks
            if rep is not None and self._fused and rep.same(out, batch_size, window, align, squeeze):
                return one_call.sample_again(self, rep)
            self._check_open()
            args = (batch_size, window, align, squeeze)
            batch_size = check_batch_size(batch_size)
            window, code = check_window(self.spec, window, align)
            if squeeze and window != 1:
                raise ValueError(f"squeeze=True takes one-step windows (window=1), got window={window}")
            check_batch_bytes(self.spec, batch_size, window)
            if out is not None and not isinstance(out, Batch):
                raise TypeError(f"out= must be a Batch (one an earlier sample returned), got {type(out).__name__}")
            if out is not None and not out.matches(self.spec, batch_size, window, squeeze):
                raise ValueError(f"out= does not fit batch_size={batch_size}, window={window}, squeeze={bool(squeeze)} "
                                 f"of this spec: {out!r}")
            if batch_size > 0:
                self.check_can_sample()
            batch = out if out is not None else Batch.empty(self.spec, batch_size, window, squeeze)
            with self.hold():
                # every batch size and shard size: the one call was as fast or faster wherever measured, shards that
                # sit in cache included (docs/BENCHMARKS.md, "The update's leaves and rows in slot order")
                if batch_size > 0 and self._one_call():
                    one_call.remember(self, batch, args, window, code, fresh=out is None)
                    return one_call.sample_one_call(self, batch, batch_size, window, code)
                slots = self.select(batch_size)
                choices = self.make_choices(slots, window, code, self.total_weight, self.min_weight)
                keys, probabilities, weights, lengths = batch.meta_numpy()
                gather_kernels.gather_from_owners(self.column_addresses(), self.store.gather_step_bytes,
                                                  self.store.capacity, _ONE_OWNER, np.array([0, batch_size], np.int64),
                                                  choices, batch.byte_views(), window, batch._mask_np, keys, lengths,
                                                  probabilities)
                fill_unstored(self.spec, self.store, self.column_addresses()[0], slots, choices, batch, window)
            weights[:] = gather_kernels.choice_records(choices)["weight"]
            self.after_sampling(slots)
            return batch

    def frame_context(self, slots: np.ndarray, choices: np.ndarray) -> np.ndarray:
        """Each chosen window's context (int64; :func:`gear_mpi.storage.derived.context_of`), for the slots and
        choices of :meth:`make_choices`. O(B), one kernel; local."""
        return context_of(self.spec, slots, gather_kernels.choice_records(choices)["start"], self.store.start,
                          self.store.capacity)

    def _one_call(self) -> bool:
        """Whether a sample can go through one kernel (:func:`gear_mpi.selection.one_call.fits`). O(1)."""
        if self._fused is None:
            self._fused = one_call.fits(self)
        return self._fused

    def make_choices(self, slots: np.ndarray, window: int, code: int, total: float, wmin: float) -> np.ndarray:
        """The choice of each slot: what a requester needs to copy and describe its window. O(B), one kernel.

        Args:
            slots: the chosen slots (int64).
            window: steps per window.
            code: the align code (see :func:`~gear_mpi.batch.check_window`).
            total: the selection mass the draw was made over (the whole replay's, for a Replay).
            wmin: the smallest positive weight the draw was made over (likewise).
        Returns:
            ``[len(slots), gather.CHOICE_WIDTH]`` int64, one ``gather.CHOICE`` record per slot (read with
            ``gather.choice_records``): key, ring start, real steps, padding, ``w / total``, importance weight.
        """
        st = self.store
        choices = np.empty((len(slots), gather_kernels.CHOICE_WIDTH), np.int64)
        fields = gather_kernels.choice_records(choices)
        w = np.empty(len(slots), np.float64)
        uniforms = self.rng.random(len(slots)) if code == 0 else _NO_UNIFORMS
        proportional = self.index is not None
        on_host = isinstance(self.index, PriorityIndex)  # a device index: weights gathered on the GPU below
        leaves = self.index.leaves if on_host else _NO_UNIFORMS
        gather_kernels.fill_choices(np.ascontiguousarray(slots, np.int64), st.start, st.length, st.generation,
                                    key_head(st.tag, st.rank), SLOT_BITS, GEN_MASK, st.capacity, window, code,
                                    uniforms, leaves, total, choices, w, self.spec.tail_steps)
        if proportional and not on_host:
            w = self.index.weights_of(slots)
            fields["probability"] = w / total
        if proportional:
            fields["weight"] = self.selector.importance_weights(w, wmin)
        else:
            fields["weight"] = fields["probability"]
        st.prefetch(fields["start"], fields["valid"])  # file-backed columns: start reading the windows now
        return choices

    def column_addresses(self) -> np.ndarray:
        """Returns the address of each column's ring (``[1, columns]`` int64, valid while the shard is
        open), for the gather kernel. O(columns) once, then O(1).
        """
        if self._addresses is None:
            self._addresses = column_addresses(self.store.byte_views(), self.spec, self.store.capacity)[None]
        return self._addresses

    # ---- updates and reads ------------------------------------------------------------
    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Set new priorities, all validated first (a bad one or a foreign key changes nothing); stale keys
        are dropped and counted; of duplicate keys the last wins. Cost: O(B), one batched index update.

        Args:
            keys: this shard's keys (int, sequence, numpy array or tensor).
            priorities: one new priority per key.
        Returns:
            How many were applied (keys still live).
        Raises:
            TypeError, InvalidKeyError, InvalidPriorityError: keys not integers or not this shard's; bad priorities.
        """
        with self.lock:
            return small_update.update_priorities(self, keys, priorities)  # a few keys: one kernel call

    def apply_priorities(self, keys: np.ndarray, priorities: np.ndarray) -> np.ndarray:
        """Set already-validated priorities of this shard's keys. O(B) plus one batched index update.

        Args:
            keys: int64 keys of this shard.
            priorities: float64 priorities, validated, one per key.
        Returns:
            bool mask of the keys applied (live); the others are counted as stale.
        Raises:
            InvalidKeyError: a key of another shard or replay (nothing changed).
        """
        with self.lock:
            self._check_open()
            st = self.store
            layout = st.layout  # the table's raw priorities
            keys = np.ascontiguousarray(keys, np.int64)
            n = len(keys)
            slots, values, live = np.empty(n, np.int64), np.empty(n, np.float64), np.empty(n, np.bool_)
            pr = np.ascontiguousarray(priorities, np.float64)
            if layout.priority_constant is not None and not table_layout.all_equal(pr, layout.priority_constant):
                layout.materialize_priorities()  # the row stood for one value: keep it from now on
            # derived, none, or one value the row stands for: not written
            raw = layout.priority if isinstance(layout.priority, np.ndarray) and layout.priority_constant is None \
                else _NO_UNIFORMS
            applied, foreign = local_sample.resolve_live(keys, pr, st.tag, st.rank, st.max_items, st.status,
                                                         ring.ALIVE_SHIFT, ring.LIVE, raw, raw is not _NO_UNIFORMS,
                                                         slots, values, live)
            if foreign >= 0:
                st.resolve(keys[foreign:foreign + 1])  # raises InvalidKeyError, naming what is wrong with the key
            self.stale_updates += n - applied
            if self.index is not None and applied:
                weigh = self.selector.leaf_weights if isinstance(self.index, PriorityIndex) else self.selector.weights
                self.index.set(slots[:applied], weigh(values[:applied]))  # (a host index rounds them so anyway)
            return live

    def get(self, key: int) -> dict[str, np.ndarray]:
        """A copy of the whole stored trajectory behind ``key``. O(L).

        Args:
            key: one key of this shard.
        Returns:
            Column name -> ``[L, *shape]`` array.
        Raises:
            TypeError, InvalidKeyError, StaleKeyError: not one integer key; not this shard's; evicted or removed.
            CheckpointError: the columns map a checkpoint that another process wrote or truncated (:meth:`hold`).
        """
        keys = as_key_array(key)
        if len(keys) != 1:
            raise InvalidKeyError(f"get() takes one key, got {len(keys)}")
        with self.hold():  # (the open check under the lock)
            return self.store.read(int(keys[0]))

    def locate(self, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        """Returns the ring start step and length of each key (int64; -1 and 0 for stale keys). O(n).

        Args:
            keys: keys of this shard.
        Raises:
            TypeError, InvalidKeyError: keys not integers, or of another shard or replay.
        """
        with self.lock:
            self._check_open()
            slots, live = self.store.resolve(as_key_array(keys))
            st = self.store  # narrow rows (uint32 start, uint8 length): int64 results
            return (np.where(live, st.start[slots].astype(np.int64), -1),
                    np.where(live, st.length[slots].astype(np.int64), 0))

    def priorities(self, keys: Any) -> np.ndarray:
        """Returns the current priority of each key (float64; NaN for stale keys). O(n).

        Args:
            keys: keys of this shard.
        Raises:
            TypeError, InvalidKeyError: keys not integers, or of another shard or replay.
        """
        with self.lock:
            self._check_open()
            slots, live = self.store.resolve(as_key_array(keys))
            return np.where(live, self.store.layout.raw_priorities(slots), np.nan)

    def stats(self) -> dict[str, Any]:
        """This shard's figures, under the names of a replay's (:mod:`gear_mpi.stats`; the table in docs/guide/statistics.md). O(1).

        Returns:
            ``rank`` and every name of ``stats.SHARD_FIGURES``: items, live_steps, steps_used, capacity_steps,
            weight (the selection mass, float), inserted, evicted, removed, sampled, stale_updates,
            stored_bytes, raw_bytes, reserved_bytes.
        """
        s = self.store.state
        return {"rank": self.rank, "items": len(self), "live_steps": self.store.live_steps,
                "steps_used": self.store.steps_used, "capacity_steps": self.capacity_steps,
                "weight": float(self.total_weight), "inserted": int(s[ring.INSERTED_TOTAL]),
                "evicted": int(s[ring.EVICTED_TOTAL]), "removed": int(s[ring.REMOVED_TOTAL]),
                "sampled": self.samples_drawn, "stale_updates": self.stale_updates,
                "stored_bytes": self.stored_bytes(), "raw_bytes": self.raw_bytes(),
                "reserved_bytes": self.reserved_bytes()}

    def hold(self, strict: bool = True) -> Hold:
        """A call's use of the columns, as a context manager: ``with shard.hold(): ...``. Only columns that
        map a checkpoint (``Replay.load(path, mmap=True)``) are guarded (:mod:`gear_mpi.storage.file_guard`):
        while a call holds them, another process that opens the file for writing or truncates it waits;
        once one did, every hold raises (or gives) a CheckpointError. Any memory: the shard's lock is held, so
        that :meth:`close` from another thread waits for the call (re-entrant: a hold inside a hold is one),
        and a closed shard raises on entry.

        Args:
            strict: raise on entry (False: the ``with`` target is the error, or None; collectives agree it).
        Returns:
            The :class:`~gear_mpi.storage.file_guard.Hold`. Cost: O(1), and one ``fstat`` when guarded.
        Raises:
            CheckpointError: (on entry, ``strict``) the mapped file was written or truncated by another process.
            RuntimeError: (on entry) the shard is closed.
        """
        return Hold(getattr(self.store.arena, "guard", None), strict, self.lock, self._check_open)

    def _check_open(self) -> None:
        if self.store.arena is None:
            raise RuntimeError("this Shard is closed")

    def close(self) -> None:
        """Release the columns (and unlink shared memory this shard created), once a call another thread is making
        has finished (the calls after it raise RuntimeError), and the large batch buffers no batch uses any more
        (:func:`gear_mpi.batch_memory.release`). Idempotent."""
        with self.lock:
            self._addresses = self._repeat = None
            self.store.close()
        batch_memory.release()

    def __enter__(self) -> "Shard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Shard(items={len(self)}, steps={self.store.steps_used}/{self.capacity_steps}, "
                f"sampler={self.selector!r}, memory={self.store.arena.kind if self.store.arena else 'closed'})")
