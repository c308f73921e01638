"""Insertion stamps of a table that keeps no stamp per slot: a bounded log of (sequence number, stamp) anchors.

Only the ordered selectors that go by insertion time (``Fifo``, ``Lifo``) need each trajectory's own
stamp at any moment (they merge shards by it); for every other selector the stamps serve only to save
them in a checkpoint and to merge shards' insertion orders when one is resharded. Such a table keeps no
8-byte ``stamp`` row (:mod:`gear_mpi.storage.table`) but a :class:`StampLog`: the stamps along the
insertion order, run-length encoded. Every trajectory of one insert has the insert's stamp, so the log
holds one anchor ``(first sequence number, stamp)`` per insert, and a trajectory's stamp is the last
anchor's at or before its sequence number: exact.

The log is bounded: past ``limit`` anchors (``max_items // 64 + 64``: 16 bytes per 64 slots), the
anchors before the oldest trajectory held go, and if that is not enough every other anchor goes (the
trajectories of a dropped anchor's inserts then read the stamp of the insert before them: earlier, never
later, still non-decreasing along the insertion order). Only many small inserts (more than one per 64
trajectories held) make it thin out, and then the oldest anchors lose most.
"""
from __future__ import annotations

import numpy as np

SLOTS_PER_ANCHOR = 64  # the log's bound: one anchor per this many slots (plus a few)


class StampLog:
    """Anchors ``(seq, stamp)`` in increasing ``seq``; see the module. Local; not thread-safe (nor is the store).

    Args:
        max_items: the table's slots (the bound: ``max_items // SLOTS_PER_ANCHOR + 64`` anchors).
    """

    def __init__(self, max_items: int):
        self.limit = int(max_items) // SLOTS_PER_ANCHOR + 64
        self.seqs = np.zeros(16, np.int64)
        self.stamps = np.zeros(16, np.int64)
        self.count = 0

    @property
    def nbytes(self) -> int:
        """Bytes held (the anchors' arrays). O(1)."""
        return int(self.seqs.nbytes + self.stamps.nbytes)

    def record(self, first_seq: int, end_seq: int, now: int, oldest_seq: int) -> None:
        """Note an insert of the sequence numbers ``[first_seq, end_seq)`` at ``now`` (ns). ``oldest_seq``:
        the oldest trajectory held (anchors before it are no longer needed, but the last). O(1) amortized.
        """
        if end_seq <= first_seq or (self.count and self.stamps[self.count - 1] == now):
            return
        if self.count >= self.limit:
            self._shrink(oldest_seq)
        if self.count == len(self.seqs):
            self._resize(2 * self.count)
        self.seqs[self.count] = first_seq
        self.stamps[self.count] = now
        self.count += 1

    def _resize(self, size: int) -> None:
        n = self.count
        seqs, stamps = np.zeros(max(16, size), np.int64), np.zeros(max(16, size), np.int64)
        seqs[:n], stamps[:n] = self.seqs[:n], self.stamps[:n]
        self.seqs, self.stamps = seqs, stamps

    def _shrink(self, oldest_seq: int) -> None:
        """Below ``limit * 3 / 4`` anchors: drop those before the last one at or before ``oldest_seq``, then
        every other one (oldest first) while still too many. O(anchors)."""
        n = self.count
        k = max(0, int(np.searchsorted(self.seqs[:n], oldest_seq, side="right")) - 1)
        seqs, stamps = self.seqs[k:n], self.stamps[k:n]
        while len(seqs) > max(1, 3 * self.limit // 4):
            seqs, stamps = seqs[::2], stamps[::2]  # the first stays: the stamp of the oldest held
        n = len(seqs)
        self.seqs[:n], self.stamps[:n] = seqs.copy(), stamps.copy()
        self.count = n

    def stamps_of(self, seqs: np.ndarray) -> np.ndarray:
        """Each sequence number's stamp: the last anchor's at or before it (the first anchor's before
        the first; 0 with no anchor). O(len(seqs) log anchors).

        Args:
            seqs: int64 insertion sequence numbers.
        Returns:
            int64 stamps (ns), one each.
        """
        seqs = np.asarray(seqs, np.int64)
        if self.count == 0:
            return np.zeros(len(seqs), np.int64)
        k = np.searchsorted(self.seqs[:self.count], seqs, side="right") - 1
        return self.stamps[np.maximum(k, 0)]

    def assign(self, seqs: np.ndarray, stamps: np.ndarray, oldest_seq: int) -> None:
        """Give the trajectories of ``seqs`` the stamps ``stamps`` (a checkpoint's, a reshard's): the anchors
        from the smallest to the largest of ``seqs`` are replaced by one per run of equal stamps along them.
        O((anchors + n) log n).

        Args:
            seqs: int64 insertion sequence numbers (any order, distinct).
            stamps: int64 stamps (ns), one each.
            oldest_seq: the oldest trajectory held (for the bound, as in :meth:`record`).
        """
        seqs = np.asarray(seqs, np.int64)
        stamps = np.asarray(stamps, np.int64)
        if len(seqs) == 0:
            return
        order = np.argsort(seqs, kind="stable")
        seqs, stamps = seqs[order], stamps[order]
        runs = np.flatnonzero(np.concatenate([[True], stamps[1:] != stamps[:-1]]))
        old_s, old_t = self.seqs[:self.count], self.stamps[:self.count]
        keep = (old_s < seqs[0]) | (old_s > seqs[-1])
        new_s = np.concatenate([old_s[keep], seqs[runs]])
        new_t = np.concatenate([old_t[keep], stamps[runs]])
        by = np.argsort(new_s, kind="stable")
        self.count = 0
        self._resize(len(by))
        self.count = len(by)
        self.seqs[:self.count], self.stamps[:self.count] = new_s[by], new_t[by]
        if self.count > self.limit:
            self._shrink(oldest_seq)

    def clear(self) -> None:
        """Forget every anchor. O(1)."""
        self.count = 0
