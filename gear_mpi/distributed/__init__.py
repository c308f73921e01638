"""The collectives: how the ranks of a replay agree, plan and exchange.

Lowest first:

- :mod:`.deadline` -- the polling wait every collective uses, and the communicators a timeout left unusable;
- :mod:`.comm` -- ``MpiComm``: collectives with a deadline and errors agreed on every rank;
- :mod:`.calls` -- the head every collective of a replay begins with: the call and its number, so that
  ranks in different calls all raise the same CollectiveError naming them;
- :mod:`.torch_comm` -- the NCCL/gloo exchange of device windows (torch.distributed);
- :mod:`.node` -- the node's ranks, node peers' shared memory mapped, the node fence;
- :mod:`.header` -- a sample's header: its layout, this rank's row, its agreement and checks;
- :mod:`.plans` -- selection plans: which owner serves which requester in each mode;
- :mod:`.transport` -- the choices and windows from owners to requesters;
- :mod:`.routing` -- key-routed collectives: priority updates and whole-trajectory fetches;
- :mod:`.prefetch` -- ``replay.batches()``: samples on a background thread, same order on every rank;
- :mod:`.parallel` -- tensor/pipeline/data-parallel groups and one batch per model replica;
- :mod:`.framework_groups` -- those groups read from a torch DeviceMesh, a Megatron/DeepSpeed mpu or torch
  process groups (``gm.parallel_groups.from_device_mesh``, ``from_mpu``, ``from_process_groups``);
- :mod:`.recovery` -- surviving a dead rank where MPI has ULFM: revoke and shrink to the survivors
  (``Replay.recover``).

The package's ``__init__`` imports none of them: a process that never communicates
(an actor's writer) does not load mpi4py.
"""
