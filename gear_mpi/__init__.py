"""gear_mpi: a distributed, GPU-centric experience replay as SPMD collectives on MPI and NCCL."""
from . import threads as _threads

_threads.apply_defaults()  # before numba loads its threading layer: idle workers sleep (see gear_mpi.threads)

from .batch import Batch
from .errors import CheckpointError, CollectiveError, CorruptDataError, CollectiveTimeoutError, EmptyReplayError, GearError, InvalidKeyError, InvalidPriorityError, InvalidTrajectoryError, MemoryBudgetError, RateLimitTimeoutError, StaleKeyError, StorageError, WriterError, WriterTimeoutError, RecoveryError
from .feeds.rate_limit import MinSize, RateLimiter, SampleToInsertRatio
from .selection.selectors import Fifo, Lifo, MaxPriority, MinPriority, Prioritized, Selector, Uniform
from .replay import Replay
from .shard import Shard
from .spec import Compressed, TrajectorySpec
from .frames import FrameStack, NextStep
from .storage.columns import attach_columns
from .feeds.writer import EpisodeWriter, Writer
from .feeds.remote import MpiWriter
from .distributed.parallel import ParallelGroups, ReplicaSampler, parallel_groups
from .distributed.recovery import Recovery
from .distributed import framework_groups as _framework_groups
from .stats import RateMeter, log_every, rates
from .checkpoint import save as save_checkpoint
from .checkpoint.shard_archive import load_shard, save_shard, shard_arrays, shard_from_arrays
from . import datasets
from .threads import get_threads, set_threads

# the groups a job already has (torch DeviceMesh, Megatron/DeepSpeed mpu, torch process groups), as
# gm.parallel_groups.from_device_mesh(mesh) etc.: the same ParallelGroups that parallel_groups builds
parallel_groups.from_device_mesh = _framework_groups.from_device_mesh
parallel_groups.from_mpu = _framework_groups.from_mpu
parallel_groups.from_process_groups = _framework_groups.from_process_groups

load_checkpoint = Replay.load  # load_checkpoint(path, comm=None, **overrides): the checkpoint package builds a Replay

__version__ = "0.1.0"


def __getattr__(name: str):
    """``init_torch_process_group`` (comm_torch.init_process_group) is imported on first use: torch loads only
    for jobs that ask for it."""
    if name == "init_torch_process_group":
        from .distributed.torch_comm import init_process_group
        return init_process_group
    raise AttributeError(f"module 'gear_mpi' has no attribute {name!r}")


__all__ = ["Batch", "CollectiveError", "CollectiveTimeoutError", "EmptyReplayError", "Fifo", "GearError",
           "InvalidKeyError", "InvalidPriorityError", "InvalidTrajectoryError", "Lifo", "MaxPriority",
           "MinPriority", "Prioritized", "FrameStack", "NextStep", "Replay", "Selector", "Shard", "StaleKeyError", "TrajectorySpec", "Compressed", "CorruptDataError", "Uniform",
           "attach_columns", "CheckpointError", "load_checkpoint", "save_checkpoint", "RateLimitTimeoutError",
           "WriterError", "WriterTimeoutError", "MemoryBudgetError", "StorageError", "MinSize", "RateLimiter",
           "SampleToInsertRatio", "EpisodeWriter", "Writer", "MpiWriter", "datasets", "ParallelGroups",
           "ReplicaSampler", "parallel_groups", "RateMeter", "log_every", "rates", "init_torch_process_group",
           "save_shard", "load_shard", "shard_arrays", "shard_from_arrays", "RecoveryError", "Recovery",
           "set_threads", "get_threads"]
