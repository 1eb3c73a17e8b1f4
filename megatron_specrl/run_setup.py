"""The former home of the run's build, resume, checkpointing, recovery and evaluation, now split by
concern under megatron_specrl/run/ (build, checkpointing, recovery, evaluation, state). The names stay
importable from here; the package imports them from their modules."""

from megatron_specrl.run.build import build_run, check_engine_installed, load_tokenizer  # noqa: F401
from megatron_specrl.run.checkpointing import (  # noqa: F401
    drafts_with_trees, find_resume, restore_draft_trees, save_draft_trees, save_run_checkpoint,
)
from megatron_specrl.run.evaluation import evaluate  # noqa: F401
from megatron_specrl.run.recovery import restart_engines, resync_with_recovery, with_engine_recovery  # noqa: F401
from megatron_specrl.run.state import Run  # noqa: F401
