"""Shard: one rank's replay -- storage, selection and window collection."""
from __future__ import annotations

import secrets
from typing import Any, Mapping, Sequence

import numpy as np

from .batch import Batch
from .errors import EmptyReplayError, InvalidKeyError, InvalidTrajectoryError, StaleKeyError
from .kernels import gather as gather_kernels
from .kernels import ring
from .keys import GEN_MASK, SLOT_BITS, TAG_MASK, as_key_array, key_head
from .memory import SharedArena, check_header, column_layout, memory_kind
from .priority_index import DevicePriorityIndex, PriorityIndex
from .selectors import Selector, Uniform, rank_by_priority
from .spec import TrajectorySpec, validate_priorities
from .storage import TABLE_BYTES_PER_SLOT, TrajectoryStore

ALIGNS = {"random": 0, "head": 1, "tail": 2}
_NO_UNIFORMS = np.zeros(0)
_ONE_OWNER = np.ones(1, np.bool_)


def check_window(spec: TrajectorySpec, window: int | None, align: str) -> tuple[int, int]:
    """Validate ``window`` (None means max_length) and ``align``; return (window, align code)."""
    if window is None:
        window = spec.max_length
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be a positive integer or None, got {window!r}")
    if align not in ALIGNS:
        raise ValueError(f"align must be one of {sorted(ALIGNS)}, got {align!r}")
    return int(window), ALIGNS[align]


def check_batch_size(batch_size: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 0:
        raise ValueError(f"batch_size must be a non-negative integer, got {batch_size!r}")
    return int(batch_size)


def gather_into(byte_views: Mapping[str, np.ndarray], spec: TrajectorySpec, capacity: int,
                win_start: np.ndarray, n_valid: np.ndarray, pad_front: np.ndarray,
                out_rows: np.ndarray, batch: Batch) -> None:
    """Copy windows from a shard's columns (``byte_views``, possibly another process's
    shared memory) into rows ``out_rows`` of ``batch``, with padding and mask.

    Cost: one kernel call; a parallel pass per column, each delivered byte copied once; O(B W) for the mask.
    """
    if len(out_rows) == 0:
        return
    starts = np.ascontiguousarray(win_start % capacity, np.int64)
    gather_kernels.gather_columns(tuple(byte_views[name] for name in spec.names), spec.step_bytes_array, capacity,
                                  starts, n_valid, pad_front, out_rows, batch.byte_views(), batch.window,
                                  batch._mask_np)


def column_addresses(byte_views: Mapping[str, np.ndarray], spec: TrajectorySpec, capacity: int) -> np.ndarray:
    """The address of each column ring in ``byte_views`` (int64, in column order), for the gather
    kernels that read by address; raises ValueError if a view is shorter than its ring. The
    views must stay mapped while the addresses are used."""
    out = np.empty(len(spec.columns), np.int64)
    for c, col in enumerate(spec.columns):
        view = byte_views[col.name]
        if view.nbytes < col.step_bytes * capacity:
            raise ValueError(f"column {col.name!r} has {view.nbytes} bytes, shorter than its ring of {capacity} steps")
        out[c] = view.ctypes.data
    return out


def attach_columns(name: str, spec: TrajectorySpec, capacity_steps: int) -> tuple[SharedArena, dict[str, np.ndarray]]:
    """Map another process's shard columns (``Shard(..., memory="shm").shm_name``).

    Returns the arena (close it when done) and the byte view of each column.
    Cost: one mmap; no copy.
    """
    arena = SharedArena.attach(name)
    offsets, nbytes = column_layout(spec, capacity_steps)
    try:
        if arena.nbytes != nbytes:
            raise ValueError(f"shared-memory segment {name!r} has {arena.nbytes} bytes; "
                             f"this spec and capacity need {nbytes}")
        check_header(arena.buffer, spec, capacity_steps, name)
    except ValueError:
        arena.close()
        raise
    views = {c.name: arena.buffer[offsets[c.name]:offsets[c.name] + c.step_bytes * capacity_steps]
             for c in spec.columns}
    return arena, views


class Shard:
    """One rank's replay: a columnar step ring, a trajectory table and a selector.

    ``sampler`` is any :mod:`gear_mpi.selectors` selector (default :class:`Uniform`).
    ``max_times_sampled`` removes an item once it has been sampled that many times.
    ``memory`` is ``"private"`` (an anonymous private mapping of this process) or
    ``"shm"`` (POSIX shared memory that other processes on the node attach to by
    :attr:`shm_name`); ``"numpy"`` is the deprecated name of ``"private"``. ``rank`` and ``tag`` go
    into the keys; ``seed`` fixes the random stream.
    """

    def __init__(self, spec: TrajectorySpec, capacity_steps: int, sampler: Selector | None = None, *,
                 max_items: int | None = None, max_times_sampled: int | None = None, memory: str = "private",
                 seed: int | None = 0, rank: int = 0, tag: int | None = None, device_context=None):
        if not isinstance(spec, TrajectorySpec):
            raise TypeError(f"spec must be a TrajectorySpec, got {type(spec).__name__}")
        sampler = Uniform() if sampler is None else sampler
        if not isinstance(sampler, Selector):
            raise TypeError(f"sampler must be a gear_mpi selector (Uniform(), Prioritized(...), ...), got {sampler!r}")
        if max_times_sampled is not None and (isinstance(max_times_sampled, bool) or int(max_times_sampled) < 1):
            raise ValueError(f"max_times_sampled must be a positive integer or None, got {max_times_sampled!r}")
        memory = memory_kind(memory, stacklevel=3)
        self.spec = spec
        self.selector = sampler
        self.max_times_sampled = int(max_times_sampled or 0)
        self.store = TrajectoryStore(spec, capacity_steps, max_items, memory, rank,
                                     secrets.randbits(8) if tag is None else tag)
        self.device_context = device_context
        if not sampler.proportional:
            self.index = None
        elif device_context is None:
            self.index = PriorityIndex(self.store.max_items)
        else:  # selection in CUDA kernels over a device-resident index
            self.index = DevicePriorityIndex(self.store.max_items, threads=device_context.threads)
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.samples_drawn = 0
        self.stale_updates = 0
        self._addresses = None

    # ---- properties -------------------------------------------------------------------
    @property
    def capacity_steps(self) -> int:
        return self.store.capacity

    @property
    def rank(self) -> int:
        return self.store.rank

    @property
    def tag(self) -> int:
        return self.store.tag

    @property
    def shm_name(self) -> str | None:
        """Name of the shared-memory segment holding the columns (None for private memory)."""
        return self.store.shm_name

    def __len__(self) -> int:
        """Live trajectories. O(1)."""
        return len(self.store)

    @property
    def total_weight(self) -> float:
        """Selection mass: sum of index weights (proportional) or the live count (ordered)."""
        return self.index.total if self.index is not None else float(len(self))

    @property
    def min_weight(self) -> float:
        """Smallest positive index weight (inf when none; 1 for ordered selectors)."""
        return self.index.min_positive if self.index is not None else (1.0 if len(self) else np.inf)

    def raw_bytes(self) -> int:
        """Bytes of the live trajectories' steps, as inserted."""
        return self.store.live_steps * self.spec.step_bytes

    def stored_bytes(self) -> int:
        """Bytes this shard uses to hold them: ring steps in use, table rows and index leaves."""
        per_item = TABLE_BYTES_PER_SLOT + (10 if self.index is not None else 0)  # index: ~9.3 bytes a slot
        return self.store.steps_used * self.spec.step_bytes + len(self) * per_item

    # ---- insertion --------------------------------------------------------------------
    def insert(self, trajectory: Mapping[str, Any], priority: float = 1.0) -> int:
        """Add one trajectory; returns its key. Evicts the oldest (FIFO) when full.

        Cost: O(L) copy of the steps, O(1 + evictions) table work, one index update.
        """
        return int(self.insert_many([trajectory], [priority])[0])

    def insert_many(self, trajectories: Sequence[Mapping[str, Any]], priorities: Any = None) -> np.ndarray:
        """Add several trajectories at once; returns their keys (int64).

        All are validated before anything changes: one bad trajectory or priority
        raises and stores none. Cost: one concatenation and one ring copy per
        column (no Python loop over steps), O(n + evictions) table work in a kernel,
        one batched index update.
        """
        self._check_open()
        if isinstance(trajectories, Mapping):
            raise InvalidTrajectoryError("insert_many takes a sequence of trajectories; use insert() for one")
        trajectories = list(trajectories)
        n = len(trajectories)
        if n == 0:
            return np.zeros(0, np.int64)
        pr = validate_priorities(np.ones(n) if priorities is None else priorities, n)
        checked = [self.spec.validate(t, where=f"trajectory {i}" if n > 1 else "trajectory")
                   for i, t in enumerate(trajectories)]
        lengths = np.array([length for _, length in checked], np.int64)
        self.store.check_batch(lengths)
        if n == 1:
            columns = checked[0][0]
        else:
            columns = {c.name: np.concatenate([cols[c.name] for cols, _ in checked]) for c in self.spec.columns}
        slots, evicted = self.store.insert(columns, lengths, pr)
        if self.index is not None:
            self.index.set(evicted, np.zeros(len(evicted)))
            self.index.set(slots, self.selector.weights(pr))
        return self.store.keys_of(slots)

    # ---- selection --------------------------------------------------------------------
    def check_can_sample(self) -> None:
        if len(self) == 0:
            raise EmptyReplayError("cannot sample: the replay is empty")
        if self.index is not None and self.index.total <= 0.0:
            raise EmptyReplayError("cannot sample: every live item has priority 0")

    def select(self, count: int) -> np.ndarray:
        """Choose ``count`` slots by this shard's selector (its own random stream).

        Proportional: independent draws with replacement, O(count log n).
        Fifo/Lifo: O(count) (cycling when fewer are live). Max/MinPriority: O(N + count log count).
        """
        if count == 0:
            return np.zeros(0, np.int64)
        self.check_can_sample()
        sel = self.selector
        if self.index is not None:
            slots = self.index.draw(self.rng.random(count))
            return slots if isinstance(slots, np.ndarray) else slots.copy_to_host()
        st = self.store
        if sel.by_priority:
            live = ring.live_in_order(st.state, st.alive, st.order, False, len(st))
            picked = rank_by_priority(live, st.priority, count, sel.by_priority > 0)
        else:
            picked = ring.live_in_order(st.state, st.alive, st.order, sel.newest_first, count)
        return np.resize(picked, count) if len(picked) < count else picked

    def ordered_candidates(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``count`` best slots of an ordered selector, best first, with int64 sort keys
        (smaller is better; exact, so shards merge without rounding). O(N) at most."""
        st = self.store
        sel = self.selector
        if len(self) == 0 or count == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        if sel.by_priority:
            live = ring.live_in_order(st.state, st.alive, st.order, False, len(st))
            picked = rank_by_priority(live, st.priority, count, sel.by_priority > 0)
            bits = st.priority[picked].view(np.int64)  # IEEE order == integer order for values >= +0.0
            return picked, -bits if sel.by_priority > 0 else bits.copy()
        picked = ring.live_in_order(st.state, st.alive, st.order, sel.newest_first, count)
        stamps = st.stamp[picked]  # insertion time (ns); ties keep the shard's insertion order
        return picked, -stamps if sel.newest_first else stamps.copy()

    def live_weights(self) -> tuple[np.ndarray, np.ndarray]:
        """Slots with positive index weight, and those weights (proportional selectors). O(slots used)."""
        leaves = self.index.host_leaves(int(self.store.state[ring.NEXT_FRESH]))
        slots = np.flatnonzero(leaves > 0.0).astype(np.int64)
        return slots, leaves[slots]

    def place(self, slots: np.ndarray, window: int, align_code: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ring coordinates of each window: (start step, real steps, leading padding). O(B)."""
        st = self.store
        b = len(slots)
        win_start = np.empty(b, np.int64)
        n_valid = np.empty(b, np.int64)
        pad_front = np.empty(b, np.int64)
        uniforms = self.rng.random(b) if align_code == 0 else _NO_UNIFORMS  # read only by "random"
        gather_kernels.place_slots(np.ascontiguousarray(slots, np.int64), st.start, st.length, st.capacity, window,
                                   align_code, uniforms, win_start, n_valid, pad_front)
        return win_start, n_valid, pad_front

    def after_sampling(self, slots: np.ndarray) -> None:
        """Count uses; remove items that reached ``max_times_sampled``. O(B)."""
        self.samples_drawn += len(slots)
        st = self.store
        removed = st.count_samples(slots, self.max_times_sampled)
        if self.index is not None and len(removed):
            self.index.set(removed, np.zeros(len(removed)))

    def sample(self, batch_size: int, window: int | None = None, align: str = "random",
               out: Batch | None = None) -> Batch:
        """Sample ``batch_size`` windows of ``window`` steps (None: max_length).

        ``align``: ``"random"`` (start uniform over the windows inside the
        trajectory), ``"head"`` or ``"tail"``; shorter trajectories are zero-padded
        (at the end, or at the front for ``"tail"``) and ``mask`` marks real steps.
        Returns a new Batch (or fills ``out``, reused). Cost: selection (see
        :meth:`select`) plus one parallel copy of ``B * W`` steps.
        """
        self._check_open()
        batch_size = check_batch_size(batch_size)
        window, code = check_window(self.spec, window, align)
        if out is not None and not out.matches(self.spec, batch_size, window):
            raise ValueError(f"out= does not fit batch_size={batch_size}, window={window} of this spec: {out!r}")
        if batch_size > 0:
            self.check_can_sample()
        batch = out if out is not None else Batch.empty(self.spec, batch_size, window)
        slots = self.select(batch_size)
        choices = self.make_choices(slots, window, code, self.total_weight, self.min_weight)
        keys, probabilities, weights, lengths = batch.meta_numpy()
        gather_kernels.gather_from_owners(self.column_addresses(), self.spec.step_bytes_array, self.store.capacity,
                                          _ONE_OWNER, np.array([0, batch_size], np.int64), choices, batch.byte_views(),
                                          window, batch._mask_np, keys, lengths, probabilities)
        weights[:] = gather_kernels.choice_records(choices)["weight"]
        self.after_sampling(slots)
        return batch

    def make_choices(self, slots: np.ndarray, window: int, code: int, total: float, wmin: float) -> np.ndarray:
        """The choice of each chosen slot: what a requester needs to copy and describe its window.

        Args:
            slots: the chosen slots (int64).
            window: steps per window; ``code``: the align code (see :func:`check_window`).
            total, wmin: the selection mass and smallest weight the draw was made over (the whole
                replay's, for a Replay).

        Returns:
            ``[len(slots), gather.CHOICE_WIDTH]`` int64: one record of dtype ``gather.CHOICE`` per slot
            (key, ring start, real steps, leading padding, probability ``w / total``, importance
            weight); read fields with ``gather.choice_records``. Cost: O(B), one kernel plus the
            selector's weights.
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
                                    uniforms, leaves, total, choices, w)
        if proportional and not on_host:
            w = self.index.weights_of(slots)
            fields["probability"] = w / total
        if proportional:
            fields["weight"] = self.selector.importance_weights(w, wmin)
        else:
            fields["weight"] = fields["probability"]
        return choices

    def column_addresses(self) -> np.ndarray:
        """The address of each column's ring (``[1, columns]`` int64), for the gather kernel; built once."""
        if self._addresses is None:
            self._addresses = column_addresses(self.store.byte_views(), self.spec, self.store.capacity)[None]
        return self._addresses

    # ---- updates and reads ------------------------------------------------------------
    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Set new priorities; returns how many were applied. Stale keys are dropped and counted.

        Validates everything first (a bad priority or a foreign key changes
        nothing). Duplicate keys: the last value wins. Cost: O(B) plus one batched
        index update.
        """
        keys = as_key_array(keys)
        pr = validate_priorities(priorities, len(keys))
        return int(self.apply_priorities(keys, pr).sum())

    def apply_priorities(self, keys: np.ndarray, priorities: np.ndarray) -> np.ndarray:
        """Set already-validated priorities of this shard's keys; returns the mask of keys applied."""
        self._check_open()
        slots, live = self.store.resolve(keys)
        self.stale_updates += int((~live).sum())
        s, pr = slots[live], priorities[live]
        self.store.priority[s] = pr
        if self.index is not None:
            self.index.set(s, self.selector.weights(pr))
        return live

    def get(self, key: int) -> dict[str, np.ndarray]:
        """A copy of the whole stored trajectory behind ``key`` (StaleKeyError if evicted). O(L)."""
        self._check_open()
        keys = as_key_array(key)
        if len(keys) != 1:
            raise InvalidKeyError(f"get() takes one key, got {len(keys)}")
        return self.store.read(int(keys[0]))

    def locate(self, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        """Ring start step and length of each live key (-1, 0 for stale keys). O(n)."""
        self._check_open()
        slots, live = self.store.resolve(as_key_array(keys))
        return np.where(live, self.store.start[slots], -1), np.where(live, self.store.length[slots], 0)

    def priorities(self, keys: Any) -> np.ndarray:
        """Current priority of each key (NaN for stale keys). O(n)."""
        self._check_open()
        slots, live = self.store.resolve(as_key_array(keys))
        return np.where(live, self.store.priority[slots], np.nan)

    # ---- state (checkpoints) ----------------------------------------------------------
    @property
    def index_kind(self) -> str:
        """The priority index's ``KIND`` (``"blocked"`` host, ``"generic"`` device), or ``"none"``."""
        return "none" if self.index is None else self.index.KIND

    def state(self) -> dict[str, Any]:
        """Everything this shard holds besides its arrays, JSON-able. O(1); local.

        Returns:
            ``rank``, ``capacity_steps``, ``max_items``, ``hwm`` (slots ever used), ``ring``
            (the ``ring.STATE_SIZE`` counters), ``index`` (:attr:`index_kind`), ``rng``
            (the stream's state), ``samples_drawn``, ``stale_updates``, ``tag`` (key tag).
        """
        s = self.store.state
        return {"rank": self.rank, "capacity_steps": self.capacity_steps, "max_items": self.store.max_items,
                "hwm": int(s[ring.NEXT_FRESH]), "ring": [int(v) for v in s], "index": self.index_kind,
                "rng": self.rng.bit_generator.state, "samples_drawn": int(self.samples_drawn),
                "stale_updates": int(self.stale_updates), "tag": int(self.tag)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Take back the stream, counters and key tag of a :meth:`state` (the table and index
        come back through :meth:`restore_sections`). O(1); local.

        Args:
            state: as :meth:`state` returns it (``rng``, ``samples_drawn``, ``stale_updates``, ``tag``).
        Raises:
            KeyError, TypeError, ValueError: a field is missing or the stream's state is invalid.
        """
        self.rng.bit_generator.state = state["rng"]
        self.samples_drawn = int(state["samples_drawn"])
        self.stale_updates = int(state["stale_updates"])
        self.store.tag = int(state["tag"]) & TAG_MASK

    def sections(self) -> list[tuple[str, np.ndarray]]:
        """The table in use then the priority index, as ``(name, array)`` pairs in checkpoint order:
        the store's ``table_sections()`` and the index's ``sections(hwm)``. Views where possible
        (write them out before the shard changes); a device index copies ``hwm`` weights to the host."""
        out = list(self.store.table_sections())
        if self.index is not None:
            out += self.index.sections(int(self.store.state[ring.NEXT_FRESH]))
        return out

    def restore_sections(self, state: Mapping[str, Any], sections: Mapping[str, np.ndarray]) -> None:
        """Put :meth:`sections` back into this new, empty shard of the same sizes; then load the
        steps through :meth:`column_segments`. O(hwm).

        Args:
            state: the saved shard's :meth:`state` (``ring``, ``hwm``, ``index`` are used).
            sections: the sections by name (the order ring as one array, oldest first); an
                index of another kind than this shard's is rebuilt from ``leaves``.
        Raises:
            ValueError: a section missing or misshapen, counters that do not fit, or an index
                kind that does not fit this shard's selector.
        """
        if (state["index"] == "none") != (self.index is None):
            raise ValueError(f"priority index {state['index']!r} does not fit the sampler {self.selector!r}")
        self.store.restore_table(np.asarray(state["ring"], np.int64), sections)
        if self.index is not None:
            given = sections if state["index"] == self.index.KIND else {"leaves": sections.get("leaves")}
            self.index.restore(given, int(state["hwm"]))

    def column_segments(self, name: str) -> list[np.ndarray]:
        """Column ``name``'s ring steps in use as flat byte views, oldest first (at most two):
        read to save, filled to load after :meth:`restore_sections`. KeyError if unknown. O(1)."""
        return self.store.step_segments(name)

    def live_keys(self) -> np.ndarray:
        """The keys of the live trajectories, oldest first (int64). O(slots used); local."""
        return self.store.keys_of(self.store.live_slots())

    def restore_history(self, keys: Any, stamps: Any, times_sampled: Any) -> None:
        """Give trajectories re-inserted by a reshard their insertion stamps (ns) and use counts. O(n).

        Raises:
            InvalidKeyError: a key of another shard or replay. StaleKeyError: a key whose trajectory is gone.
        """
        keys = as_key_array(keys)
        slots, live = self.store.resolve(keys)
        if not live.all():
            raise StaleKeyError(f"key {int(keys[np.flatnonzero(~live)[0]])}: its trajectory is gone")
        self.store.stamp[slots] = np.asarray(stamps, np.int64)
        self.store.times_sampled[slots] = np.asarray(times_sampled, np.int64)

    def stats(self) -> dict[str, Any]:
        """Counters of this shard (O(1))."""
        s = self.store.state
        return {"rank": self.rank, "items": len(self), "live_steps": self.store.live_steps,
                "steps_used": self.store.steps_used, "capacity_steps": self.capacity_steps,
                "total_weight": self.total_weight, "inserted": int(s[ring.INSERTED_TOTAL]),
                "evicted": int(s[ring.EVICTED_TOTAL]), "removed": int(s[ring.REMOVED_TOTAL]),
                "sampled": self.samples_drawn, "stale_updates": self.stale_updates,
                "stored_bytes": self.stored_bytes(), "raw_bytes": self.raw_bytes()}

    def _check_open(self) -> None:
        if self.store.arena is None:
            raise RuntimeError("this Shard is closed")

    def close(self) -> None:
        """Release the columns (and unlink shared memory this shard created). Idempotent."""
        self._addresses = None
        self.store.close()

    def __enter__(self) -> "Shard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Shard(items={len(self)}, steps={self.store.steps_used}/{self.capacity_steps}, "
                f"sampler={self.selector!r}, memory={self.store.arena.kind if self.store.arena else 'closed'})")
