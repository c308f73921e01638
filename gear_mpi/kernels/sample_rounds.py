"""A repeated decentralized sample's two rounds over the node board, each one kernel call (CPU kernels; issue 34).

A repeated ``Replay.sample`` on one node (:mod:`gear_mpi.distributed.repeat`) is two rounds through the ranks'
boards (:mod:`.board`): the heads (this rank's numbers shared, every rank's read), then the choices (each owner
serves its draws into its board, each requester collects its own). After the window copy of a W1 call (2 MB a
rank) every call from Python finds the caches the copy emptied: a numba kernel with a tuple and two arrays as
arguments took 13 us to call on the reference VM, a no-op (1.1 us warm). So each round here is one call of the
kernels it is made of, in the same order, with the same values: :func:`head_round` is ``serve.sample_head``, then
``board.share_row``, then ``board.gather_rows``; :func:`choices_round` is ``serve.serve_choices`` into this rank's
board, then ``board.publish_choices``, then ``board.collect_choices``. Each returns :data:`WAKE` when a node peer
sleeps on this rank's counter (the caller wakes it) and :data:`READ` when the peers' part was there within the
poll (else the caller waits for it, then reads it with the board's own kernel).
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit

from .board import SLOT, collect_choices, gather_rows, publish_choices, share_row
from .gather import CHOICE_WIDTH
from .hints import address_pointer
from .serve import sample_head, serve_choices

WAKE = 1  # a node peer sleeps on one of this rank's counters
READ = 2  # the peers' rows (heads) or this rank's choices (choices) were read


@njit(cache=True, nogil=True)
def head_round(head, columns, call, prefix, l2_min, state, drawn, bases, rank, n, table, spins, cycles):
    """The heads' round ``n`` of a repeated sample, this rank's side: its head row filled
    (``serve.sample_head(head, columns, call, prefix, l2_min, state, drawn)``), shared (``board.share_row``) and
    every rank's read into ``table`` (``board.gather_rows``, polled within ``spins`` / ``cycles``).

    Returns:
        ``WAKE`` and ``READ`` bits (see the module docstring). O(ranks * row + n / 4096).
    """
    sample_head(head, columns, call, prefix, l2_min, state, drawn)
    code = WAKE if share_row(bases, rank, n, head) else 0
    if gather_rows(bases, n, table, spins, cycles):
        code |= READ
    return code


@njit(cache=True, nogil=True)
def choices_round(tree, uniforms, place_u, start, length, generation, key_head, gen_shift, gen_mask, capacity,
                  window, align_code, total, wmin, prioritized, beta, slots, w, ratio, tail, bases, rank, counts,
                  epoch, board_capacity, got, spins, cycles):
    """The choices' round of sample ``epoch``, this rank's side: as owner, ``len(uniforms)`` draws served into its
    board's first rows (``serve.serve_choices`` with the arguments up to ``tail``; ``slots`` gets the slots) and
    published (``board.publish_choices``); as requester, its own choices of every owner collected into ``got``
    (``board.collect_choices`` with ``counts``, polled within ``spins`` / ``cycles``).

    Returns:
        ``WAKE`` and ``READ`` bits (see the module docstring). The draw's cost plus O(ranks**2 + items).
    Raises:
        ValueError: more draws than a board holds (``board_capacity``), or ``collect_choices``' extents.
    """
    served = uniforms.shape[0]
    if served > board_capacity:
        raise ValueError("node board: more choices than a board holds")
    own = numba.carray(address_pointer(bases[rank] + SLOT), (board_capacity, CHOICE_WIDTH), np.int64)
    serve_choices(tree, uniforms, place_u, start, length, generation, key_head, gen_shift, gen_mask, capacity,
                  window, align_code, total, wmin, prioritized, beta, slots, own[:served], w, ratio, tail)
    code = WAKE if publish_choices(bases, rank, epoch) else 0
    if collect_choices(bases, rank, counts, epoch, own, got, board_capacity, spins, cycles):
        code |= READ
    return code
