"""TorchRL: a gear_mpi replay sharded over the ranks, behind TorchRL's own ``ReplayBuffer``.

Three parts plug into ``ReplayBuffer(storage=..., sampler=..., writer=...)`` and ``TensorDictReplayBuffer``:

- :class:`GearStorage` -- TorchRL's ``Storage`` over a :class:`gear_mpi.Replay`: every rank's
  ``rb.extend(data)`` goes into that rank's shard (local, no communication). It builds its replay at the
  first write, from the data's layout (a collective: every rank makes its first write together), or wraps
  one given as ``replay=``. Items are one step each, or trajectories (``max_length > 1``, or a
  :class:`GearSliceSampler` in the buffer): each write is cut into trajectories at episode ends.
- :class:`GearSampler` -- ``rb.sample()`` is the collective global draw (:meth:`gear_mpi.Replay.sample`:
  every rank calls it, each gets its own batch drawn from every shard); the indices are gear_mpi keys
  (:mod:`gear_mpi.keys`), so ``rb.update_priority(index, priority)`` (a collective) routes each priority to
  the rank owning the item. ``GearSampler(alpha=..., beta=...)`` makes the replay prioritized
  (``gm.Prioritized``) and puts importance weights under ``"priority_weight"``.
- :class:`GearSliceSampler` -- windows of ``slice_len`` steps, in TorchRL's ``SliceSampler`` layout (a
  flat ``[num_slices * slice_len]`` batch, ``("next", "truncated")`` at each slice's last step, ``is_init``
  at its first, ``("collector", "mask")`` with ``pad_output=True``).
- :class:`GearWriter` -- the writer that hands data to the storage and returns the keys it got.

A buffer given a ``GearStorage`` and no sampler or writer takes ``GearSampler`` and ``GearWriter``.
Guide: docs/guide/integrations/torchrl.md.

Collective calls (every rank, in the same order): the first write, ``rb.sample()``, ``rb.update_priority``
(except priorities given with the data by ``extend``), ``rb.can_sample()``, ``rb.dumps``/``rb.loads``,
``storage.close()``. Local: everything else, ``len(rb)`` included (this rank's items). TorchRL's
``prefetch`` threads would issue collectives in a different order on each rank and are refused on more
than one rank (use :meth:`gear_mpi.Replay.batches`).
"""
from __future__ import annotations

from .torchrl_layout import Layout
from .torchrl_samplers import GearSampler, GearSliceSampler
from .torchrl_storage import GearStorage, GearWriter

GearStorage.default_sampler = GearSampler  # a buffer given a GearStorage and no sampler draws with GearSampler

__all__ = ["GearStorage", "GearSampler", "GearSliceSampler", "GearWriter", "Layout"]
