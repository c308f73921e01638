"""The node board's round kernels (gear_mpi/kernels/board.py) on boards in this process's memory: a head round
read only once every rank published it, the choices collected in owner order from the right rows, a sleeping peer
reported to its publisher, and bad extents refused. The boards' use by ranks sharing a node is tested under
mpiexec (tests/test_replay_repeat.py, tests/test_replay_mpi.py, tests/test_mismatch_mpi.py)."""
from __future__ import annotations

import numpy as np
import pytest

from gear_mpi.kernels import board

CAPACITY = 64


def boards(ranks: int):
    """``ranks`` zeroed boards and their addresses (the arrays keep the memory alive)."""
    mem = [np.zeros(board.SLOT + CAPACITY * board.CHOICE_WIDTH * 8, np.uint8) for _ in range(ranks)]
    return mem, np.array([m.ctypes.data for m in mem], np.int64)


def counter(mem, offset):
    return int(mem[offset:offset + 4].view(np.uint32)[0])


def test_a_head_round_is_read_once_every_rank_published_it():
    mem, bases = boards(3)
    rows = [np.arange(5, dtype=np.float64) + 10 * r for r in range(3)]
    table = np.full((3, 5), -1.0)
    for r in (0, 2):
        assert not board.share_row(bases, r, 1, rows[r])
        assert counter(mem[r], board.HEAD_COUNT) == 1
    assert not board.gather_rows(bases, 1, table, 64, 1 << 12)  # rank 1 has not published: nothing read
    assert (table == -1.0).all()
    board.share_row(bases, 1, 1, rows[1])
    assert board.gather_rows(bases, 1, table, 1, 0)
    assert (table == np.stack(rows)).all()
    board.share_row(bases, 0, 2, rows[0] + 100)  # the next round goes to the other row; round 1's stays readable
    assert board.gather_rows(bases, 1, table, 1, 0) and (table == np.stack(rows)).all()
    with pytest.raises(ValueError, match="at most 16"):
        board.share_row(bases, 0, 3, np.zeros(17))


def test_a_counter_that_wrapped_past_2_to_the_32_still_counts_as_reached():
    mem, bases = boards(2)
    for r in range(2):
        board.share_row(bases, r, 2 ** 32 + 3, np.ones(2))  # the stored word wraps to 3
    assert counter(mem[0], board.HEAD_COUNT) == 3
    assert board.gather_rows(bases, 2 ** 32 + 3, np.empty((2, 2)), 1, 0)
    assert not board.gather_rows(bases, 2 ** 32 + 4, np.empty((2, 2)), 8, 1 << 10)


def test_a_publisher_is_told_that_a_peer_sleeps_on_its_counter():
    mem, bases = boards(3)
    mem[2][board.SLEEPING:board.SLEEPING + 4].view(np.uint32)[0] = 1 + 1  # rank 2 sleeps on rank 1's counter
    assert board.publish_choices(bases, 1, 5)
    assert not board.publish_choices(bases, 0, 5)
    assert board.share_row(bases, 1, 1, np.zeros(1)) and not board.share_row(bases, 0, 1, np.zeros(1))
    assert counter(mem[1], board.CHOICE_COUNT) == 5


def test_choices_are_collected_in_owner_order_from_each_owners_rows_for_this_requester():
    ranks, epoch = 3, 7
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 6, (ranks, ranks))  # [requester, owner]
    mem, bases = boards(ranks)
    served = []
    for o in range(ranks):  # owner o's board: its choices for requester 0, then 1, then 2
        rows = rng.integers(0, 1 << 40, (int(counts[:, o].sum()), board.CHOICE_WIDTH))
        mem[o][board.SLOT:board.SLOT + rows.nbytes] = rows.view(np.uint8).ravel()
        served.append(rows)
    for me in range(ranks):
        got = np.full((int(counts[me].sum()), board.CHOICE_WIDTH), -1, np.int64)
        others = [o for o in range(ranks) if o != me and counts[me, o] > 0]
        for o in range(ranks):
            if o != me:
                board.publish_choices(bases, o, epoch - 1)
        if others:  # an owner of this requester's rows has not published this sample: nothing copied
            assert not board.collect_choices(bases, me, counts, epoch, served[me], got, CAPACITY, 16, 1 << 10)
            assert (got == -1).all()
        for o in range(ranks):
            board.publish_choices(bases, o, epoch)
        assert board.collect_choices(bases, me, counts, epoch, served[me], got, CAPACITY, 1, 0)
        want = [served[o][counts[:me, o].sum():counts[:me + 1, o].sum()] for o in range(ranks)]
        assert (got == np.concatenate(want)).all()


def test_bad_extents_are_refused_before_a_copy():
    mem, bases = boards(2)
    for o in range(2):
        board.publish_choices(bases, o, 1)
    counts = np.array([[1, 3], [0, 0]], np.int64)
    own = np.zeros((1, board.CHOICE_WIDTH), np.int64)
    with pytest.raises(ValueError, match="more choices"):
        board.collect_choices(bases, 0, counts, 1, own, np.zeros((3, board.CHOICE_WIDTH), np.int64), CAPACITY, 1, 0)
    with pytest.raises(ValueError, match="past the owner's board"):
        board.collect_choices(bases, 0, counts, 1, own, np.zeros((4, board.CHOICE_WIDTH), np.int64), 2, 1, 0)
    with pytest.raises(ValueError, match="past the owner's rows"):
        board.collect_choices(bases, 0, np.array([[2, 0], [0, 0]], np.int64), 1, own,
                              np.zeros((2, board.CHOICE_WIDTH), np.int64), CAPACITY, 1, 0)
