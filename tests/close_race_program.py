"""A shard (or a one-rank replay, or TorchRL's buffer over one) closed by the main thread while another thread
uses it, many times over: run by tests/test_close_while_used.py in a process of its own, so that a use of freed
memory (a segmentation fault, as a TorchRL prefetch thread's sample met before the shard's lock) fails the test
instead of ending the test run.

    python tests/close_race_program.py CASE CYCLES

CASE: ``sample`` (the repeated one-kernel sample and the update after it), ``full_sample`` (a Fifo shard's sample:
no kernel record), ``insert`` (insert_packed), ``append`` (append_step), ``replay`` (a one-rank Replay's sample,
mode "local") or ``torchrl`` (a TorchRL ReplayBuffer with prefetch=3 over a GearStorage, closed under it).
Prints one line: the cycles run and the set of errors the user threads ended with (each must be the closed
shard's or replay's RuntimeError).
"""
from __future__ import annotations

import sys
import threading
import time

import numpy as np

import gear_mpi as gm

SPEC = gm.TrajectorySpec({"obs": ((256,), "float32")}, max_length=1)
N = 4096


def filled_shard(cycle: int, sampler) -> gm.Shard:
    shard = gm.Shard(SPEC, N, sampler, seed=cycle)
    shard.insert_packed({"obs": np.ones((N, 256), np.float32)}, np.ones(N, np.int64), np.ones(N))
    return shard


def user(case: str, cycle: int):
    """``(object to close, function the other thread calls in a loop)``."""
    if case in ("sample", "full_sample"):
        shard = filled_shard(cycle, gm.Prioritized(0.6, 0.4) if case == "sample" else gm.Fifo())
        out = shard.sample(256, 1)

        def use():
            shard.sample(256, 1, out=out)
            if case == "sample":
                shard.update_priorities(out.keys, np.ones(256))
        return shard, use
    if case in ("insert", "append"):
        shard = filled_shard(cycle, gm.Uniform())
        block = {"obs": np.ones((512, 256), np.float32)}
        step = {"obs": np.ones(256, np.float32)}

        def use():
            if case == "insert":
                shard.insert_packed(block, np.ones(512, np.int64))
            else:
                for _ in range(64):
                    shard.append_step(step)
        return shard, use
    if case == "replay":
        from mpi4py import MPI
        replay = gm.Replay(SPEC, N, gm.Prioritized(0.6, 0.4), comm=MPI.COMM_SELF, mode="local", timeout=30)
        replay.insert_packed({"obs": np.ones((N, 256), np.float32)}, np.ones(N, np.int64))
        out = replay.sample(256, 1)

        def use():
            replay.sample(256, 1, out=out)
        return replay, use
    raise SystemExit(f"unknown case {case!r}")


def torchrl_cycle(cycle: int) -> str | None:
    """TorchRL's buffer with prefetch threads over a GearStorage, sampled, then the storage closed while the
    prefetch threads may still sample (what tests/mpi/torchrl_rb met at its fixture's teardown)."""
    import torch
    from tensordict import TensorDict
    from torchrl.data import ReplayBuffer

    from gear_mpi.integrations.torchrl import GearStorage
    storage = GearStorage(N, comm=None)
    rb = ReplayBuffer(storage=storage, batch_size=256, prefetch=3)
    rb.extend(TensorDict({"obs": torch.ones(N, 256)}, batch_size=[N]))
    for _ in range(3):
        rb.sample()
    # every other cycle closes at once, while the sample just made refills the prefetch queue: the race that
    # matters, met there 7-9 times in 10 (a loaded machine / a quiet one); with 0.5 or 1.5 ms first, 1-4 in 10
    time.sleep(0.0005 * (cycle % 4) if cycle % 2 else 0.0)
    storage.close()
    executor = getattr(rb, "_prefetch_executor", None)
    if executor is not None:  # the prefetch samples still queued: they run after the close and raise
        executor.shutdown(wait=True)
    futures = list(getattr(rb, "_prefetch_queue", []))
    errors = {str(f.exception()) for f in futures if f.done() and f.exception() is not None}
    return next(iter(errors)) if errors else None


def main() -> None:
    case, cycles = sys.argv[1], int(sys.argv[2])
    ended = []
    for cycle in range(cycles):
        if case == "torchrl":
            ended.append(torchrl_cycle(cycle))
            continue
        target, use = user(case, cycle)
        errors, started = [], threading.Event()

        def loop():
            started.set()
            try:
                while True:
                    use()
            except RuntimeError as e:
                errors.append(str(e))

        thread = threading.Thread(target=loop)
        thread.start()
        started.wait()
        time.sleep(0.0005 * (cycle % 4))
        target.close()
        thread.join(30)
        assert not thread.is_alive(), "the user thread did not end after the close"
        ended.append(errors[0] if errors else None)
    print(f"cycles {len(ended)} ended with {sorted(set(map(str, ended)))}", flush=True)


if __name__ == "__main__":
    main()
