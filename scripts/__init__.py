"""Tools around gear_mpi, run as modules from the repository root (no install, no sys.path edits).

    python -m scripts.bench.bench_shard --quick
    mpiexec -n 4 python -m mpi4py -m scripts.bench.bench_replay --quick

- ``scripts.bench``  -- benchmarks: bench_shard (one shard), bench_replay (the distributed
  replay), compare_peers (against Reverb, cpprb and TorchRL)
- ``scripts.peers``  -- the worker each compared system runs in its own environment
- ``scripts.plots``  -- plot_results: PNG figures from the benchmarks' JSON lines
- ``scripts.slurm``  -- local_slurm (a one-node Slurm cluster for CI), slurm_smoke (the job
  slurm/replay_sample.sbatch runs)
- ``scripts.hosts``  -- two_hosts (two hosts on this machine in namespaces), ns_ssh (hydra's ssh
  stand-in), two_host_slurm (a two-node Slurm cluster on them); docs/TWO_HOSTS.md
- ``scripts.checks`` -- soak (memory over a long run), gpu_check (every CUDA kernel on a GPU)
- ``scripts/dev_env.sh`` -- creates ./.venv on a fresh machine
"""
