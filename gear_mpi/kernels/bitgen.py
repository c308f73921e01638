"""numpy's bit generator drawn from inside a kernel, through its C interface (issue 34).

``Generator.random(out=u)`` fills ``u`` by calling the bit generator's ``next_double`` on its state once a value;
numpy publishes both (``BitGenerator.ctypes``: ``next_double``, ``state_address``). A kernel handed the two
addresses makes the same calls: the same doubles in the same order, and the generator left in the same state,
for every bit generator numpy has (PCG64, Philox, SFC64, MT19937). A small sample saves the Python call of
``rng.random`` (1.9 us of a 20-25 us one-step sample of 64 items here). The caller holds the generator's lock
during the kernel, as ``Generator.random`` holds it during its fill, and keeps the generator alive.
"""
from __future__ import annotations

import ctypes

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

#: ``words`` of :func:`fill_doubles`: [next_double's address, the state's address]
WORDS = 2


def generator_words(rng: np.random.Generator) -> np.ndarray:
    """The two words by which a kernel draws from ``rng``'s bit generator: ``next_double``'s address and the
    state's (uint64). Valid while the bit generator lives. O(1).

    Args:
        rng: a numpy ``Generator``.
    Returns:
        uint64 ``[WORDS]``.
    """
    c = rng.bit_generator.ctypes
    return np.array([ctypes.cast(c.next_double, ctypes.c_void_p).value, c.state_address], np.uint64)


@intrinsic
def _next_double(typingctx, function, state):
    """``function(state)``: a ``double (*)(void *)`` called at address ``function`` on the state at ``state``."""
    sig = types.float64(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.DoubleType(), [cgutils.voidptr_t])
        fn = builder.inttoptr(args[0], fnty.as_pointer())
        return builder.call(fn, [builder.inttoptr(args[1], cgutils.voidptr_t)])

    return sig, codegen


@njit(cache=True, inline="always")
def fill_doubles(words, out, lo, hi):
    """``out[lo:hi]`` from the bit generator at ``words`` (:func:`generator_words`), as ``Generator.random``
    fills it. O(hi - lo) calls of ``next_double``."""
    for i in range(lo, hi):
        out[i] = _next_double(words[0], words[1])
