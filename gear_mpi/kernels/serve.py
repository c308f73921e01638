"""The owner's side of a decentralized sample in one kernel call: draw the slots, describe them as choices.

``Replay.sample`` on one node (:mod:`gear_mpi.distributed.repeat`) made three calls and three temporaries
here: ``PriorityIndex.draw`` (``priority_draw.draw``), ``gather.fill_choices`` and the selector's importance
weights (a division, a cast, a power). :func:`serve_choices` makes all three in one call, into buffers the
caller keeps (the choices straight into its node board's rows), with the power of
:func:`~gear_mpi.kernels.weights.importance_powers_into` (as ``Prioritized.importance_weights``), so every value is
the full path's, bit for bit: the same slot for every uniform, the same key, placement, probability and weight.
:func:`sample_head` reads the numbers a rank's head row of that sample carries from the index's and the ring's
arrays in one call (after a window copy of megabytes the Python property chain that read them took about 25 us
of a 0.25 ms two-rank W1 call, its caches cold).
"""
from __future__ import annotations

from numba import njit

from .gather import WEIGHT, _float_bits, fill_choices
from .priority_draw import draw
from .priority_tree import least_positive
from .ring import INSERTED_TOTAL, LIVE_COUNT
from .weights import importance_powers_into

ONE_BITS = 0x3FF0000000000000  # the IEEE bits of 1.0: a choice's weight when no importance weight applies


@njit(cache=True, nogil=True)
def serve_choices(tree, uniforms, place_u, start, length, generation, key_head, gen_shift, gen_mask, capacity,
                  window, align_code, total, wmin, prioritized, beta, slots, choices, w, ratio, tail):
    """Draw one slot per uniform from ``tree`` (the index's arrays) into ``slots``, and write each one's
    choice into ``choices`` (``[len(uniforms), CHOICE_WIDTH]`` int64: key, placement with ``place_u`` for
    random alignment, probability ``w / total``, importance weight) as ``gather.fill_choices`` and the selector
    make them. ``prioritized``: the weight is ``float32(r ** beta)`` for the ratio ``r = float32(wmin / w)``
    (:func:`~gear_mpi.kernels.weights.importance_powers_into`; the ratios are left in ``ratio``, float32, and the
    weights as float64 in ``w``, which first holds each slot's index weight); else 1.
    Cost: the draw's, plus O(B). The caller guarantees a positive total."""
    draw(tree, uniforms, slots)
    fill_choices(slots, start, length, generation, key_head, gen_shift, gen_mask, capacity, window, align_code,
                 place_u, tree[0], total, choices, w, tail)
    n = slots.shape[0]
    if prioritized:
        for i in range(n):
            ratio[i] = wmin / w[i]
        importance_powers_into(ratio, beta, w, 0, n)
        for i in range(n):
            choices[i, WEIGHT] = _float_bits(w[i])
    else:
        for i in range(n):
            choices[i, WEIGHT] = ONE_BITS


@njit(cache=True, nogil=True)
def sample_head(head, columns, call, prefix, l2_min, state, drawn):
    """Fill a rank's head row of a sample (``head``, float64) from its shard's arrays: ``call`` at 1, and at
    ``columns`` (int64: the header's mass, live items, smallest weight, items ever inserted and windows drawn
    columns, offset into the row) the index's total weight (``prefix``'s last entry), the ring's live count
    (``state``), the least positive weight (the least of the level-2 minima ``l2_min``, inf for none: as
    ``PriorityIndex.min_positive``), the ring's items ever inserted and ``drawn``: the values ``header.build_row``
    reads through the shard, bit for bit. O(n / 4096) for an index of n slots."""
    head[1] = call
    head[columns[0]] = prefix[prefix.shape[0] - 1]
    head[columns[1]] = state[LIVE_COUNT]
    head[columns[2]] = least_positive(l2_min)
    head[columns[3]] = state[INSERTED_TOTAL]
    head[columns[4]] = drawn
