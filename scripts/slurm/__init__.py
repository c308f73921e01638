"""Slurm tools: local_slurm (a one-node cluster), slurm_smoke (the job of slurm/replay_sample.sbatch)."""
