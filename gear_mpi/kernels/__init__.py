"""Pure numba kernels over arrays: no classes, no MPI, no allocation of state.

One module per job:

- :mod:`~gear_mpi.kernels.priority_tree` -- the blocked sum/min structure that
  prioritized and uniform selection draw from.
- :mod:`~gear_mpi.kernels.gather` -- copies sampled windows into a batch.
- :mod:`~gear_mpi.kernels.ring` -- the step ring and trajectory table bookkeeping.
- :mod:`~gear_mpi.kernels.order` -- FIFO/LIFO/top-k selection over live items.
- :mod:`~gear_mpi.kernels.cuda_priority`, :mod:`~gear_mpi.kernels.cuda_gather` -- numba-cuda
  twins of the priority and gather kernels, same results (imported only for ``device="cuda"``).
"""
