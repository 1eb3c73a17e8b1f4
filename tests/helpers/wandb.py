"""A metrics logger writing to an offline wandb run in a test's directory."""

from __future__ import annotations

from megatron_specrl.metrics.sinks import MetricsLogger


def _wandb_logger(out, resume_step, mode="online"):
    return MetricsLogger(out, {}, use_wandb=True, wandb_mode=mode, project="p", run_name=None,
                         resume_step=resume_step)


