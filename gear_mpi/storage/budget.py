"""Memory budgets: refuse at construction a replay the node cannot hold, instead of an OOM kill mid-run.

A replay asks each rank for its shard (step ring, trajectory table, priority index); the
ranks of a node together need ``node ranks x that``. The node can give the smaller of
the kernel's ``MemAvailable`` and, inside a cgroup (Slurm, containers), the cgroup's
``memory.max - memory.current`` (v2) or ``memory.limit_in_bytes - memory.usage_in_bytes``
(v1). With ``memory="shm"`` the rings also live in ``/dev/shm``, whose free space is
checked too (a container's 64 MB ``/dev/shm`` would otherwise end in SIGBUS). Local:
reads a few files (no communication); the replay agrees on the outcome.
"""
from __future__ import annotations

import os
import warnings

from ..errors import MemoryBudgetError
from ..progress import human
from .arenas import column_layout
from .table import bytes_per_slot, derives_priority, stamps_per_item



def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text)


def mem_available() -> tuple[int | None, str]:
    """Bytes this process's node (or cgroup) can still give, and where the figure comes from.

    Returns:
        ``(bytes or None when unknown, description)``.
    """
    found: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except OSError:
        pass
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is None:  # cgroup v1
        limit, used = (_read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                       _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes"))
        if limit is not None and limit >= 1 << 60:  # v1 reports "unlimited" as a huge number
            limit = None
    if limit is not None:
        found.append((max(limit - (used or 0), 0), "the cgroup's memory limit"))
    if not found:
        return None, "unknown"
    return min(found)


def shm_free(path: str = "/dev/shm") -> int | None:
    """Free bytes of the file system at ``path`` (None when it cannot be read)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check(per_rank: int, node_ranks: int, memory: str) -> str | None:
    """Why the node cannot hold ``node_ranks`` shards of ``per_rank`` bytes, or None when it can.

    Args:
        per_rank: bytes one rank's shard reserves.
        node_ranks: ranks of the replay on this node.
        memory: the arena kind (``"shm"`` also needs room in /dev/shm).
    Returns:
        A message naming the sizes and the ways out, or None.
    """
    need = per_rank * node_ranks
    have, where = mem_available()
    ways = ("give the job more memory (more nodes, a larger --mem), or ask for a smaller capacity_steps/"
            "max_items; Replay(..., lazy=True) only warns")
    if have is not None and need > have:
        return (f"{node_ranks} rank(s) on this node need {human(need)} for their shards ({human(per_rank)} "
                f"each) but {where} leaves {human(have)}: {ways}")
    if memory == "shm":
        free = shm_free()
        if free is not None and need > free:
            return (f"{node_ranks} rank(s) on this node need {human(need)} of /dev/shm for their shards but it "
                    f"has {human(free)} free: give /dev/shm more room (e.g. docker --shm-size), use "
                    f"memory='private' (node peers are then served over MPI), or a smaller capacity; "
                    f"Replay(..., lazy=True) only warns")
    return None


def shard_bytes(spec, capacity_steps: int, max_items: int | None, proportional: bool, memory: str = "private",
                sampler=None) -> int:
    """Bytes of RAM one rank's shard reserves: the step ring, the trajectory table and the priority index
    (``memory="file"``: the index alone, the rest is on disk; ``"mapped"``: the table and the index).
    Without ``sampler``, the widest table these sizes allow and 10 bytes a slot of index; with it, the rows
    its shard keeps (raw priorities and stamps only where they are rows; a use limit counted) and 6 bytes a
    slot of index (float32 leaves, float64 levels: about 5.3). O(1)."""
    slots = int(capacity_steps if max_items is None else max_items)
    index = slots * ((10 if sampler is None else 6) if proportional else 0)
    if memory == "file":
        return index
    priority_row = sampler is None or not derives_priority(sampler)
    stamp_row = sampler is None or stamps_per_item(sampler)
    table = slots * bytes_per_slot(int(capacity_steps), slots, spec.max_length, 1, priority_row, stamp_row)
    return index + table + (0 if memory == "mapped" else column_layout(spec, int(capacity_steps))[1])


def enforce(comm, spec, capacity_steps: int, max_items: int | None, sampler, memory: str, node_ranks: int,
            lazy: bool, what: str) -> None:
    """Collective: every rank checks its node (:func:`check`) and the ranks agree on the outcome.

    Raises:
        MemoryBudgetError: some node cannot hold its shards (on every rank), unless ``lazy`` (then a warning).
    """
    try:
        problem = check(shard_bytes(spec, capacity_steps, max_items, sampler.proportional, memory, sampler), node_ranks,
                        memory)
    except (TypeError, ValueError, OverflowError):  # a bad size: the shard's own check names it
        problem = None
    if problem is not None and lazy:
        warnings.warn(f"gear_mpi: {problem}", ResourceWarning, stacklevel=3)
        problem = None
    comm.agree(MemoryBudgetError(problem) if problem else None, f"{what} (memory budget)")
