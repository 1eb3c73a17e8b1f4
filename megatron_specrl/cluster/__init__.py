"""Where a run's processes live: the Slurm job (launch) and its Ray cluster (ray_join), the GPU stack check
every node runs (gpu_stack), learner and engine placement on GPUs (placement), the Ray actors (actors) and
rendezvous ports (ports)."""
