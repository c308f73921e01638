"""How data reaches a replay from outside its ranks, and how fast.

- :mod:`.writer` -- ``EpisodeWriter`` (the writer interface) and ``Writer``: an actor process's
  episodes staged in shared memory for its owner rank;
- :mod:`.staging` -- the shared-memory layout between writers and their owner;
- :mod:`.intake` -- :class:`WriterIntake`: the owner's side, finding writers and draining their
  ended episodes into the shard;
- :mod:`.remote` -- actor ranks: ``MpiWriter`` and the learner's inbox;
- :mod:`.rate_limit` -- ``RateLimiter``, ``MinSize``, ``SampleToInsertRatio`` (pure logic);
- :mod:`.replay_feeds` -- a replay's part that runs all of the above at its collectives.

A writer process imports only :mod:`.writer` and :mod:`.staging` (neither mpi4py nor torch):
this package's ``__init__`` imports no more than that.
"""
from .rate_limit import MinSize, RateLimiter, SampleToInsertRatio
from .staging import process_alive
from .writer import EpisodeWriter, Writer

__all__ = ["MinSize", "RateLimiter", "SampleToInsertRatio", "process_alive", "EpisodeWriter", "Writer"]
