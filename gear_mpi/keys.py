"""Trajectory keys: one int64 that packs replay tag, owner rank, slot and generation.

Bit layout (most significant first, sign bit always 0)::

    | 0 | tag: 8 | rank: 14 | generation: 14 | slot: 27 |

- ``tag`` identifies the replay that issued the key (a key from another replay is
  refused, with probability 255/256 when tags are drawn at random);
- ``rank`` is the owner shard (up to 16384 ranks);
- ``slot`` indexes the owner's trajectory table (up to 134 million items a shard);
- ``generation`` counts reuses of the slot modulo 2**14, so a key whose
  trajectory was evicted never touches the slot's new occupant.
"""
from __future__ import annotations

import numpy as np
from numba import njit

SLOT_BITS = 27
GEN_BITS = 14
RANK_BITS = 14
TAG_BITS = 8

MAX_SLOTS = 1 << SLOT_BITS
MAX_RANKS = 1 << RANK_BITS
GEN_MASK = (1 << GEN_BITS) - 1
SLOT_MASK = MAX_SLOTS - 1
RANK_MASK = MAX_RANKS - 1
TAG_MASK = (1 << TAG_BITS) - 1

_GEN_SHIFT = SLOT_BITS
_RANK_SHIFT = SLOT_BITS + GEN_BITS
_TAG_SHIFT = SLOT_BITS + GEN_BITS + RANK_BITS


def encode(tag: int, rank: int, slots: np.ndarray, generations: np.ndarray) -> np.ndarray:
    """Pack keys for ``slots`` of shard ``rank``. Cost: O(n) vectorised.

    Args:
        tag: the replay's key tag.
        rank: the owner shard.
        slots: table slots.
        generations: each slot's generation (taken modulo 2**14).

    Returns:
        The int64 keys.
    """
    slots = np.asarray(slots, dtype=np.int64)
    gens = np.asarray(generations, dtype=np.int64) & GEN_MASK
    head = np.int64((tag << _TAG_SHIFT) | (rank << _RANK_SHIFT))
    return head | (gens << _GEN_SHIFT) | slots


def key_head(tag: int, rank: int) -> int:
    """The tag and rank bits shared by every key of shard ``rank`` of replay ``tag``. O(1).

    Args:
        tag: the replay's key tag.
        rank: the shard.

    Returns:
        The bits, as an int (OR it with generation and slot bits).
    """
    return (int(tag) << _TAG_SHIFT) | (int(rank) << _RANK_SHIFT)


def owner_of(keys: np.ndarray) -> np.ndarray:
    """The owner rank of each int64 key: ``decode(keys)[1]`` without the other fields (what a router needs
    per call). A negative key gives ``RANK_MASK``, above any rank a fold of deferred updates has. O(n) vectorised.

    Args:
        keys: int64 keys (an int64 array: no conversion here).

    Returns:
        The int64 owner ranks.
    """
    return (keys >> _RANK_SHIFT) & RANK_MASK


@njit(cache=True, nogil=True)
def owners_checked(keys, tag, ranks, max_items, owner, counts):
    """The owner of each int64 key (``owner[i]``, as :func:`owner_of`) and how many keys each rank owns
    (``counts``, ``ranks`` entries), in one pass, checking that each was issued by a replay of key tag ``tag``
    over ``ranks`` ranks of ``max_items`` slots (its tag field, rank and slot). O(n).

    Returns:
        The index of the first key that was not (``owner`` and ``counts`` then partial), or -1.
    """
    for r in range(counts.shape[0]):
        counts[r] = 0
    for i in range(keys.shape[0]):
        k = keys[i]
        o = (k >> _RANK_SHIFT) & RANK_MASK
        if (k >> _TAG_SHIFT) != tag or o >= ranks or (k & SLOT_MASK) >= max_items:
            return i
        owner[i] = o
        counts[o] += 1
    return -1


def decode(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split keys into their fields. Cost: O(n) vectorised.

    Args:
        keys: int64 keys.

    Returns:
        (tag, rank, generation, slot) int64 arrays.
    """
    keys = np.asarray(keys, dtype=np.int64)
    return ((keys >> _TAG_SHIFT) & TAG_MASK, (keys >> _RANK_SHIFT) & RANK_MASK,
            (keys >> _GEN_SHIFT) & GEN_MASK, keys & SLOT_MASK)


def tensor_numpy(tensor) -> np.ndarray:
    """A torch tensor's values as a numpy array: its own memory for a CPU tensor without autograd (``numpy()``,
    about 1 us), else a detached host copy. O(1), or O(n) for a device tensor.

    Args:
        tensor: a torch tensor.
    Returns:
        The numpy array.
    """
    try:
        return tensor.numpy()  # raises for a tensor that requires grad or lives on a device
    except (RuntimeError, TypeError):
        return tensor.detach().cpu().numpy()


def as_key_array(keys) -> np.ndarray:
    """Keys from an int, sequence, numpy array or torch tensor, as a 1-D int64 array. O(n) at most.

    Args:
        keys: the keys in any of those forms.

    Returns:
        A 1-D int64 array (no copy when already one).

    Raises:
        TypeError: not integral (an empty sequence of any type is accepted).
    """
    if hasattr(keys, "detach") and hasattr(keys, "cpu"):
        keys = tensor_numpy(keys)
    arr = np.asarray(keys)
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        raise TypeError(f"keys must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False).reshape(-1)


@njit(cache=True, nogil=True)
def encode_slots(tag, rank, slots, generation, out):
    """``out[i]`` = the key of ``slots[i]``, its generation read from the table. O(B), one pass (numba).

    Args:
        tag: the replay's key tag.
        rank: the owner shard.
        slots: int64 table slots.
        generation: the table's generation of every slot (int64).
        out: an int64 array of ``len(slots)`` to fill.
    """
    head = (tag << _TAG_SHIFT) | (rank << _RANK_SHIFT)
    for i in range(slots.shape[0]):
        s = slots[i]
        out[i] = head | ((generation[s] & GEN_MASK) << _GEN_SHIFT) | s
