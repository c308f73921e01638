"""TorchRL's ``Storage`` and ``Writer`` over a gear_mpi replay (:mod:`gear_mpi.integrations.torchrl` tells the whole).

:class:`GearStorage` keeps this rank's share of the data in this rank's shard of a :class:`gear_mpi.Replay`
(built at the first write from the data's layout, a collective; or given), reads it back by key, empties,
saves and loads it; :class:`GearWriter` hands TorchRL's writes to it and returns the keys. The samplers
(:mod:`gear_mpi.integrations.torchrl_samplers`) draw through :meth:`GearStorage.draw`.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree
from torchrl.data.replay_buffers.storages import Storage
from torchrl.data.replay_buffers.writers import TensorDictRoundRobinWriter, Writer

from ..distributed.comm import MpiComm
from ..errors import CheckpointError, EmptyReplayError, InvalidKeyError, InvalidTrajectoryError
from ..keys import as_key_array
from ..replay import Replay
from ..selection.selectors import Prioritized, Selector, Uniform
from ..spec import whole_number
from ..storage.shard_insert import check_packed_columns, checked_lengths, checked_priorities
from .torchrl_layout import Layout, as_batch, trajectory_lengths

DEFAULT_END_KEYS = (("next", "done"),)
AUTO_TRAJ_KEYS = ("episode", ("collector", "traj_ids"))


def _identity(data):
    return data


class GearStorage(Storage):
    """TorchRL's ``Storage`` over a gear_mpi replay: this rank's shard holds what this rank writes.

    Args:
        max_size: steps each rank's shard holds (the replay holds ``ranks * max_size``); taken from ``replay``
            when one is given.
        replay: an open :class:`gear_mpi.Replay` to use (its columns must be those the data has: see
            :class:`~gear_mpi.integrations.torchrl_layout.Layout`; ``layout=`` names them); None: one is built at
            the first write.
        selector: the replay's selector (default: the sampler's ``alpha``/``beta`` make ``gm.Prioritized``, else
            ``gm.Uniform``).
        max_length: the longest trajectory; 1 (default without a slice sampler): one-step items; more (default
            ``max_size`` with a :class:`GearSliceSampler`): each write is cut into trajectories.
        end_keys: entries whose true value ends a trajectory (default: the slice sampler's, else
            ``(("next", "done"),)``).
        traj_key: an entry whose change of value starts a trajectory (default: the slice sampler's, else
            ``"episode"`` or ``("collector", "traj_ids")`` when the data has it).
        layout: with ``replay``: the data's layout, when the replay's columns are not named as the layout of
            the first write would name them.
        comm, seed, timeout, replay_kwargs: for the replay built at the first write (:class:`gear_mpi.Replay`).
        compilable: TorchRL's flag (kept; gear_mpi does not compile).
    Raises:
        ValueError: neither ``max_size`` nor ``replay``, or a bad ``max_length``.
    """

    #: the sampler of a buffer given no sampler (set to GearSampler by :mod:`gear_mpi.integrations.torchrl`)
    default_sampler: Any = None

    def __init__(self, max_size: int | None = None, *, replay: Replay | None = None, selector: Selector | None = None,
                 max_length: int | None = None, end_keys=None, traj_key=None, layout: Layout | None = None,
                 comm=None, seed: int = 0, timeout: float = 60.0, compilable: bool = False, **replay_kwargs):
        if replay is None and max_size is None:
            raise ValueError("GearStorage needs max_size (steps a rank's shard holds) or replay=")
        for name, value in (("max_size", max_size), ("max_length", max_length)):  # refused now, not at the first write
            if value is not None and not whole_number(value):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        size = replay.shard.capacity_steps if replay is not None else int(max_size)
        super().__init__(max_size=size, compilable=compilable)
        self._replay, self._owned, self._layout = replay, False, layout
        self._selector, self._max_length = selector, max_length
        self._end_keys = None if end_keys is None else tuple(nested_key(k) for k in end_keys)
        self._traj_key = traj_key
        self._comm, self._seed, self._timeout, self._replay_kwargs = comm, seed, timeout, replay_kwargs
        self._pending = None          # (index, data) of the last draw, handed over by get()
        self._last_write = None       # (index, key of one datum) the last write returned: priorities for it are local
        self._new_priority = 1.0      # a new item's priority: the highest this rank has set (TorchRL's default)
        if replay is not None:
            self._adopt(replay, layout)

    # ---- what it holds --------------------------------------------------------------------
    @property
    def replay(self) -> Replay | None:
        """The replay (None until the first write builds it)."""
        return self._replay

    @property
    def layout(self) -> Layout | None:
        """How the data maps onto the replay's columns (None until known)."""
        return self._layout

    @property
    def trajectories(self) -> bool:
        """Whether items are trajectories (else one step each). Known once the replay exists."""
        return self._replay is not None and self._replay.spec.max_length > 1

    @property
    def prioritized(self) -> bool:
        """Whether the replay draws in proportion to priorities (importance weights are returned)."""
        return self._replay is not None and isinstance(self._replay.selector, Prioritized)

    def __len__(self) -> int:
        """Steps held in this rank's shard (local, O(1); 0 before the first write and once closed)."""
        if self._replay is None or self._replay.closed:
            return 0
        return int(self._replay.shard.store.live_steps)

    # ---- TorchRL's hooks ---------------------------------------------------------------------
    def attach(self, buffer: Any) -> None:
        """Register ``buffer`` (TorchRL calls this as it builds the buffer, before its sampler, writer and collate
        function): the defaults it would take follow the storage -- :attr:`default_sampler` for no sampler,
        :class:`GearWriter` for no writer (or TensorDictReplayBuffer's default one), the identity for no collate
        function (a batch comes collated) -- and TorchRL's prefetch is refused on several ranks.

        Raises:
            ValueError: ``prefetch`` on a buffer of a replay over more than one rank.
        """
        if getattr(buffer, "_prefetch_cap", 0) and self._ranks() > 1:
            raise ValueError("GearStorage: TorchRL's prefetch threads would issue the collective samples in a "
                             "different order on each rank; build the buffer without prefetch (or prefetch with "
                             "replay.batches())")
        if hasattr(buffer, "_init_collate_fn") and buffer._init_collate_fn is None:
            buffer._init_collate_fn = _identity
        if hasattr(buffer, "_init_sampler") and buffer._init_sampler is None and self.default_sampler is not None:
            buffer._init_sampler = self.default_sampler
        writer = getattr(buffer, "_init_writer", GearWriter)
        if writer is None or (isinstance(writer, functools.partial) and writer.func is TensorDictRoundRobinWriter
                              and not writer.args and set(writer.keywords) <= {"compilable"}):
            buffer._init_writer = GearWriter
        super().attach(buffer)

    def set(self, cursor, data, *, set_cursor: bool = True):
        """Refused: gear_mpi gives each item a key as it stores it; items are not written at positions.

        Raises:
            TypeError: always (use ``writer=GearWriter()``).
        """
        raise TypeError("GearStorage stores items through GearWriter (ReplayBuffer(..., writer=GearWriter())): "
                        "gear_mpi gives each item its key when it stores it, and items are not overwritten in place")

    def get(self, index: Any) -> Any:
        """The data behind ``index``: the last draw's batch when ``index`` is what the sampler returned for it;
        ``slice(None)``: every item of this rank's shard, oldest first; else keys of this rank's items. Local.

        Raises:
            InvalidKeyError: a key of another rank or replay (a batch of other ranks' items comes from a sample).
            StaleKeyError: an item evicted since.
            RuntimeError: nothing stored yet.
        Cost: the last draw: O(1); keys: one copy of each item.
        """
        pending, self._pending = self._pending, None
        if pending is not None and (index is pending[0] or same_keys(index, pending[0])):
            return pending[1]
        replay = self._require("get")
        if isinstance(index, slice):
            if index != slice(None):
                raise InvalidKeyError(f"GearStorage reads by key; of slices only [:] (every item here), got {index!r}")
            keys = replay.shard.live_keys()
            return self._read(keys, single=False)
        single = isinstance(index, (int, np.integer)) or (isinstance(index, torch.Tensor) and index.ndim == 0)
        return self._read(index_keys(index), single)

    def contains(self, item: Any) -> Any:
        """Whether each key names a live item of this rank's shard (False for other ranks' keys). Local, O(n)."""
        if self._replay is None:
            return False
        try:
            keys = index_keys(item)
        except TypeError:
            return False
        shard = self._replay.shard
        out = np.zeros(len(keys), np.bool_)
        for i, k in enumerate(keys.tolist()):
            try:
                out[i] = shard.locate([k])[1][0] > 0
            except InvalidKeyError:
                out[i] = False
        return bool(out[0]) if isinstance(item, (int, np.integer)) else torch.from_numpy(out)

    def __iter__(self):
        """This rank's items, oldest first (local)."""
        if self._replay is None:
            return
        for k in self._replay.shard.live_keys().tolist():
            yield self._read(np.array([k], np.int64), single=True)

    def _empty(self) -> None:
        """Empty this rank's shard (:meth:`gear_mpi.Replay.clear`; local)."""
        self._pending = self._last_write = None
        if self._replay is not None:
            self._replay.clear()

    # ---- writes (GearWriter calls these) -------------------------------------------------------
    def write(self, data: Any, single: bool = False) -> Any:
        """Store a batch (or one datum with ``single``) in this rank's shard; the first write builds the replay.

        A one-step storage stores each element of dim 0 as an item; a trajectory storage takes ``[T]`` steps
        in time order or ``[rows, T]`` (each row its own stream) and cuts them into trajectories (see
        :func:`~gear_mpi.integrations.torchrl_layout.trajectory_lengths`): a trajectory that goes on in the
        next write is stored as two items. Items beyond the shard's room evict the oldest (FIFO).

        Returns:
            The key of each element (each step of a trajectory carries its trajectory's key), shaped as the
            data's batch; an int for ``single``.
        Raises:
            InvalidTrajectoryError: data that does not fit the layout (named entry), or dims missing.
            CollectiveError, CollectiveTimeoutError, ValueError: the first write failed on some rank.
        Cost: local (the first: the replay's collective construction); one packed insert per ``max_size`` steps.
        """
        data = as_batch(data, single)
        if self._replay is None:
            self._build(data)
        elif self._layout is None:
            self._layout = self._layout_of(data, self._replay.spec.max_length)
            if self._layout.spec(self._replay.spec.max_length) != self._replay.spec:
                layout, self._layout = self._layout, None
                raise InvalidTrajectoryError(f"the data's columns {layout.spec(self._replay.spec.max_length)} are not "
                                             f"the replay's {self._replay.spec}")
            if self._traj_key is None:
                self._traj_key = auto_traj_key(data)
        layout, replay = self._layout, self._replay
        lead = layout.leading(data)
        if not self.trajectories and len(lead) != 1:
            lead = lead[:1]
        if self.trajectories and len(lead) not in (1, 2):
            raise InvalidTrajectoryError(f"a trajectory storage takes [T] or [rows, T] steps, got batch {lead}")
        columns = layout.columns(data, len(lead))
        rows, steps = (1, lead[0]) if len(lead) == 1 else lead
        if self.trajectories:
            lengths = trajectory_lengths(data, rows, steps, replay.spec.max_length, self._end_keys, self._traj_key)
        else:
            lengths = np.ones(rows * steps, np.int64)
        keys = self._insert(columns, lengths)
        index = torch.from_numpy(np.repeat(keys, lengths)).reshape(lead)
        self._last_write = (index, int(keys[0]) if single else None)
        self._bump_mutation_revision()
        return int(index.reshape(-1)[0]) if single else index

    def _insert(self, columns: dict[str, torch.Tensor], lengths: np.ndarray) -> np.ndarray:
        """Packed inserts of at most a shard's steps and slots each (a larger write evicts its own head)."""
        store = self._replay.shard.store
        ends = np.cumsum(lengths)
        keys, lo, first = [], 0, 0
        while lo < len(lengths):
            hi = int(np.searchsorted(ends, ends[lo] - lengths[lo] + store.capacity, side="right"))
            hi = min(max(hi, lo + 1), lo + store.max_items, len(lengths))
            last = int(ends[hi - 1])
            part = {n: c[first:last] for n, c in columns.items()}
            keys.append(self._replay.insert_packed(part, lengths[lo:hi], np.full(hi - lo, self._new_priority)))
            lo, first = hi, last
        return np.concatenate(keys) if keys else np.zeros(0, np.int64)

    def _build(self, data: Any, layout: Layout | None = None) -> None:
        """Collective: the layout of the first write (or ``layout``; agreed), then the replay (gear_mpi.Replay's
        construction)."""
        comm = MpiComm(self._comm, self._timeout)
        err = None
        try:
            hints = self._sampler_hints()
            asked = hints.get("selector")
            selector = self._selector or asked or Uniform()
            if asked is not None and repr(asked) != repr(selector):
                raise ValueError(f"the storage's selector {selector!r} and the sampler's alpha/beta ({asked!r}) "
                                 f"differ; give one of them")
            slices = bool(hints.get("slices"))
            max_length = self._max_length or (self.max_size if slices else 1)
            if slices and max_length < 2:
                raise ValueError("GearSliceSampler needs a storage of trajectories: max_length > 1")
            self._end_keys = self._end_keys or hints.get("end_keys") or DEFAULT_END_KEYS
            if self._traj_key is None:
                self._traj_key = hints["traj_key"] if hints.get("traj_key") is not None else auto_traj_key(data)
            layout = layout or self._layout_of(data, max_length)
            spec = layout.spec(max_length)
        except Exception as e:  # agreed below: every rank raises it
            err = e
        comm.agree(err, "GearStorage (first write: the data's layout)")
        self._replay = Replay(spec, self.max_size, selector, comm=self._comm, seed=self._seed, timeout=self._timeout,
                              **self._replay_kwargs)
        self._owned, self._layout = True, layout

    @staticmethod
    def _layout_of(data: Any, max_length: int) -> Layout:
        """The layout of a first write: ``[rows, T]`` TensorDicts of a trajectory storage have two step dims."""
        two = max_length > 1 and getattr(data, "batch_dims", 1) >= 2
        return Layout.of(data, 2 if two else 1)

    def _adopt(self, replay: Replay, layout: Layout | None) -> None:
        if layout is not None and tuple(layout.names) != tuple(replay.spec.names):
            raise ValueError(f"layout columns {layout.names} differ from the replay's {list(replay.spec.names)}")
        if self._end_keys is None:
            self._end_keys = DEFAULT_END_KEYS

    def _sampler_hints(self) -> dict:
        """What the sampler of a buffer this storage belongs to asks of the replay (its ``storage_hints()``)."""
        for buffer in self._attached_entities:
            hints = getattr(getattr(buffer, "_sampler", None), "storage_hints", None)
            if hints is not None:
                return hints()
        return {}

    # ---- draws (the samplers call these) -------------------------------------------------------
    def draw(self, batch_size: int, window: int, mode: str | None):
        """Collective: :meth:`gear_mpi.Replay.sample` of ``batch_size`` windows of ``window`` steps (the
        TorchRL wording of an empty replay's error).

        Raises:
            EmptyReplayError: ``"Cannot sample from an empty storage ..."``: every shard is empty.
            RuntimeError: nothing written on this rank yet (its first write builds the replay).
        """
        replay = self._require("sample")
        self._last_write = None
        try:
            return replay.sample(batch_size, window, mode=mode)
        except EmptyReplayError as e:
            raise EmptyReplayError(f"Cannot sample from an empty storage (every rank's shard): {e}") from None

    def hand_over(self, index: Any, data: Any) -> None:
        """Keep a draw's data for the ``get(index)`` the buffer makes next. O(1)."""
        self._pending = (index, data)

    def apply_local(self, keys: np.ndarray, priorities: np.ndarray) -> None:
        """Priorities of this rank's own, just written items: set here, no communication."""
        self._replay.settle()
        self._replay.shard.update_priorities(keys, priorities)

    def note_priority(self, highest: float) -> None:
        """Raise the priority new items get to ``highest`` when it is higher (TorchRL's max priority)."""
        if np.isfinite(highest):
            self._new_priority = max(self._new_priority, float(highest))

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's items and their priorities, oldest first, with the layout. Local.

        Returns:
            ``{"layout", "max_length", "columns": {name: tensor of every step}, "lengths", "priorities"}``
            (``{"layout": None}`` before the first write).
        Cost: one copy of each item (for large shards prefer :meth:`dumps`).
        """
        if self._replay is None:
            return {"layout": None}
        shard = self._replay.shard
        keys = shard.live_keys()
        items = [shard.get(int(k)) for k in keys]
        columns = {n: torch.from_numpy(np.concatenate([it[n] for it in items]) if items
                                       else np.zeros((0,) + c.shape, c.dtype))
                   for n, c in zip(self._replay.spec.names, self._replay.spec.columns)}
        return {"layout": self._layout.state(), "max_length": self._replay.spec.max_length, "columns": columns,
                "lengths": torch.from_numpy(np.array([len(it[self._replay.spec.names[0]]) for it in items], np.int64)),
                "priorities": torch.from_numpy(shard.priorities(keys) if len(keys) else np.zeros(0))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replace this rank's items by those of a :meth:`state_dict` (local; before the first write, the
        replay is built from its layout: a collective, as a first write is). Keys change. The state is checked
        whole before anything is replaced: a bad one leaves the items as they were.

        Raises:
            ValueError: a state of another layout than this storage's, or lacking an entry.
            InvalidTrajectoryError: columns missing, unknown or of the wrong shape or dtype, or lengths that are
                not in ``[1, max_length]`` or do not sum to the columns' steps.
            InvalidPriorityError: a NaN, infinite or negative priority, or not one per item.
        """
        if state_dict.get("layout") is None:
            if self._replay is not None:
                self._empty()
            return
        missing = [k for k in ("columns", "lengths", "priorities") if k not in state_dict]
        if missing:
            raise ValueError(f"load_state_dict: the state lacks {missing} (a GearStorage.state_dict() has them)")
        layout = Layout.from_state(state_dict["layout"])
        if self._replay is None:
            self._max_length = self._max_length or int(state_dict.get("max_length", 1))
            self._build(None, layout)
        elif layout != self._layout:
            raise ValueError(f"state of another layout: {layout} against this storage's {self._layout}")
        spec = self._replay.spec
        lengths, total = checked_lengths(state_dict["lengths"], spec.max_length, spec.min_length)
        columns = check_packed_columns(spec, dict(state_dict["columns"]), total)
        priorities = checked_priorities(state_dict["priorities"], len(lengths))
        self._empty()
        if len(lengths):
            saved = self._new_priority
            keys = self._insert(columns, lengths)
            self._new_priority = saved
            self.apply_local(keys, priorities)
        self._bump_mutation_revision()

    def dumps(self, path) -> None:
        """Collective: a gear_mpi checkpoint of every shard (:meth:`gear_mpi.Replay.save`) in ``path/replay``,
        beside the layout (``path/layout.pt``). Every rank passes the same ``path``.

        Raises:
            RuntimeError: nothing written yet; CheckpointError: see :meth:`gear_mpi.Replay.save`.
        """
        replay = self._require("dumps")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if replay.rank == 0:
            tmp = path / "layout.pt.tmp"
            torch.save({"layout": self._layout.state(), "new_priority": self._new_priority}, tmp)
            tmp.replace(path / "layout.pt")
        replay.save(path / "replay")

    def loads(self, path) -> None:
        """Collective: replace the replay by the checkpoint :meth:`dumps` wrote (on any number of ranks:
        :meth:`gear_mpi.Replay.load`); keys change. The replay this storage built is closed once the new one
        is loaded: a load that fails (on any rank) leaves the storage as it was. Memory: both replays are held
        while the new one loads (close the storage first to load a large checkpoint into a large replay).

        Raises:
            CheckpointError: ``path/layout.pt`` missing or unreadable on some rank (on every rank); see
                :meth:`gear_mpi.Replay.load`.
        """
        path = Path(path)
        comm = self._replay.comm.comm if self._replay is not None else self._comm
        timeout = self._replay.comm.timeout if self._replay is not None else self._timeout
        saved, layout, err = None, None, None
        try:
            saved = torch.load(path / "layout.pt", weights_only=False)
            layout = Layout.from_state(saved["layout"])
        except Exception as e:  # noqa: BLE001 -- agreed: every rank raises it
            err = CheckpointError(f"{path / 'layout.pt'}: cannot be read (not a GearStorage.dumps directory?): "
                                  f"{type(e).__name__}: {e}")
        MpiComm(comm, timeout).agree(err, "GearStorage.loads")
        replay, _ = Replay.load(path / "replay", comm, timeout=timeout)
        if self._replay is not None and self._owned:
            self._replay.close()
        self._replay, self._owned, self._layout = replay, True, layout
        self._new_priority = float(saved.get("new_priority", 1.0))
        self._pending = self._last_write = None
        self.max_size = self._replay.shard.capacity_steps
        self._end_keys = self._end_keys or DEFAULT_END_KEYS
        self._bump_mutation_revision()

    def close(self) -> None:
        """Collective: close the replay this storage built (a replay given to it is the caller's). Idempotent."""
        if self._replay is not None and self._owned:
            self._replay.close()
        self._owned = False

    def __enter__(self) -> "GearStorage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self):
        if self._replay is not None:
            raise TypeError("a GearStorage holding a replay cannot be pickled: its shard lives in this process (save "
                            "it with dumps(path), a collective)")
        return super().__getstate__()

    def __repr__(self) -> str:
        return f"GearStorage(max_size={self.max_size}, replay={self._replay!r}, layout={self._layout!r})"

    # ---- helpers --------------------------------------------------------------------------------
    def _require(self, what: str) -> Replay:
        if self._replay is None:
            raise RuntimeError(f"GearStorage.{what}: nothing has been written on this rank yet (the first write "
                               f"builds the replay, on every rank together)")
        return self._replay

    def _ranks(self) -> int:
        if self._replay is not None:
            return self._replay.ranks
        from mpi4py import MPI
        return (self._comm or MPI.COMM_WORLD).Get_size()

    def _read(self, keys: np.ndarray, single: bool) -> Any:
        """Items of this rank by key: one-step items stacked ``[n, ...]``, trajectories' steps concatenated; a
        TensorDict carries each step's key under ``"index"``."""
        shard = self._replay.shard
        items = [shard.get(int(k)) for k in keys]
        names = self._replay.spec.names
        cols = {n: torch.from_numpy(np.concatenate([it[n] for it in items]) if items
                                    else np.zeros((0,) + c.shape, c.dtype))
                for n, c in zip(names, self._replay.spec.columns)}
        steps = int(cols[names[0]].shape[0])
        data = self._layout.build(cols, (steps,))
        if self._layout.kind == "tensordict":
            data.set("index", torch.from_numpy(np.repeat(keys, [len(it[names[0]]) for it in items]).astype(np.int64)
                                               if items else np.zeros(0, np.int64)))
        if not single or self.trajectories:
            return data
        return pytree.tree_map(lambda x: x[0], data) if self._layout.kind == "pytree" else data[0]


class GearWriter(Writer):
    """TorchRL's ``Writer`` for a :class:`GearStorage`: the storage stores, this returns the keys it got.

    Local (a storage's first write is collective: see :meth:`GearStorage.write`).
    """

    def __init__(self, compilable: bool = False) -> None:
        super().__init__(compilable=compilable)
        self._write_count = 0

    def register_storage(self, storage: Storage) -> None:
        """Raises TypeError for any storage but a :class:`GearStorage`."""
        self._storage = check_storage(storage)

    def add(self, data: Any) -> int:
        """Store one datum; returns its key."""
        index = self._storage.write(data, single=True)
        self._write_count += 1
        return index

    def extend(self, data: Any) -> torch.Tensor:
        """Store a batch (see :meth:`GearStorage.write`); returns a key per element."""
        index = self._storage.write(data)
        self._write_count += int(index.numel())
        return index

    def _empty(self, empty_write_count: bool = True) -> None:
        if empty_write_count:
            self._write_count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"_write_count": self._write_count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._write_count = int(state_dict.get("_write_count", 0))

    def dumps(self, path) -> None:
        """This rank's count, as ``path/writer-rank<R>.json``. Local."""
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / f"writer-rank{self._rank()}.json").write_text(json.dumps(self.state_dict()))

    def loads(self, path) -> None:
        file = Path(path) / f"writer-rank{self._rank()}.json"
        self.load_state_dict(json.loads(file.read_text()) if file.exists() else {})

    def _rank(self) -> int:
        replay = self._storage.replay if self._storage is not None else None
        return replay.rank if replay is not None else 0


# ---- helpers (the samplers use them too) ------------------------------------------------------
def check_storage(storage: Any) -> GearStorage:
    if not isinstance(storage, GearStorage):
        raise TypeError(f"gear_mpi's sampler and writer work with a GearStorage, got {type(storage).__name__}")
    return storage


def nested_key(key: Any) -> tuple:
    return tuple(key) if isinstance(key, (tuple, list)) else (key,)


def auto_traj_key(data: Any):
    keys = set(data.keys(include_nested=True, leaves_only=True)) if hasattr(data, "keys") and \
        hasattr(data, "batch_size") else set()
    return next((k for k in AUTO_TRAJ_KEYS if k in keys), None)


def index_keys(index: Any) -> np.ndarray:
    """gear_mpi keys from an index (an int, a sequence, a tensor, or TorchRL's tuple of one tensor)."""
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    return as_key_array(index)


def same_keys(a: Any, b: Any) -> bool:
    try:
        ka, kb = index_keys(a), index_keys(b)
    except TypeError:
        return False
    return ka.shape == kb.shape and bool((ka == kb).all())
