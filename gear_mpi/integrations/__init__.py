"""Adapters that plug gear_mpi into the frameworks where RL code already lives.

Each adapter is a module of its own, imported by name, and imports its framework (an optional
dependency, never a core one) when it is imported itself: importing this package imports nothing.

- :mod:`gear_mpi.integrations.sb3`: Stable-Baselines3 (``GearReplayBuffer``, ``GearPrioritizedReplayBuffer``,
  ``PrioritizedDQN``: array and ``Dict`` observation spaces, n-step returns through
  :mod:`gear_mpi.integrations.sb3_nstep`) and :mod:`gear_mpi.integrations.sb3_her` (``GearHerReplayBuffer``,
  hindsight experience replay); needs ``stable-baselines3`` (the ``sb3`` extra).
- :mod:`gear_mpi.integrations.torchrl`: TorchRL's storage, samplers and writer over a gear_mpi ``Replay``
  (``from gear_mpi.integrations import torchrl as gtrl``); needs ``torchrl`` (the ``torchrl`` extra).
"""
from __future__ import annotations

__all__: list[str] = []
