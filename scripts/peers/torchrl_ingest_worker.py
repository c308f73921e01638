#!/usr/bin/env python
"""TorchRL side of scripts/bench/bench_offline.py part (a): ``ReplayBuffer.extend`` of packed steps.

    python -m scripts.peers.torchrl_ingest_worker '{"N": 10000000, "reps": 3}'

Runs in TorchRL's own virtual environment (made by ``python -m scripts.bench.compare_peers
--setup-only --peers torchrl``). The data are :func:`ingest_columns` (numpy only, so that the
gear_mpi side builds the very same arrays): hopper-like one-step items, obs float32[11],
action float32[3], reward float32, done bool (61 bytes). They are wrapped, without a copy,
in a TensorDict of batch size N and given to ``ReplayBuffer(storage=LazyTensorStorage(N))``:
``extend`` of all N once into the empty buffer (cold: the storage is allocated by that
call, as gear_mpi's ring pages are committed by its first insert; ``made_cold_s`` adds the
``ReplayBuffer`` construction) and then ``reps`` more
times into the full one (warm: every item overwrites one). Prints one JSON object.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

HOPPER_STEP = {"obs": ((11,), np.float32), "action": ((3,), np.float32), "reward": ((), np.float32),
               "done": ((), np.bool_)}


def ingest_columns(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``rows`` hopper-like steps, one C-contiguous array per column (the same on both sides)."""
    rng = np.random.default_rng(seed)
    return {"obs": rng.standard_normal((rows, 11), dtype=np.float32),
            "action": rng.standard_normal((rows, 3), dtype=np.float32),
            "reward": rng.standard_normal(rows, dtype=np.float32),
            "done": (np.arange(rows) % 1000) == 999}


def step_bytes() -> int:
    return int(sum(np.prod(s, dtype=np.int64) * np.dtype(d).itemsize for s, d in HOPPER_STEP.values()))


def main() -> None:
    cfg = json.loads(sys.argv[1])
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from importlib.metadata import version

    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    n = int(cfg["N"])
    cols = ingest_columns(n)
    td = TensorDict({k: torch.from_numpy(v) for k, v in cols.items()}, batch_size=[n])
    t_new = time.perf_counter()
    rb = ReplayBuffer(storage=LazyTensorStorage(n))
    t0 = time.perf_counter()
    rb.extend(td)
    cold = time.perf_counter() - t0
    made_cold = time.perf_counter() - t_new  # construction + first extend (the storage is made by it)
    assert len(rb) == n
    warm = []
    for _ in range(int(cfg.get("reps", 3))):
        t0 = time.perf_counter()
        rb.extend(td)
        warm.append(time.perf_counter() - t0)
    check = rb.storage[n - 1]  # the data really went in
    assert float(check["reward"]) == float(cols["reward"][n - 1])
    print(json.dumps({"peer": "torchrl", "case": "extend", "N": n, "step_bytes": step_bytes(), "cold_s": cold,
                      "made_cold_s": made_cold, "warm_s": warm, "version": f"torchrl {version('torchrl')}, torch {torch.__version__}",
                      "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
