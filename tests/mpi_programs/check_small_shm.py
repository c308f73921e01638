"""Run in a mount namespace whose /dev/shm is a 64 MB tmpfs (tests/test_small_shm.py).

Every rank: a Replay of about 200 MB a rank with memory="shm" must fail at construction with
the same MemoryBudgetError naming /dev/shm, not die later of SIGBUS; a Shard of 200 MB in
shared memory (no collective check) must fail at creation the same way (posix_fallocate);
a writer's staging area too large for /dev/shm likewise; a small replay still works.
"""
import numpy as np
from mpi4py import MPI

import gear_mpi as gm
from gear_mpi.feeds import intake

comm = MPI.COMM_WORLD
spec = gm.TrajectorySpec({"obs": ((1024,), np.uint8)}, max_length=10)
try:
    gm.Replay(spec, 200 * 1024, memory="shm", timeout=30)
    raise SystemExit("FAIL: the replay was built")
except gm.MemoryBudgetError as e:
    msgs = comm.allgather(str(e))
    assert len(set(msgs)) == 1 and "/dev/shm" in msgs[0], msgs
try:
    gm.Shard(spec, 200 * 1024, memory="shm")
    raise SystemExit("FAIL: the shard was built")
except gm.MemoryBudgetError as e:
    assert "cannot reserve" in str(e) and "/dev/shm" in str(e), str(e)
with gm.Replay(spec, 1000, memory="shm", timeout=30) as replay:
    replay.insert({"obs": np.ones((5, 1024), np.uint8)})
    assert len(replay.sample(2, 3)) == 2
    point = intake.WriterIntake(replay.shard)
    try:
        gm.Writer(point.address, staging_steps=100 * 1024)  # 100 MB of staging
        raise SystemExit("FAIL: the writer was built")
    except gm.MemoryBudgetError as e:
        assert "cannot reserve" in str(e), str(e)
    point.close()
comm.Barrier()
if comm.rank == 0:
    print("SMALL-SHM-OK", flush=True)
