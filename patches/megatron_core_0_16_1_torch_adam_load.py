"""Loading a distributed-optimizer checkpoint into torch's Adam (megatron-core 0.16.1), on any device.

Without TransformerEngine or apex, Megatron's distributed optimizer steps torch's Adam, which keeps a
per-parameter "step" in its state. Loading a 'fully_reshardable' (or 'fully_sharded_model_space')
checkpoint, `DistributedOptimizer._set_main_param_and_optimizer_states` copies every key of the
parameter's state from the checkpoint's tensors, but the loader leaves "step" out of those tensors
("Handle torch Adam step separately": `load_state_dict` already set it from the param groups), so
the copy raises KeyError('step'). `torch_adam_step_held_out()` holds "step" out of the destination
during that copy and puts it back after.

Found on an H200 (2026-11-28: megatron-core 0.16.1 on torch 2.11 CUDA, no TE / apex): the fix lived
in the CPU shims until then, so a GPU learner without TE could save but not resume. With TE or apex
(FusedAdam keeps the step in the param groups) the wrapper passes every call through unchanged.
Another megatron-core version: a null context.
"""

from __future__ import annotations

import contextlib

VERSION = "0.16.1"


def _skip_torch_adam_step(orig):
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" in tensors or self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return orig(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            return orig(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step
    _set_main_param_and_optimizer_states.__wrapped__ = orig
    return _set_main_param_and_optimizer_states


@contextlib.contextmanager
def torch_adam_step_held_out():
    """Scoped (restored on exit): the distributed optimizer's state copy skips torch Adam's "step"."""
    from megatron_specrl.patches import megatron_version
    if megatron_version() != VERSION:
        yield
        return
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    saved = DistributedOptimizer._set_main_param_and_optimizer_states
    DistributedOptimizer._set_main_param_and_optimizer_states = _skip_torch_adam_step(saved)
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = saved
