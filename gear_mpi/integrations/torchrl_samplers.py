"""TorchRL's ``Sampler``s over a :class:`~gear_mpi.integrations.torchrl_storage.GearStorage`: the collective
global draw (:class:`GearSampler`) and windows in ``SliceSampler``'s layout (:class:`GearSliceSampler`);
priority updates routed to the owners. :mod:`gear_mpi.integrations.torchrl` tells the whole.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchrl.data.replay_buffers.samplers import PrioritizedSampler, Sampler

from ..selection.selectors import Prioritized, Selector
from ..spec import check_count
from .torchrl_storage import GearStorage, check_storage, index_keys, nested_key


class GearSampler(Sampler):
    """TorchRL's ``Sampler`` over a :class:`GearStorage`: one-step items drawn from every rank's shard.

    Args:
        max_capacity: accepted for ``PrioritizedSampler``'s signature; the storage's ``max_size`` decides.
        alpha, beta: a prioritized replay (``gm.Prioritized(alpha, beta)``) when the storage builds it; with a
            replay given to the storage, None or its own values.
        eps: added to each priority given (TorchRL's, so that no item gets priority 0).
        reduction: how priorities of one item given several times in a call are combined: ``"max"``,
            ``"min"``, ``"mean"`` or ``"median"`` (windows give one per step).
        mode: the sampling mode of every draw (None: the replay's; see :data:`gear_mpi.replay.MODES`).
    """

    def __init__(self, max_capacity: int | None = None, alpha: float | None = None, beta: float | None = None,
                 eps: float = 1e-8, dtype=None, reduction: str = "max", *, mode: str | None = None):
        if (alpha is None) != (beta is None):
            raise ValueError("give both alpha and beta (a prioritized replay) or neither")
        if reduction not in ("max", "min", "mean", "median"):
            raise ValueError(f"reduction must be 'max', 'min', 'mean' or 'median', got {reduction!r}")
        if alpha is not None:
            Prioritized(alpha, beta)  # its checks now (a bad alpha or beta), not at the first write
        self._alpha, self._beta, self._eps, self.reduction, self.mode = alpha, beta, float(eps), reduction, mode

    def selector(self) -> Selector | None:
        """The selector ``alpha``/``beta`` ask for (None: none asked)."""
        return None if self._alpha is None else Prioritized(self._alpha, self._beta)

    def storage_hints(self) -> dict:
        """What the storage's first write builds the replay with, unless the storage says otherwise: the
        ``selector`` (None: not asked), whether items are trajectories (``slices``), ``end_keys``, ``traj_key``."""
        return {"selector": self.selector(), "slices": False, "end_keys": None, "traj_key": None}

    @property
    def default_priority(self) -> float:
        """NaN: "keep the item's priority" (what TorchRL asks for items without a priority entry)."""
        return float("nan")

    def sample(self, storage: GearStorage, batch_size: int) -> tuple[torch.Tensor, dict]:
        """Collective: ``batch_size`` items drawn from every rank's shard (:meth:`gear_mpi.Replay.sample`).

        Returns:
            ``(keys, info)``; info holds ``"priority_weight"`` for a prioritized replay.
        Raises:
            ValueError: a storage of trajectories (use :class:`GearSliceSampler`); EmptyReplayError: every
            shard is empty; CollectiveTimeoutError: a rank did not arrive.
        """
        storage = check_storage(storage)
        if storage.trajectories:
            raise ValueError("GearSampler draws one-step items; this storage holds trajectories: use GearSliceSampler")
        batch = storage.draw(batch_size, 1, self.mode)
        data = storage.layout.build({n: t[:, 0] for n, t in batch.data.items()}, (batch.batch_size,))
        index = batch.keys
        storage.hand_over(index, data)
        return index, ({"priority_weight": batch.weights} if storage.prioritized else {})

    def update_priority(self, index: Any, priority: Any, *, storage: GearStorage | None = None) -> None:
        """Set the priority of the items ``index`` names (gear_mpi keys, any rank's).

        Collective (:meth:`gear_mpi.Replay.update_priorities`), except for the index the storage's last write
        returned (priorities given with the data: this rank's own items, set here) and for all-NaN priorities
        (TorchRL's default: nothing to do). ``eps`` is added; an item named several times gets ``reduction``
        of its values.

        Raises:
            InvalidKeyError, InvalidPriorityError: bad keys or priorities on some rank (on every rank; nothing
                changes, the priority of new items included).
        """
        storage = check_storage(storage)
        replay = storage._require("update_priority")
        raw_index = torch.stack(index, -1) if isinstance(index, tuple) else index
        last, storage._last_write = storage._last_write, None
        try:
            given = torch.as_tensor(priority)
            if given.is_complex():  # a cast to float64 would drop the imaginary parts
                raise TypeError("complex priorities")
            pr = given.detach().to(torch.float64).reshape(-1).cpu().numpy()
            keys = index_keys(raw_index)
        except (TypeError, ValueError, RuntimeError):  # text, ragged lists, keys that are not integers
            pr = keys = None
        if keys is None or not (len(pr) in (1, len(keys))):  # gear_mpi's checks say what is wrong, on every rank
            replay.update_priorities(raw_index, priority)
            return
        if len(pr) == 1:
            pr = np.full(len(keys), pr[0])
        if len(pr) and np.isnan(pr).all():
            return
        keep = keys >= 0  # TorchRL's -1: nothing written there
        keys, pr = _reduce(keys[keep], pr[keep] + self._eps, self.reduction)
        fresh = last is not None and (raw_index is last[0] or (last[1] is not None and len(keys) == 1
                                                              and int(keys[0]) == last[1]))
        if fresh:  # what extend/add just wrote, with the priorities the data carried: this rank's own items
            storage.apply_local(keys, pr)
        else:
            replay.update_priorities(keys, pr)
        if len(pr):  # applied: new items start at the highest priority given (not raised by a refused update)
            storage.note_priority(float(pr.max()))

    def can_sample(self, storage: GearStorage, batch_size: int) -> bool:
        """Collective: whether any rank's shard holds an item (one allgather, :meth:`gear_mpi.Replay.stats`)."""
        storage = check_storage(storage)
        if storage.replay is None:
            return False
        return storage.replay.stats()["total"]["items"] > 0

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self._alpha, "beta": self._beta, "eps": self._eps, "reduction": self.reduction}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._eps = float(state_dict.get("eps", self._eps))
        self.reduction = state_dict.get("reduction", self.reduction)

    def _empty(self) -> None:
        return

    def dumps(self, path) -> None:
        """Write :meth:`state_dict` as ``path/sampler.json`` (every rank writes the same). Local."""
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "sampler.json").write_text(json.dumps(self.state_dict()))

    def loads(self, path) -> None:
        self.load_state_dict(json.loads((Path(path) / "sampler.json").read_text()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(alpha={self._alpha}, beta={self._beta}, eps={self._eps}, mode={self.mode})"


class GearSliceSampler(GearSampler):
    """Windows of consecutive steps in TorchRL's ``SliceSampler`` layout, drawn from every rank's shard.

    ``rb.sample(batch_size)`` draws ``num_slices`` windows of ``slice_len`` steps (one of them given, the other
    ``batch_size`` divided by it) and returns them flat, ``[num_slices * slice_len]``, slice after slice. A
    window starts anywhere in its trajectory (TorchRL's distribution: a trajectory, then a start). Trajectories
    shorter than ``slice_len`` give short windows: with ``strict_length=True`` (default) they are drawn again
    (a collective round each time, up to ``max_redraws``), with ``pad_output=True`` padded by repeating their
    last step (``("collector", "mask")`` marks the real ones), else their real steps only (a shorter batch).
    ``truncated_key`` is set at each slice's last real step (done is or-ed with it, terminated read), and
    ``init_key`` at each slice's first step when the data has that entry.

    Args:
        num_slices, slice_len: one of them.
        end_key, end_keys, traj_key: how the storage cuts writes into trajectories (when it does not say).
        truncated_key, init_key, strict_length, pad_output: as TorchRL's ``SliceSampler``.
        max_redraws: ``strict_length``: rounds of redraws before giving up (an error on every rank).
        alpha, beta, eps, reduction, mode: as :class:`GearSampler`.
    Raises:
        ValueError: both or neither of ``num_slices``/``slice_len``; ``pad_output`` with ``strict_length``.
    """

    def __init__(self, *, num_slices: int | None = None, slice_len: int | None = None, end_key=None, end_keys=None,
                 traj_key=None, truncated_key=("next", "truncated"), init_key="is_init", strict_length: bool = True,
                 pad_output: bool = False, max_redraws: int = 16, alpha: float | None = None, beta: float | None = None,
                 eps: float = 1e-8, reduction: str = "max", mode: str | None = None):
        super().__init__(None, alpha, beta, eps, None, reduction, mode=mode)
        if (num_slices is None) == (slice_len is None):
            raise ValueError("give exactly one of num_slices and slice_len")
        for name, v in (("num_slices", num_slices), ("slice_len", slice_len)):
            check_count(v, name, optional=True)  # (int() took 2.5 and "2" as 2)
        check_count(max_redraws, "max_redraws", 0)
        if pad_output and strict_length:
            raise ValueError("pad_output=True is incompatible with strict_length=True: give strict_length=False")
        if end_key is not None and end_keys is not None:
            raise ValueError("end_key and end_keys are exclusive")
        self.num_slices, self.slice_len = num_slices, slice_len
        keys = end_keys if end_keys is not None else ([end_key] if end_key is not None else None)
        self.end_keys = None if keys is None else tuple(nested_key(k) for k in keys)
        self.traj_key, self.truncated_key, self.init_key = traj_key, truncated_key, init_key
        self.strict_length, self.pad_output, self.max_redraws = bool(strict_length), bool(pad_output), max_redraws

    def storage_hints(self) -> dict:
        """As :meth:`GearSampler.storage_hints`: trajectories, cut at ``end_keys`` and changes of ``traj_key``."""
        return {"selector": self.selector(), "slices": True, "end_keys": self.end_keys, "traj_key": self.traj_key}

    def _sizes(self, batch_size: int) -> tuple[int, int]:
        """(slice length, number of slices) for ``batch_size`` steps."""
        if self.slice_len is not None:
            if batch_size % self.slice_len:
                raise ValueError(f"The batch-size must be divisible by the slice length, got batch_size={batch_size} "
                                 f"and slice_len={self.slice_len}")
            return self.slice_len, batch_size // self.slice_len
        if batch_size % self.num_slices:
            raise ValueError(f"The batch-size must be divisible by the number of slices, got batch_size={batch_size} "
                             f"and num_slices={self.num_slices}")
        return max(1, batch_size // self.num_slices), self.num_slices if batch_size else 0

    def sample(self, storage: GearStorage, batch_size: int) -> tuple[tuple[torch.Tensor], dict]:
        """Collective: the windows (see the class docstring); an argument error on one rank is raised on all.

        Returns:
            ``((keys,), info)``: the key of each step's trajectory, and the truncated/done/terminated entries,
            ``is_init``, ``("collector", "mask")`` and ``"priority_weight"`` as they apply.
        """
        storage = check_storage(storage)
        replay = storage._require("sample")
        err, seq, n = None, 1, 0
        try:
            if not storage.trajectories:
                raise ValueError("GearSliceSampler needs a storage of trajectories (GearStorage(max_length > 1))")
            seq, n = self._sizes(int(batch_size))
        except Exception as e:
            err = e
        replay.comm.agree(err, "GearSliceSampler.sample (arguments)")
        batch = storage.draw(n, seq, self.mode)
        if self.strict_length:
            self._redraw(storage, batch, seq)
        cols, keys, weights, mask, last, starts = _flatten_windows(batch, seq, self.pad_output)
        data = storage.layout.build(cols, (len(keys),))
        info = self._markers(data, len(keys), last, starts, storage.layout.kind == "tensordict")
        if mask is not None:
            info[("collector", "mask")] = mask
        if storage.prioritized:
            info["priority_weight"] = weights
        index = (keys,)
        storage.hand_over(index, data)
        return index, info

    def _redraw(self, storage: GearStorage, batch, seq: int) -> None:
        """Replace the short windows of ``batch`` by new draws until no rank has one (collective rounds)."""
        comm = storage.replay.comm
        for attempt in range(self.max_redraws + 1):
            short = np.flatnonzero(batch.lengths.numpy() < seq)
            table = comm.agree(None, "GearSliceSampler.sample (strict_length)", [float(len(short))])
            if not table.any():
                return
            if attempt == self.max_redraws:
                break
            extra = storage.draw(len(short), seq, self.mode)
            idx = torch.from_numpy(short)
            for name in batch.data:
                batch.data[name][idx] = extra.data[name]
            for mine, theirs in ((batch.mask, extra.mask), (batch.keys, extra.keys), (batch.lengths, extra.lengths),
                                 (batch.weights, extra.weights), (batch.probabilities, extra.probabilities)):
                mine[idx] = theirs
        raise RuntimeError(f"GearSliceSampler(strict_length=True): after {self.max_redraws} redraws, windows still came "
                           f"from trajectories shorter than {seq} steps; most stored trajectories are that short: "
                           f"use strict_length=False (with pad_output=True for a fixed shape)")

    def _markers(self, data: Any, n: int, last: torch.Tensor, starts: torch.Tensor, is_td: bool) -> dict:
        """TorchRL's truncated/done/terminated entries and the is_init marker of each slice's first step."""
        info: dict = {}
        if self.truncated_key is None or not is_td:
            return info
        key = nested_key(self.truncated_key)
        done_key, terminated_key = key[:-1] + ("done",), key[:-1] + ("terminated",)
        done = data.get(done_key, None)
        truncated = torch.zeros((n, 1) if done is None else done.shape, dtype=torch.bool)
        truncated.view(n, truncated[0].numel() if n else 0)[last] = True
        terminated = data.get(terminated_key, None)
        info[key] = truncated
        info[done_key] = truncated.clone() if done is None else done.bool() | truncated
        info[terminated_key] = torch.zeros_like(truncated) if terminated is None else terminated
        if self.init_key is not None:
            init = data.get(self.init_key, None)
            if isinstance(init, torch.Tensor):
                marker = torch.zeros_like(init, dtype=torch.bool)
                marker.view(n, marker[0].numel() if n else 0)[starts] = True
                info[self.init_key] = marker | init.bool()
        return info

    def __repr__(self) -> str:
        return (f"GearSliceSampler(num_slices={self.num_slices}, slice_len={self.slice_len}, "
                f"strict_length={self.strict_length}, pad_output={self.pad_output}, alpha={self._alpha}, "
                f"beta={self._beta}, mode={self.mode})")


# TorchRL treats a PrioritizedSampler's buffer specially (TensorDictReplayBuffer.update_tensordict_priority reads
# the priorities from the data): GearSampler answers its calls, so it counts as one without inheriting its trees.
PrioritizedSampler.register(GearSampler)


def _reduce(keys: np.ndarray, values: np.ndarray, how: str) -> tuple[np.ndarray, np.ndarray]:
    """One value per distinct key (``how`` of its values), keys in first-seen order. O(n log n)."""
    uniq, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    if len(uniq) == len(keys):
        return keys, values
    if how == "max":
        out = np.full(len(uniq), -np.inf)
        np.maximum.at(out, inverse, values)
    elif how == "min":
        out = np.full(len(uniq), np.inf)
        np.minimum.at(out, inverse, values)
    elif how == "mean":
        out = np.bincount(inverse, values) / np.bincount(inverse)
    else:
        out = np.array([np.median(values[inverse == i]) for i in range(len(uniq))])
    order = np.argsort(first)
    return uniq[order], out[order]


def _flatten_windows(batch, seq: int, pad: bool):
    """A batch of ``[S, seq]`` windows as TorchRL's flat slices: full windows as they are, short ones padded by
    their last real step (``pad``) or cut to their real steps. Returns the columns, per-step keys and weights,
    the mask (None when nothing was padded or not ``pad``), each slice's last real step and first step."""
    s = batch.batch_size
    lengths = batch.lengths.clamp(min=1)
    ar = torch.arange(seq)
    valid = ar[None, :] < lengths[:, None]
    mask = None
    if bool(valid.all()):
        cols = {n: t.reshape((s * seq,) + tuple(t.shape[2:])) for n, t in batch.data.items()}
        keep, last = None, torch.arange(s) * seq + seq - 1
    elif pad:
        idx = torch.minimum(ar[None, :], (lengths - 1)[:, None])
        rows = torch.arange(s)[:, None]
        cols = {n: t[rows, idx].reshape((s * seq,) + tuple(t.shape[2:])) for n, t in batch.data.items()}
        keep, mask, last = None, valid.reshape(-1), torch.arange(s) * seq + lengths - 1
    else:
        cols = {n: t[valid] for n, t in batch.data.items()}
        keep, last = valid, torch.cumsum(lengths, 0) - 1
    per_step = [batch.keys[:, None].expand(s, seq), batch.weights[:, None].expand(s, seq)]
    keys, weights = (x[keep] if keep is not None else x.reshape(-1) for x in per_step)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), (last + 1)[:-1]]) if s else torch.zeros(0, dtype=torch.long)
    if mask is not None or keep is None:
        starts = torch.arange(s) * seq
    return cols, keys.contiguous(), weights.contiguous(), mask, last, starts
