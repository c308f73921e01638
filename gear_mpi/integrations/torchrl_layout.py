"""How TorchRL data (a TensorDict, a tensor or a pytree of tensors) maps onto the columns of a gear_mpi spec.

A :class:`Layout` is made from the first data a :class:`~gear_mpi.integrations.torchrl.GearStorage` stores:
one column per leaf (a TensorDict's nested key ``("next", "obs")`` is the column ``"next.obs"``), with the
leaf's dtype and its shape past the leading batch dimensions. Writes are checked against it (the same leaves,
shapes and dtypes), samples are put back into the same structure, and :func:`trajectory_lengths` cuts a batch
of steps into trajectories at episode ends.

Local, no communication. Imports torch and tensordict (the ``torchrl`` extra).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection
from torch.utils import _pytree as pytree

from ..errors import InvalidTrajectoryError
from ..spec import TrajectorySpec

#: entries TorchRL's buffers write into the data themselves (the storage index, a sampler's weights): never stored
METADATA_KEYS = ("index", "priority_weight")
#: the column of tensor data
TENSOR_COLUMN = "data"


def numpy_dtype(dtype: torch.dtype, where: str) -> np.dtype:
    """The numpy dtype of a torch dtype. O(1).

    Args:
        dtype: a torch dtype.
        where: names the leaf in the error.
    Returns:
        The numpy dtype.
    Raises:
        InvalidTrajectoryError: a dtype numpy has not (bfloat16, ...).
    """
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:
        raise InvalidTrajectoryError(f"{where} has dtype {dtype}, which numpy (and so gear_mpi) cannot hold; "
                                     f"cast it (e.g. to float32) before it is stored") from None


def as_batch(data: Any, single: bool) -> Any:
    """``data`` as a batch along dim 0: one datum gets a batch dimension of 1 (``single``); a Python list is
    a sequence of data, stacked (TorchRL's meaning of a list given to ``extend``). O(data)."""
    if isinstance(data, list):
        if not data:
            raise InvalidTrajectoryError("extend: an empty list")
        first = data[0]
        if isinstance(first, torch.Tensor) or is_tensor_collection(first):
            return torch.stack(data)
        return pytree.tree_map(lambda *xs: torch.stack(xs), *data)
    if single:
        if isinstance(data, torch.Tensor) or is_tensor_collection(data):
            return data.unsqueeze(0)
        return pytree.tree_map(lambda x: torch.as_tensor(x).unsqueeze(0), data)
    return data


class Layout:
    """The columns behind TorchRL data of one structure.

    Args:
        kind: ``"tensordict"``, ``"tensor"`` or ``"pytree"``.
        names: the column names, one per leaf.
        keys: each leaf's key in a TensorDict, or its position among a pytree's leaves.
        shapes: each column's step shape; dtypes: each one's numpy dtype.
        item_batch: a TensorDict item's own batch dimensions, kept in the column shapes.
        treespec: a pytree's structure (None otherwise).
    """

    def __init__(self, kind: str, names: list[str], keys: list, shapes: list[tuple[int, ...]],
                 dtypes: list[np.dtype], item_batch: tuple[int, ...] = (), treespec=None):
        self.kind, self.names, self.keys = kind, list(names), list(keys)
        self.shapes, self.dtypes = [tuple(s) for s in shapes], [np.dtype(d) for d in dtypes]
        self.item_batch, self.treespec = tuple(item_batch), treespec

    # ---- made from data ------------------------------------------------------------------------
    @classmethod
    def of(cls, data: Any, lead: int) -> "Layout":
        """The layout of a batch whose first ``lead`` dimensions are steps (1: a batch of steps or items;
        2: ``[rows, time]``). O(leaves).

        Raises:
            InvalidTrajectoryError: no leaf, a leaf that is not a tensor, a dtype numpy has not, too few dims.
            TypeError: data of no supported kind.
        """
        if isinstance(data, TensorDictBase):
            if data.batch_dims < lead:
                raise InvalidTrajectoryError(f"expected a TensorDict with at least {lead} batch dimension(s), got "
                                             f"batch_size={tuple(data.batch_size)}")
            keys, names, shapes, dtypes = [], [], [], []
            # in one order on every rank: a TensorDict's own order follows how it was built (a collector's
            # batch orders its entries by which came first, which may differ from rank to rank)
            leaves = sorted(data.items(include_nested=True, leaves_only=True), key=lambda kv: _sort_key(kv[0]))
            for key, leaf in leaves:
                if _metadata(key):
                    continue
                if not isinstance(leaf, torch.Tensor):
                    raise InvalidTrajectoryError(f"entry {key!r} is a {type(leaf).__name__}; only tensors can be stored")
                keys.append(key)
                names.append(_unique(".".join(key) if isinstance(key, tuple) else key, names))
                shapes.append(tuple(leaf.shape[lead:]))
                dtypes.append(numpy_dtype(leaf.dtype, f"entry {key!r}"))
            if not keys:
                raise InvalidTrajectoryError("the TensorDict has no tensor to store")
            item_batch = tuple(data.batch_size[lead:]) if lead == 1 else ()
            return cls("tensordict", names, keys, shapes, dtypes, item_batch)
        if isinstance(data, torch.Tensor):
            if data.ndim < lead:
                raise InvalidTrajectoryError(f"expected a tensor with at least {lead} dimension(s), got {tuple(data.shape)}")
            return cls("tensor", [TENSOR_COLUMN], [0], [tuple(data.shape[lead:])],
                       [numpy_dtype(data.dtype, "the tensor")])
        if is_tensor_collection(data):
            raise TypeError(f"{type(data).__name__}: store TensorDicts, tensors or pytrees of tensors (a tensorclass: "
                            f"its .to_tensordict())")
        leaves, spec = pytree.tree_flatten(data)
        if not leaves or not all(isinstance(x, torch.Tensor) for x in leaves):
            raise TypeError(f"cannot store {type(data).__name__}: expected a TensorDict, a tensor or a pytree of tensors")
        for i, x in enumerate(leaves):
            if x.ndim < lead:
                raise InvalidTrajectoryError(f"pytree leaf {i} has shape {tuple(x.shape)}: no batch dimension")
        return cls("pytree", [f"leaf{i}" for i in range(len(leaves))], list(range(len(leaves))),
                   [tuple(x.shape[lead:]) for x in leaves],
                   [numpy_dtype(x.dtype, f"pytree leaf {i}") for i, x in enumerate(leaves)], treespec=spec)

    def spec(self, max_length: int) -> TrajectorySpec:
        """The gear_mpi spec of these columns. O(columns)."""
        return TrajectorySpec({n: (s, d) for n, s, d in zip(self.names, self.shapes, self.dtypes)}, max_length)

    # ---- writes ----------------------------------------------------------------------------------
    def leading(self, data: Any) -> tuple[int, ...]:
        """The batch shape of ``data`` (a TensorDict's batch size less the item's own dimensions). O(1)."""
        if self.kind == "tensordict":
            return tuple(data.batch_size[:data.batch_dims - len(self.item_batch)])
        first = data if self.kind == "tensor" else pytree.tree_flatten(data)[0][0]
        return tuple(first.shape[:first.ndim - len(self.shapes[0])])

    def columns(self, data: Any, lead: int) -> dict[str, torch.Tensor]:
        """Each column of a batch of this layout, its first ``lead`` dims flattened into one. O(columns).

        Raises:
            InvalidTrajectoryError: another kind of data, leaves missing or unknown, another pytree structure.
        """
        if self.kind == "tensordict":
            if not isinstance(data, TensorDictBase):
                raise InvalidTrajectoryError(f"this storage holds TensorDicts; got {type(data).__name__}")
            have = {k for k in data.keys(include_nested=True, leaves_only=True) if not _metadata(k)}
            missing = [k for k in self.keys if k not in have]
            extra = sorted(map(str, have - set(self.keys)))
            if missing or extra:
                raise InvalidTrajectoryError(f"the data's entries differ from the storage's: missing {missing}, "
                                             f"unknown {extra}")
            leaves = [data.get(k) for k in self.keys]
        elif self.kind == "tensor":
            if not isinstance(data, torch.Tensor):
                raise InvalidTrajectoryError(f"this storage holds tensors; got {type(data).__name__}")
            leaves = [data]
        else:
            leaves, spec = pytree.tree_flatten(data)
            if spec != self.treespec:
                raise InvalidTrajectoryError(f"the pytree's structure {spec} differs from the storage's {self.treespec}")
        out = {}
        for name, leaf, shape in zip(self.names, leaves, self.shapes):
            if not isinstance(leaf, torch.Tensor):
                raise InvalidTrajectoryError(f"column {name!r}: a {type(leaf).__name__}, not a tensor")
            out[name] = leaf.reshape((-1,) + tuple(leaf.shape[lead:])) if lead > 1 else leaf
        return out

    # ---- reads -------------------------------------------------------------------------------
    def build(self, columns: dict[str, torch.Tensor], batch: tuple[int, ...]) -> Any:
        """Data of this layout over ``columns`` (each ``[*batch, *shape]``), without a copy. O(columns)."""
        if self.kind == "tensor":
            return columns[TENSOR_COLUMN]
        if self.kind == "pytree":
            return pytree.tree_unflatten([columns[n] for n in self.names], self.treespec)
        first = columns[self.names[0]]
        td = TensorDict(batch_size=tuple(batch) + self.item_batch, device=first.device)
        for name, key in zip(self.names, self.keys):
            td.set(key, columns[name])
        return td

    def state(self) -> dict[str, Any]:
        """What :meth:`from_state` needs (plain Python objects and a pytree spec). O(columns)."""
        return {"kind": self.kind, "names": self.names, "keys": self.keys, "shapes": self.shapes,
                "dtypes": [d.str for d in self.dtypes], "item_batch": self.item_batch, "treespec": self.treespec}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Layout":
        """The layout :meth:`state` described. O(columns)."""
        return cls(state["kind"], state["names"], [tuple(k) if isinstance(k, list) else k for k in state["keys"]],
                   state["shapes"], state["dtypes"], state.get("item_batch", ()), state.get("treespec"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.state() == other.state()

    def __repr__(self) -> str:
        cols = ", ".join(f"{k!r}: {s} {d}" for k, s, d in zip(self.keys, self.shapes, self.dtypes))
        return f"Layout({self.kind}, {cols})"


def trajectory_lengths(data: Any, rows: int, steps: int, max_length: int, end_keys: tuple,
                       traj_key: Any) -> np.ndarray:
    """Cut ``rows`` streams of ``steps`` steps each (a batch flattened row after row) into trajectories: at the
    end of each row, after a step whose any of ``end_keys`` is set, where ``traj_key``'s value changes, and every
    ``max_length`` steps. Keys the data lacks are not used. O(rows * steps), vectorized.

    Returns:
        The int64 lengths, in order (they sum to ``rows * steps``).
    """
    n = rows * steps
    if n == 0:  # an empty write: no trajectory
        return np.zeros(0, np.int64)
    ends = np.zeros(n, np.bool_)
    ends[steps - 1::steps] = True
    if isinstance(data, TensorDictBase):
        for key in end_keys:
            flag = data.get(key, None)
            if isinstance(flag, torch.Tensor):
                ends |= flag.reshape(n, -1).any(-1).cpu().numpy()
        ids = data.get(traj_key, None) if traj_key is not None else None
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(n, -1)[:, 0].cpu().numpy()
            ends[:-1] |= ids[1:] != ids[:-1]
    last = np.flatnonzero(ends)
    lengths = np.diff(last, prepend=-1)
    if lengths.max(initial=0) > max_length:  # longer runs: pieces of max_length, the remainder last
        pieces = -(-lengths // max_length)
        out = np.full(int(pieces.sum()), max_length, np.int64)
        out[np.cumsum(pieces) - 1] = lengths - (pieces - 1) * max_length
        lengths = out
    return lengths.astype(np.int64)


def _sort_key(key) -> tuple:
    return tuple(key) if isinstance(key, tuple) else (key,)


def _metadata(key) -> bool:
    return key in METADATA_KEYS or (isinstance(key, tuple) and len(key) == 1 and key[0] in METADATA_KEYS)


def _unique(name: str, taken: list[str]) -> str:
    out, i = name, 1
    while out in taken:
        out, i = f"{name}~{i}", i + 1
    return out
