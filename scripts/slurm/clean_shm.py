#!/usr/bin/env python3
"""Remove the MPICH shared-memory segments a killed run of this Slurm job left on this node.

MPICH (4.2+) names a job step's node-shared memory ``/dev/shm/mpich_shm_<h>_<node>`` (and
``mpich_vci_<h>_<node>``), ``<h>`` the FNV-1a hash of the PMI kvsname, which under ``srun`` is
``<jobid>.<stepid>``. Ranks killed before ``MPI_Finalize`` leave it behind; a requeued job has the same
job id and numbers its steps from 0 again, so its first MPI step would map the dead run's segment and
fail in ``MPI_Init``. slurm/resume_replay.sbatch runs this on every node before a requeued run's step::

    srun -N "$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 python -m scripts.slurm.clean_shm
"""
from __future__ import annotations

import os
import sys

from scripts.slurm.local_slurm import mpich_segments


def main(argv: list[str] | None = None) -> int:
    job = int((argv or sys.argv[1:] or [os.environ.get("SLURM_JOB_ID", "0")])[0])
    gone = []
    for name in sorted(mpich_segments(job, job + 1, steps=64)):
        path = os.path.join("/dev/shm", name)
        try:
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
                gone.append(name)
        except OSError:
            pass
    print(f"clean_shm: job {job}: removed {len(gone)} stale MPICH segment(s) {' '.join(gone)}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
