"""Where a run's processes live: the Slurm job (launch) and its Ray cluster (ray_join), the GPU stack check
every node runs (gpu_stack), and the Ray actors of the learner and the engines (actors)."""
