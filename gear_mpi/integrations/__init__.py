"""Framework integrations: a gear_mpi replay behind the replay-buffer interfaces of RL frameworks.

Each module imports its framework, which is an extra, never a core dependency (``pip install
gear-mpi[torchrl]``); import the module itself, e.g. ``from gear_mpi.integrations import torchrl as gtrl``.
This package imports nothing.
"""
