"""The threads of gear_mpi's numba kernels: idle workers that sleep, and one knob for their number.

numba's default OpenMP threading layer keeps its idle workers spinning (``OMP_WAIT_POLICY`` unset):
between two replay calls they burn the cores that torch's intra-op threads need for the training step
(an SB3 DQN beside a gear_mpi buffer took 19.4 s of CPU instead of 3.2 s for 1,500 steps). gear_mpi
therefore sets, when it is imported and before numba loads its threading layer:

- ``OMP_WAIT_POLICY=PASSIVE`` unless the variable is already set (the user's choice wins; set it to
  ``ACTIVE`` to get the spinning back). It only reaches an OpenMP runtime that starts after gear_mpi's
  import: numba's (which loads at the first parallel kernel) and, when gear_mpi is imported before torch,
  torch's. numba's other layers (``workqueue``, ``tbb``) let idle workers sleep anyway.
- the thread count from ``GEAR_MPI_THREADS`` when set (an integer >= 1): the pool size numba starts with
  (``NUMBA_NUM_THREADS``, unless that is set too or numba was already imported, in which case the calling
  thread's count is set). Unset, numba's default (one per core) stays, and a multi-rank
  :class:`~gear_mpi.replay.Replay` gives each rank its share of the node's cores.

Small batches never wake the workers: every kernel with a parallel loop runs on the calling thread below
its threshold (``gather.COPY_THREADS_BYTES`` bytes copied, ``gather.SERIAL_BYTES`` decoded;
``kernels.thread_share.THREADS_MIN_ITEMS`` draws or priority updates, the calling thread's count set to 1
around the call; ``priority_sampled.PARALLEL_MIN`` keys for the update of a batch just sampled), so a
B = 32-256 sample or update costs no thread wake-up. A wake-up costs about 65 us on the reference VM
(docs/BENCHMARKS.md, "Parallel copies that do not wait for a late thread"): the thresholds are where the
threads' share of the work pays for it there.

:func:`set_threads` changes the count at run time (numba's count is per calling thread; a replay's
prefetch thread takes its creator's). Everything here is local and O(1).
"""
from __future__ import annotations

import os
import sys

ENV = "GEAR_MPI_THREADS"

_chosen: int | None = None  # the count the user asked for (GEAR_MPI_THREADS or set_threads), None: numba's default


def _parse(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV}={value!r}: expected a whole number of threads >= 1")
    return n


def apply_defaults() -> None:
    """Set the defaults of the module docstring; called by ``import gear_mpi`` before anything loads numba.

    Raises:
        ValueError: ``GEAR_MPI_THREADS`` is set to something other than an integer >= 1 (nothing is changed).
    """
    global _chosen
    value = os.environ.get(ENV)
    n = _parse(value) if value is not None and value.strip() != "" else None
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if n is None:
        return
    _chosen = n
    if "numba" not in sys.modules and "NUMBA_NUM_THREADS" not in os.environ:
        os.environ["NUMBA_NUM_THREADS"] = str(n)  # the pool starts with exactly n workers
    else:
        import numba
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))


def set_threads(n: int) -> int:
    """Use ``n`` threads in the calling thread's parallel numba kernels (and in the prefetch threads of the
    replays it creates afterwards); a multi-rank replay then no longer divides the node's cores itself.

    Args:
        n: threads, 1 up to numba's pool size (``numba.config.NUMBA_NUM_THREADS``: the cores, or
            ``NUMBA_NUM_THREADS`` / ``GEAR_MPI_THREADS`` when set before the import).

    Returns:
        The calling thread's previous count.

    Raises:
        ValueError: ``n`` is not an integer in that range (nothing is changed).

    Local, O(1); starts numba's thread pool if it has not started yet.
    """
    global _chosen
    import numba
    limit = numba.config.NUMBA_NUM_THREADS
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limit:
        raise ValueError(f"set_threads: n={n!r} must be an integer from 1 to numba's pool size {limit} "
                         f"(set {ENV} or NUMBA_NUM_THREADS before importing gear_mpi for a larger pool)")
    before = numba.get_num_threads()
    numba.set_num_threads(n)
    _chosen = n
    return before


def get_threads() -> int:
    """The calling thread's numba thread count. Local, O(1)."""
    import numba
    return numba.get_num_threads()


def chosen() -> int | None:
    """The count the user chose (``GEAR_MPI_THREADS`` or :func:`set_threads`), None when numba's default
    stands. Local, O(1)."""
    return _chosen
