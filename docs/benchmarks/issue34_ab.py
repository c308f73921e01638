"""Issue 34, items 3 and 5: another tree's one-call sampler beside this one's, in one process.

``load_base(path)`` imports the ``gear_mpi`` package of another tree (a ``git archive`` copy of main) under the
name ``gear_mpi_base`` (its modules import each other relatively), so that a probe can time its sampling kernel
and this tree's on the same shard, alternated, instead of in two processes (whose page placement alone moves a
W3 step by a few tenths of a millisecond on this VM).
"""
import importlib.util
import os
import sys

import numpy as np

from gear_mpi.keys import GEN_MASK, SLOT_BITS, key_head


def load_base(path: str):
    """The ``gear_mpi.kernels.local_sample`` module of the tree at ``path``, imported as ``gear_mpi_base``."""
    pkg = os.path.join(path, "gear_mpi")
    spec = importlib.util.spec_from_file_location("gear_mpi_base", os.path.join(pkg, "__init__.py"),
                                                  submodule_search_locations=[pkg])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gear_mpi_base"] = mod
    spec.loader.exec_module(mod)
    return importlib.import_module("gear_mpi_base.kernels.local_sample")


def base_sample(base, shard, batch, b: int, kernel_only: bool = False):
    """What ``Shard.sample(b, 1, out=batch)`` did in the base tree through its repeated call (``sample_again``):
    ``2 b`` (random alignment) or ``b`` uniforms from the shard's stream, the base kernel (into this tree's
    scratch, so that this tree's update finds the sorted draw there), the weights' power. ``kernel_only``: the
    uniforms as this tree draws them, so that only the kernels differ."""
    from gear_mpi.kernels import local_sample
    from gear_mpi.selection import one_call
    rep = shard._repeat
    st = shard.store
    if kernel_only:
        one_call.draw_uniforms(shard.rng, rep.draw_u, b, rep.skip, rep.uniforms)
    else:
        shard.rng.random(out=rep.uniforms)
    keys, probabilities, weights, lengths = batch.meta_numpy()
    iscr, fscr = local_sample._scratch(b)
    base._sample_kernel(shard.index._arrays, rep.draw_u, rep.place_u, st.start, st.length, st.status,
                        key_head(st.tag, st.rank), SLOT_BITS, GEN_MASK, st.capacity, rep.window, rep.code,
                        rep.prioritized, shard.column_addresses()[0], shard.spec.step_bytes_array, rep.outs,
                        batch._mask_np, keys, lengths, probabilities, weights, iscr, fscr)
    if rep.prioritized:
        np.power(weights, np.float32(shard.selector.beta), out=weights)
    return batch
