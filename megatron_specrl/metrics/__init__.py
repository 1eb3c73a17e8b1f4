"""A run's step metrics: the sinks they are written to (sinks) and the registry of every key with its unit and
meaning, from which docs/metrics.md is generated (keys)."""
