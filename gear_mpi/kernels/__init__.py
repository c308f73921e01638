"""Pure numba kernels over arrays: no classes, no MPI, no allocation of state.

The classes that own the arrays live a floor up (:mod:`gear_mpi.storage.store`,
:mod:`gear_mpi.selection.priority_index`) and pass them in as one named tuple each
(:class:`ring.Table`, :class:`priority_tree.Tree`), built once. One module per job:

- :mod:`~gear_mpi.kernels.ring` -- the step ring and trajectory table bookkeeping
  (insert with FIFO eviction, sample counting, live slots in insertion order).
- :mod:`~gear_mpi.kernels.priority_tree` -- the blocked sum/min structure that
  prioritized and uniform selection draw from: layout, rebuild, batched update.
- :mod:`~gear_mpi.kernels.priority_draw` -- batched proportional draws from it.
- :mod:`~gear_mpi.kernels.gather` -- window placement and the copy of sampled windows
  into a batch (from this process's ring or, by address, from node peers' rings).
- :mod:`~gear_mpi.kernels.weights` -- index weights ``p ** alpha`` from raw priorities (numpy's
  values, shared among the threads).
- :mod:`~gear_mpi.kernels.hints` -- software prefetch, ordered stores, and the atomic counters and flags by
  which a parallel region's threads share work as they arrive.
- :mod:`~gear_mpi.kernels.thread_share` -- where a kernel's work pays for waking the sleeping workers, and
  the calling thread alone where it does not.
- :mod:`~gear_mpi.kernels.compiled` -- a kernel's compiled entry point, called directly by a call that repeats
  with arguments of the same types (no typing of every argument at each call).
- :mod:`~gear_mpi.kernels.bitgen` -- numpy's bit generator drawn from inside a kernel (its ``next_double``
  through its C interface: the values and final state ``Generator.random`` gives).
- :mod:`~gear_mpi.kernels.pipeline` -- the compile options of the serial kernels (numba's parallel pipeline
  with its transformations off: no reference counting inside their loops).
- :mod:`~gear_mpi.kernels.cuda_priority`, :mod:`~gear_mpi.kernels.cuda_gather` -- numba-cuda
  twins of the priority and gather kernels, same results (imported only for ``device="cuda"``
  and by the tests; they need numba-cuda, see :mod:`gear_mpi.kernels.cuda_support`).
"""
from .priority_tree import LEAF_DTYPE, TREE_FIELDS, Tree, leaf_values
from .ring import ring_segments
from .weights import PARALLEL_MIN, power_weights

__all__ = ["LEAF_DTYPE", "TREE_FIELDS", "Tree", "leaf_values", "ring_segments", "PARALLEL_MIN", "power_weights"]
