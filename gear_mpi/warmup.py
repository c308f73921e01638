"""Warm-up at construction: the kernels a replay will call are loaded (or compiled) before its first call.

numba loads even a cached kernel lazily, at its first call, and the first kernel of a
process also builds numba's target context (about 1-2 s here, BLAS discovery included).
:func:`warm_kernels` pays that at construction instead: it runs one insert, one sample
(every align) and one priority update on a scratch shard of the same spec and selector,
so the replay's first ``sample`` costs what later ones do. Local; done once per process
for each (spec, selector kind, index kind).
"""
from __future__ import annotations

import copy

import numpy as np

from .kernels.weights import PARALLEL_MIN, power_weights
from .shard import Shard
from .spec import TrajectorySpec

_WARM: set = set()


def warm_kernels(spec: TrajectorySpec, sampler) -> None:
    """Run each hot kernel once for ``spec`` and ``sampler``'s kind (local; once per process and kind).

    Args:
        spec: the replay's spec.
        sampler: its selector (a copy is used).
    Cost: the first time, numba's start-up and cache loads (or compiles); then nothing. Memory: a scratch
    shard of ``2 * max_length`` steps, freed at once.
    """
    key = (repr(spec.to_dict()), type(sampler).__name__)
    if key in _WARM:
        return
    scratch = Shard(spec, 2 * spec.max_length, copy.copy(sampler), max_items=4)  # room for the 2-item insert_many
    try:
        zeros = {c.name: np.zeros((1,) + c.shape, c.dtype) for c in spec.columns}
        scratch.insert(zeros, 1.0)
        for align in ("random", "head", "tail"):
            batch = scratch.sample(2, 1, align)
        scratch.update_priorities(batch.keys.numpy(), np.ones(len(batch)))
        scratch.insert_many([zeros, zeros], [1.0, 2.0])
        if getattr(sampler, "alpha", 1.0) != 1.0:  # the parallel power of large inserts and updates
            power_weights(np.ones(PARALLEL_MIN), sampler.alpha)
    finally:
        scratch.close()
    _WARM.add(key)

