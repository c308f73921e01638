"""The hot kernels of a spec and selector run once at a replay's construction (:func:`warm_kernels`), so that its
first sample costs what later ones do: numba loads even a cached kernel at its first call, and the first kernel of
a process builds numba's target context (about 1-2 s on the reference VM). Local; once per process and kind.
"""
from __future__ import annotations

import copy

import numpy as np

from .kernels.weights import PARALLEL_MIN, importance_weights, leaf_weights, power_weights
from .shard import Shard
from .spec import TrajectorySpec

_WARM: set = set()  # the (spec, selector kind) pairs warmed in this process


def warm_kernels(spec: TrajectorySpec, sampler) -> None:
    """Run each hot kernel once for ``spec`` and ``sampler``'s kind (local; once per process and kind).

    Args: spec: the replay's spec; sampler: its selector (a copy is used).
    Cost: the first time, numba's start-up and cache loads (or compiles); then nothing. Memory: a scratch
    shard of ``2 * max_length`` steps, freed at once.
    """
    key = (repr(spec.to_dict()), type(sampler).__name__)
    if key in _WARM:
        return
    scratch = Shard(spec, 2 * spec.max_length, copy.copy(sampler), max_items=4)  # room for the 2-item insert_many
    try:
        zeros = {c.name: np.zeros((spec.min_length,) + c.shape, c.dtype) for c in spec.columns}
        scratch.insert(zeros, 1.0)
        for align in ("random", "head", "tail"):
            batch = scratch.sample(2, 1, align)
        scratch.update_priorities(batch.meta_numpy()[0], np.ones(len(batch)))
        scratch.insert_many([zeros, zeros], [1.0, 2.0])
        if getattr(sampler, "alpha", 1.0) != 1.0:  # the parallel powers of large inserts and updates
            power_weights(np.ones(PARALLEL_MIN), sampler.alpha)
            leaf_weights(np.ones(PARALLEL_MIN), sampler.alpha)
        if getattr(sampler, "uses_importance_weights", False):  # and those of a large sample's weights
            importance_weights(np.ones(PARALLEL_MIN, np.float32), sampler.beta)
    finally:
        scratch.close()
    _WARM.add(key)
