"""Where a shard's data lives: the column ring and the trajectory table, and the memory under them.

One module per concept, lowest first:

- :mod:`.arenas` -- the arena a shard's columns live in: an anonymous private mapping or POSIX
  shared memory, its header and column layout (and :mod:`.file_arenas`: memory-mapped files,
  ``memory="file"``; :mod:`.huge_pages`: a first fill's pages merged into huge pages);
- :mod:`.pinned`, :mod:`.device` -- page-locked mappings for a GPU, and the rank's GPU;
- :mod:`.table` -- the trajectory table's row types (bytes per slot) and :class:`~.table.TableLayout`, the
  table a store holds: its rows, raw priorities and checkpoint sections;
- :mod:`.store_insert` -- what a batch insert needs besides the store: chunk bounds, the eviction scratch,
  the column-copy thread, the raw-priority and index-leaf kernels;
- :mod:`.store` -- :class:`TrajectoryStore`: the columnar step ring and the trajectory table, and the
  batch insert into them (:meth:`TrajectoryStore.insert_chunked`);
- :mod:`.shard_insert` -- :class:`~.shard_insert.ShardInserter`, the shard's part that checks every insert
  path and ends in one packed store;
- :mod:`.columns` -- column addresses, another process's columns attached, host window copies;
- :mod:`.compressed` -- a compressed column's chunks (:class:`~.compressed.CompressedRing`);
- :mod:`.budget` -- the node's memory budget for its shards, agreed at construction.

Local: nothing here communicates (the budget's agreement goes through the caller's communicator).
"""
from .arenas import PrivateArena, SharedArena, anonymous_pages, column_layout, make_arena, reads_done_counter
from .columns import attach_columns, gather_into
from .device import DeviceContext, gpu_for, parse_device
from .store import TrajectoryStore

__all__ = ["PrivateArena", "SharedArena", "anonymous_pages", "column_layout", "make_arena", "reads_done_counter",
           "attach_columns", "gather_into", "DeviceContext", "gpu_for", "parse_device", "TrajectoryStore"]
