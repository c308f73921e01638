"""A collective that times out stays pending (gear_mpi.distributed.deadline): its request is kept, and with it
the buffers mpi4py holds for it, so that data a late rank still sends lands in memory that was not freed and
handed to anything else since (a large new batch reuses dropped memory: gear_mpi.batch_memory)."""
import sys

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.distributed import comm as mpi_comm, deadline


def test_a_timed_out_request_keeps_its_buffer_for_a_late_message():
    from mpi4py import MPI
    comm = MPI.COMM_SELF.Dup()
    kept = len(deadline._KEPT_REQUESTS)
    try:
        mpi = mpi_comm.MpiComm(comm, timeout=0.2)
        buf = np.zeros(1 << 16, np.uint8)
        alone = sys.getrefcount(buf)
        req = comm.Irecv(buf, source=0, tag=77)  # nothing is sent yet: it times out
        with pytest.raises(gm.CollectiveTimeoutError, match="test receive"):
            mpi.wait(req, "test receive")
        del req
        assert len(deadline._KEPT_REQUESTS) == kept + 1
        assert sys.getrefcount(buf) > alone  # still held through the kept request
        comm.Send(np.full(1 << 16, 5, np.uint8), dest=0, tag=77)  # the late message: into the kept buffer
        assert (buf == 5).all()
        assert deadline._KEPT_REQUESTS[-1].Test()
    finally:
        del deadline._KEPT_REQUESTS[kept:]
        deadline.forget(comm)
        comm.Free()
