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


def test_a_repeated_samples_rounds_are_their_kernels_in_one_call():
    """``sample_rounds.head_round`` = ``serve.sample_head`` + ``board.share_row`` + ``board.gather_rows`` and
    ``sample_rounds.choices_round`` = ``serve.serve_choices`` into the board + ``publish_choices`` +
    ``collect_choices``: the same rows and choices, and the WAKE / READ bits."""
    import gear_mpi as gm
    from gear_mpi import keys as keyspace
    from gear_mpi.kernels import sample_rounds as rounds
    from gear_mpi.kernels import serve

    spec = gm.TrajectorySpec({"x": ((), "float32")}, max_length=4)
    shard = gm.Shard(spec, 4000, gm.Prioritized(0.6, 0.4), seed=1)
    rng = np.random.default_rng(1)
    shard.insert_packed({"x": rng.random(4000, dtype=np.float32)}, np.full(1000, 4, np.int64), rng.random(1000) + 0.1)
    tree, st = shard.index.tree, shard.store
    mem, bases = boards(2)
    columns = np.array([5, 6, 7, 9, 10], np.int64)
    head, want, table = np.zeros(16), np.zeros(16), np.full((2, 16), -1.0)
    serve.sample_head(want, columns, 9.0, tree.prefix, tree.l2_min, st.state, 3)
    code = rounds.head_round(head, columns, 9.0, tree.prefix, tree.l2_min, st.state, 3, bases, 0, 1, table, 16,
                             1 << 10)
    assert code == 0 and (head == want).all() and (table == -1.0).all()  # rank 1 not there yet: nothing read
    mem[1][board.SLEEPING:board.SLEEPING + 4].view(np.uint32)[0] = 1  # rank 1 sleeps on rank 0's counter
    board.share_row(bases, 1, 1, want + 1)
    code = rounds.head_round(head, columns, 9.0, tree.prefix, tree.l2_min, st.state, 3, bases, 0, 2, table, 1, 0)
    assert code == rounds.WAKE  # round 2: rank 1 is still at round 1
    assert board.gather_rows(bases, 1, table, 1, 0) and (table[1] == want + 1).all()

    args = (shard.index._arrays, rng.random(9), np.zeros(0), st.start, st.length, st.generation,
            keyspace.key_head(st.tag, st.rank), keyspace.SLOT_BITS, keyspace.GEN_MASK, st.capacity, 3, 1,
            tree.prefix[-1], float(tree.l2_min.min()), True, 0.4)
    slots, choices = np.empty(9, np.int64), np.empty((9, board.CHOICE_WIDTH), np.int64)
    w, ratio = np.empty(9), np.empty(9, np.float32)
    serve.serve_choices(*args, slots, choices, w, ratio, 0)
    counts = np.array([[9, 0], [0, 0]], np.int64)  # rank 0 serves itself 9
    got, slots2 = np.zeros((9, board.CHOICE_WIDTH), np.int64), np.empty(9, np.int64)
    code = rounds.choices_round(*args, slots2, np.empty(9), np.empty(9, np.float32), 0, bases, 0, counts, 5, CAPACITY,
                                got, 1, 0)
    assert code == rounds.WAKE | rounds.READ and (slots2 == slots).all() and (got == choices).all()
    own = mem[0][board.SLOT:board.SLOT + choices.nbytes].view(np.int64).reshape(9, board.CHOICE_WIDTH)
    assert (own == choices).all() and counter(mem[0], board.CHOICE_COUNT) == 5


def test_update_pairs_are_collected_in_sender_order_from_each_senders_rows_for_this_owner():
    ranks, n = 3, 4
    rng = np.random.default_rng(2)
    counts = rng.integers(0, 5, (ranks, ranks))  # [sender, owner]
    mem, bases = boards(ranks)
    words = CAPACITY * board.CHOICE_WIDTH
    sent = [rng.integers(0, 1 << 40, (int(counts[r].sum()), 2)) for r in range(ranks)]
    for r in range(ranks - 1):
        board.post_pairs(bases, r, n, sent[r], words)
    got = np.full((int(counts[:, 0].sum()), 2), -1, np.int64)
    if counts[ranks - 1, 0]:  # the last sender has not posted: nothing copied
        assert not board.collect_pairs(bases, 0, counts, n, got, words, 16, 1 << 10) and (got == -1).all()
    board.post_pairs(bases, ranks - 1, n, sent[ranks - 1], words)
    for owner in range(ranks):
        got = np.empty((int(counts[:, owner].sum()), 2), np.int64)
        assert board.collect_pairs(bases, owner, counts, n, got, words, 1, 0)
        want = [sent[r][counts[r, :owner].sum():counts[r, :owner + 1].sum()] for r in range(ranks)]
        assert (got == np.concatenate(want)).all()
    with pytest.raises(ValueError, match="more update pairs than a board holds"):
        board.post_pairs(bases, 0, n + 1, np.zeros((words // 2 + 1, 2), np.int64), words)
