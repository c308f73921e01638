"""Long-running checks: soak (memory stays flat), gpu_check (CUDA kernels on a real GPU)."""
