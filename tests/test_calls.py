"""The heads of a replay's collectives (gear_mpi.distributed.calls), in one process.

The agreement's decisions -- a mismatch of calls, the marking of a communicator that may hold a pending
payload, the values handed back -- are checked here with a stand-in node board that plays the other
ranks' rows; tests/test_mismatch_mpi.py checks the same on real ranks.
"""
from __future__ import annotations

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.distributed import calls, deadline, header
from gear_mpi.kernels import board


class Handle:
    def __init__(self, key: int):
        self.key = key

    def py2f(self) -> int:
        return self.key

    def Iallgather(self, send, out):  # a payload's allgather: completes at once, every rank sending the same
        out[:] = send
        return Done()


class Done:
    def Test(self) -> bool:
        return True


class Comm:
    """What ReplayCalls uses of an MpiComm: size, rank, the handle, broken, check_usable, wait."""

    def __init__(self, size: int, key: int):
        self.size, self.rank, self.comm, self.broken, self.timeout = size, 0, Handle(key), None, 1.0

    def check_usable(self):
        if self.broken is not None:
            raise gm.CollectiveError(f"communicator unusable after an earlier failure: {self.broken}")

    def wait(self, req, what):
        assert req.Test()


class Board:
    """Rank 0's own row, and the other ranks' rows as ``others(head)`` makes them."""

    def __init__(self, others):
        self.others, self.row = others, None

    def share(self, row) -> int:
        self.row = np.array(row, np.float64)
        return 1

    def gather(self, n, width, what):
        return np.stack([self.row, *self.others(self.row)])[:, :width]


def code(number: int, op: str) -> float:
    return float(number * 64 + calls.OPS.index(op))


def test_a_head_holds_a_sample_header_and_fits_a_board_row():
    assert header.HEADER_WIDTH <= calls.VALUES
    assert calls.WIDTH <= board.ROW  # (the node board's layout: gear_mpi/kernels/board.py)


def test_the_message_names_each_rank_s_call_grouped_in_rank_order():
    codes = [code(7, "sample"), code(7, "sample"), code(7, "stats"), code(7, "sample"), float("nan")]
    message = calls.mismatch_message(codes)
    assert message.startswith("collective mismatch: ranks 0-1, 3 called sample (call #7), rank 2 called stats "
                              "(call #7), rank 4 called something that is not a collective of this replay;")
    assert calls.call_name(5.0) == calls.call_name(code(1, "sample") + 0.5) == calls.call_name(1e300 * 1e300)
    assert calls.call_name(code(3, "update_priorities (batches)")) == "update_priorities (batches) (call #3)"
    many = calls.mismatch_message([code(1 + r, "stats") for r in range(calls.SHOWN + 3)])
    assert "and 3 other calls" in many and "rank 8" not in many


def test_matching_heads_give_the_values_and_count_the_calls():
    comm = Comm(3, 9001)
    rc = calls.ReplayCalls(comm, Board(lambda row: [row, row]))
    got = rc.agree(None, "update_priorities", [1.0])
    assert got.shape == (3, 1) and got.tolist() == [[1.0]] * 3 and rc.count == 1
    values, table = rc.agree(None, "stats", payload=np.arange(4.0))
    assert values.shape == (3, 0) and table.shape == (3, 4) and rc.count == 2
    assert comm.broken is None


@pytest.mark.parametrize("mine,theirs,pending", [("update_priorities", "get_many", False),
                                                 ("sample", "stats", True),
                                                 ("update_priorities (batches)", "sample", True)])
def test_different_calls_raise_collective_error_and_break_the_communicator(mine, theirs, pending):
    comm = Comm(2, 9100 + len(mine) + len(theirs))

    def other(row):
        peer = row.copy()
        peer[1] = code(int(row[1]) // 64, theirs)
        return [peer]
    rc = calls.ReplayCalls(comm, Board(other))
    rc.count = 6
    payload = np.zeros(3, np.int64) if mine in calls.PAYLOADS else None
    try:
        with pytest.raises(gm.CollectiveError) as info:
            rc.agree(None, mine, payload=payload)
        assert type(info.value) is gm.CollectiveError
        assert f"rank 0 called {mine} (call #7), rank 1 called {theirs} (call #7)" in str(info.value)
        assert comm.broken == str(info.value)
        # a payload may be pending on some rank: every rank marks the communicator (Replay.load refuses it)
        assert (deadline.pending_reason(comm.comm) is not None) == pending
        with pytest.raises(gm.CollectiveError, match="unusable"):
            rc.agree(None, mine, payload=payload)
    finally:
        deadline.forget(comm.comm)


def test_agreed_error_classes_keep_python_common_ones_and_list_bases_first():
    """An agreement sends a rank's error as its most specific class in the table: an OverflowError (a size of
    inf through int()) arrived on every rank as a bare Exception; Python's common classes are now in the table,
    each after its bases, so that gear_mpi's errors (EmptyReplayError is a RuntimeError, StorageError an
    OSError) still arrive as themselves."""
    from gear_mpi.distributed import comm
    _ERROR_CODES, error_code = comm._ERROR_CODES, comm.error_code
    for i, cls in enumerate(_ERROR_CODES):
        assert not any(issubclass(cls, later) for later in _ERROR_CODES[i + 1:] if later is not cls), cls
    for exc in (OverflowError(), ZeroDivisionError(), NotImplementedError(), IndexError(), OSError(), KeyError(),
                gm.EmptyReplayError(), gm.StorageError(), gm.CorruptDataError(), gm.MemoryBudgetError()):
        assert _ERROR_CODES[error_code(exc)] is type(exc)
    assert _ERROR_CODES[error_code(FileNotFoundError())] is OSError
    assert _ERROR_CODES[error_code(LookupError())] is Exception
