"""Workers of scripts.bench.compare_peers, one per system; each runs as
``python -m scripts.peers.<system>_worker`` under that system's own interpreter, from the
repository root. _common holds what they share (stdlib + numpy only).
"""
