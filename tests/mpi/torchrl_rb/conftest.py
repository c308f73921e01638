"""TorchRL's own replay-buffer tests, run on gear_mpi's storage, samplers and writer (tests/test_torchrl.py runs
them on 1 and 2 ranks).

Provenance: pytorch/rl at v0.14.0 (commit 373c31a85b30, the release torchrl 0.14.1 continues; since 0.14 the
tests live in ``test/rb/*.py``, the former ``test/test_rb.py``). MIT licensed: ``LICENSE`` here. Each copied
file says what it holds and the one change made (the parametrize lists, or the storage/sampler names bound to
gear_mpi's classes); ``_rb_common.py`` is copied unchanged.

Not copied (nothing in them to parametrize with a storage or sampler of another kind, or they test what a
gear_mpi storage does not have): the rest of ``test_rb_core.py`` (consuming samplers, sample units and
sequence expansion, ``update_if_present`` and writer generations, prefetch queues, RNG state of TorchRL's own
samplers, transforms), ``test_storages.py`` but ``test_storage_state_dict`` (tests of TensorStorage,
LazyMemmapStorage, ListStorage, CompressedListStorage, LazyStackStorage internals: their constructors, memmap
files, devices, in-place writes at positions, multiprocess sharing), ``test_samplers.py`` but the mask,
padding and marker tests of SliceSampler (SamplerWithoutReplacement, PrioritizedSliceSampler, staleness and
prompt-group samplers, ``find_start_stop_traj``; the large ``test_slice_sampler`` reads
``storage._storage[index]`` and ``storage.set(range(100), data)`` by position), ``test_prioritized.py`` (each
test builds TorchRL's PrioritizedSampler, or its buffer on the default ListStorage, whose items are references
the test then changes in place; gear_mpi's prioritized draw, weights, reduction and routed updates are tested
in tests/mpi/test_torchrl_adapter.py), ``test_writers.py`` (TensorDictMaxValueWriter, multiprocess writers,
writer generations), ``test_ensemble.py``, ``test_her.py``, ``test_query.py``, ``test_rb_transforms.py``,
``test_storage_map.py``, ``test_rb_distributed.py`` (TorchRL's own services and transports).

Fixtures added here (the tests themselves are untouched): every GearStorage a test builds is closed after it (a
collective), and the tests listed below are skipped with their reason.
"""
from __future__ import annotations

import pytest
from mpi4py import MPI

from gear_mpi.integrations import torchrl as gtrl

POSITIONS = ("reads items at positions (rb[2], rb[:size - 1]); gear_mpi addresses items by key (gear_mpi.keys: "
             "owner rank, slot, generation) -- a position means nothing across the shards of a replay")
CURSOR = ("reads the writer's round-robin cursor (writer._cursor); a gear_mpi shard places items itself (FIFO ring), "
          "and GearWriter returns their keys")

#: copied tests that do not apply to a gear_mpi storage, and why
NOT_APPLICABLE = {
    "TestComposableBuffers.test_cursor_position": CURSOR,
    "TestComposableBuffers.test_index": POSITIONS,
    "TestComposableBuffers.test_extend_sample_recompile": (
        "torch.compile of LazyTensorStorage with RandomSampler only (TorchRL skips it for every other storage)"),
    "TestBuffers.test_cursor_position2": CURSOR,
    "TestBuffers.test_index": POSITIONS,
    "TestBuffers.test_index_nonfull": POSITIONS,
}

#: tests that do not apply on more than one rank
ONE_RANK_ONLY = {
    "TestStorages.test_storage_state_dict": (
        "builds its buffers with prefetch=3: TorchRL's prefetch threads would issue collective samples in a different "
        "order on each rank, so GearStorage refuses prefetch on more than one rank"),
}


@pytest.fixture(autouse=True)
def close_gear_storages(monkeypatch):
    made = []
    init = gtrl.GearStorage.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(gtrl.GearStorage, "__init__", recording)
    yield
    for storage in made:
        storage.close()


def pytest_collection_modifyitems(config, items):
    ranks = MPI.COMM_WORLD.size
    for item in items:
        name = item.originalname if hasattr(item, "originalname") else item.name
        why = NOT_APPLICABLE.get(f"{item.cls.__name__}.{name}" if item.cls else name)
        if why is None and ranks > 1:
            why = ONE_RANK_ONLY.get(f"{item.cls.__name__}.{name}" if item.cls else name)
        if why:
            item.add_marker(pytest.mark.skip(reason=why))
