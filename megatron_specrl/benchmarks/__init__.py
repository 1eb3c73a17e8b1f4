"""The benchmark commands: bench-rollout (rollout modes side by side: rollout), bench-train (the whole step,
synchronous and asynchronous: train) and bench-resync (the weight resync transports: resync). The research
scripts in the repository's benchmarks/ folder are not part of the package."""
