"""Benchmarks: bench_shard, bench_replay, compare_peers (``python -m scripts.bench.<name>``)."""
