"""Which items a sample takes: the selection policies and the priority indexes they draw from.

- :mod:`.selectors` -- ``Uniform``, ``Prioritized``, ``Fifo``, ``Lifo``, ``MaxPriority``, ``MinPriority``;
- :mod:`.priority_index` -- :class:`PriorityIndex` (CPU) and :class:`DevicePriorityIndex` (GPU):
  per-slot weights, batched draws and updates over the kernels of :mod:`gear_mpi.kernels`.

Local: a selector works on one shard; the collectives that make a draw global are in
:mod:`gear_mpi.distributed`.
"""
from .priority_index import LEVEL_FIELDS, DevicePriorityIndex, PriorityIndex
from .selectors import Fifo, Lifo, MaxPriority, MinPriority, Prioritized, Selector, Uniform

__all__ = ["LEVEL_FIELDS", "DevicePriorityIndex", "PriorityIndex", "Fifo", "Lifo", "MaxPriority", "MinPriority",
           "Prioritized", "Selector", "Uniform"]
