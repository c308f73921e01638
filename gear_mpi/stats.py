"""The one schema of ``Shard.stats()`` and ``Replay.stats()``: the figure names and their meaning.

A shard reports its own figures flat, under the names of :data:`SHARD_FIGURES`
(and its ``rank``). A replay reports, for every figure of :data:`REPLAY_FIGURES`
(the shard's plus the window counters of the replay's transport), one list
indexed by rank under ``"per_rank"`` and the sum over the ranks under
``"total"``, beside ``"ranks"``, ``"mode"`` and ``"balance"``. The README's
"Statistics" table lists every key; this module is the code of it (local, no
communication: the replay gathers the rows, then calls :func:`combine`).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

#: figures of one shard, in the order a replay gathers them; "weight" is a float, the rest are ints
SHARD_FIGURES = ("items", "live_steps", "steps_used", "capacity_steps", "weight", "inserted", "evicted", "removed",
                 "sampled", "stale_updates", "stored_bytes", "raw_bytes", "reserved_bytes")
#: figures of one rank of a replay: the shard's, then the windows this rank received by each path
REPLAY_FIGURES = SHARD_FIGURES + ("windows_shared", "windows_mpi", "ingested", "writers", "staged")
_FLOAT = frozenset({"weight"})


def _cast(name: str, value: float) -> float | int:
    return float(value) if name in _FLOAT else int(value)


def row(figures: Mapping[str, Any], names: Sequence[str] = REPLAY_FIGURES) -> list[float]:
    """One rank's figures as numbers in gather order (local, O(figures)).

    Args:
        figures: name -> value, with every name of ``names``.
        names: the figure names, in order.
    Returns:
        The values as floats (exact for integers below 2**53).
    Raises:
        KeyError: a figure is missing.
    """
    return [float(figures[k]) for k in names]


def combine(table: np.ndarray, mode: str, names: Sequence[str] = REPLAY_FIGURES) -> dict[str, Any]:
    """A replay's statistics from every rank's :func:`row` (local, O(ranks * figures)).

    Args:
        table: ``[ranks, len(names)]`` float64, row r from rank r.
        mode: the replay's default sampling mode.
        names: the figure names of the table's columns.
    Returns:
        ``{"ranks": P, "mode": mode, "balance": largest shard / mean shard in items (1.0 when empty),
        "total": {figure: sum over ranks}, "per_rank": {figure: [value of rank r, ...]}}``.
    """
    per_rank = {k: [_cast(k, v) for v in table[:, i].tolist()] for i, k in enumerate(names)}
    total = {k: _cast(k, sum(table[:, i].tolist())) for i, k in enumerate(names)}
    items = table[:, names.index("items")] if "items" in names else np.zeros(1)
    balance = float(items.max() / items.mean()) if items.sum() else 1.0
    return {"ranks": int(table.shape[0]), "mode": mode, "balance": balance, "total": total, "per_rank": per_rank}
