"""The owner's side of a decentralized sample in one kernel call: draw the slots, describe them as choices.

``Replay.sample`` on one node (:mod:`gear_mpi.distributed.repeat`) made three calls and three temporaries
here: ``PriorityIndex.draw`` (``priority_draw.draw``), ``gather.fill_choices`` and the selector's importance
weights (a division, a cast, a power). :func:`serve_choices` makes the first two and the division in one call,
into buffers the caller keeps (the choices straight into its node board's rows); the power is the caller's
(``kernels.weights.importance_weights``, as ``Prioritized.importance_weights``), so every value is the full
path's, bit for bit: the same slot for every uniform, the same key, placement and probability, the same weight.
"""
from __future__ import annotations

from numba import njit

from .gather import WEIGHT, fill_choices
from .priority_draw import draw

ONE_BITS = 0x3FF0000000000000  # the IEEE bits of 1.0: a choice's weight when no importance weight applies


@njit(cache=True, nogil=True)
def serve_choices(tree, uniforms, place_u, start, length, generation, key_head, gen_shift, gen_mask, capacity,
                  window, align_code, total, wmin, prioritized, slots, choices, w, ratio, tail):
    """Draw one slot per uniform from ``tree`` (the index's arrays) into ``slots``, and write each one's
    choice into ``choices`` (``[len(uniforms), CHOICE_WIDTH]`` int64: key, placement with ``place_u`` for
    random alignment, probability ``w / total``) as ``gather.fill_choices`` does, with its index weight in
    ``w`` (float64). ``prioritized``: ``ratio[i] = float32(wmin / w[i])``, the base of the importance weight
    (the caller raises it to ``beta`` and stores it in the choice); else the choice's weight is 1.
    Cost: the draw's, plus O(B). The caller guarantees a positive total."""
    draw(tree, uniforms, slots)
    fill_choices(slots, start, length, generation, key_head, gen_shift, gen_mask, capacity, window, align_code,
                 place_u, tree[0], total, choices, w, tail)
    n = slots.shape[0]
    if prioritized:
        for i in range(n):
            ratio[i] = wmin / w[i]
    else:
        for i in range(n):
            choices[i, WEIGHT] = ONE_BITS
