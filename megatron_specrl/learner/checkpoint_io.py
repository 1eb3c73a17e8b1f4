"""A learner rank's checkpoint I/O: Megatron dist checkpoints (model + optimizer state + RNG, saved at
one TP / PP / DP layout and loaded at any, dist_checkpointing resharding them) and the HF export.
Functions of a LearnerWorker `w` (learner/worker.py), which delegates its save / load / export here."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_specrl.learner import hf_mapping as hm
from megatron_specrl.learner.hf_checkpoint import save_hf_shards

if TYPE_CHECKING:
    from megatron_specrl.learner.worker import LearnerWorker

log = logging.getLogger(__name__)

META = "specrl_learner.json"   # the layout, role, optimizer and precision a checkpoint was saved with


# -- dist checkpoints -----------------------------------------------------------------------
def save(w: LearnerWorker, path: str | Path) -> None:
    """Megatron dist checkpoint (model + optimizer state + RNG), synchronous writer."""
    from megatron.core import dist_checkpointing

    from megatron_specrl.patches.megatron_core_0_16_1_sync_save import in_process_results_queue
    path = Path(path)
    if w.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    if w.world_size > 1:
        dist.barrier()
    w._ensure_optimizer_state()
    sd = sharded_state_dict(w)
    with w._cpu_shims(), in_process_results_queue():   # no Manager process for a synchronous save
        dist_checkpointing.save(sd, str(path), async_sharded_save=False)
    if w.rank == 0:
        (path / META).write_text(json.dumps(
            {"tp": w.settings.tp, "pp": w.settings.pp, "dp": w.settings.dp, "role": w.role,
             "distributed_optimizer": w.ddp is not None, "train_steps": w.train_steps,
             "precision": "bfloat16" if w.bf16 else "float32"}))
    if w.world_size > 1:
        dist.barrier()


def read_meta(w: LearnerWorker, path: str | Path, load_optimizer: bool) -> dict:
    """The checkpoint's META, refused where this learner cannot load it (its optimizer or precision)."""
    meta_file = Path(path) / META
    if not meta_file.is_file():
        raise hm.CheckpointError(f"{path} is not a megatron-specrl learner checkpoint (no {META})")
    meta = json.loads(meta_file.read_text())
    saved_dist = bool(meta.get("distributed_optimizer", False))
    if load_optimizer and saved_dist != (w.ddp is not None):
        raise hm.CheckpointError(
            f"{path} holds {'Megatron distributed' if saved_dist else 'torch AdamW'} optimizer state; this "
            f"learner has learner.distributed_optimizer={w.ddp is not None}: set it to {saved_dist} to resume")
    saved_precision = meta.get("precision", "float32")
    here = "bfloat16" if w.bf16 else "float32"
    if saved_precision != here:
        raise hm.CheckpointError(f"{path} holds a learner.precision={saved_precision} model; this learner has "
                                 f"learner.precision={here}: set it to {saved_precision} to resume or convert")
    return meta


def load(w: LearnerWorker, path: str | Path, load_optimizer: bool = True) -> None:
    """Load a dist checkpoint saved at any TP/PP split (dist_checkpointing reshards the model
    and optimizer); per-rank RNG state is restored only when the layout is unchanged."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    if w.model is None:
        raise RuntimeError("call load_hf (or build the model) before load_checkpoint")
    load_optimizer = load_optimizer and not w.frozen   # a reference may load weights, nothing else
    meta = read_meta(w, path, load_optimizer)
    same_layout = (meta["tp"], meta["pp"], meta["dp"]) == (w.settings.tp, w.settings.pp, w.settings.dp)
    if load_optimizer:
        w._ensure_optimizer_state()
        w.train_steps = int(meta.get("train_steps", 0))   # the lr warm-up continues where it was
    sd = sharded_state_dict(w, optimizer=load_optimizer, rng=load_optimizer and same_layout, is_loading=True)
    with w._cpu_shims():
        loaded = dist_checkpointing.load(sd, str(path))
    model_sd = {k[len("model."):]: v for k, v in loaded["model"].items()}
    w.model.load_state_dict(model_sd, strict=False)
    if load_optimizer and w.ddp is not None:
        from megatron_specrl.learner import megatron_optim
        with w._cpu_shims():
            megatron_optim.load_state_dict(w.optimizer, loaded["optimizer"])
        loaded["optimizer"] = {}
    elif w.ddp is not None:
        w._reload_main_params()      # bf16 weights without optimizer state: fresh fp32 master weights
    # (without load_optimizer, dist_checkpointing still returns the checkpoint's common, non-sharded
    # optimizer entries: ignore them)
    _load_adamw_state(w, dict(loaded.get("optimizer", {})) if load_optimizer else {})
    if "rng" in loaded:
        torch.set_rng_state(loaded["rng"]["cpu"])
        get_cuda_rng_tracker().set_states(loaded["rng"]["tracker"])
        restore_cuda_rng_states(loaded["rng"].get("cuda"))   # absent in older checkpoints


def _load_adamw_state(w: LearnerWorker, opt: dict) -> None:
    """The AdamW moments of sharded_state_dict's `optimizer` entry back into the torch optimizer."""
    named = dict(w.model.named_parameters())
    step = opt.pop("step", None)
    for key, val in opt.items():
        name, k = key.rsplit(".", 1)
        st = w.optimizer.state[named[name]]
        st[k] = val
        st["step"] = torch.tensor(float(step))


def sharded_state_dict(w: LearnerWorker, optimizer: bool = True, rng: bool = True, is_loading: bool = False) -> dict:
    model_sd = w.model.sharded_state_dict(prefix="model.")
    sd: dict = {"model": model_sd}
    if not optimizer:
        return sd
    if w.ddp is not None:
        sd["optimizer"] = megatron_optimizer_sd(w, model_sd, is_loading)
        return with_rng(w, sd) if rng else sd
    named = dict(w.model.named_parameters())
    opt_state: dict = {}
    for name, p in named.items():
        sh = model_sd.get("model." + name)
        if sh is None or p not in w.optimizer.state or not w.optimizer.state[p]:
            continue
        st = w.optimizer.state[p]
        for k in ("exp_avg", "exp_avg_sq"):
            opt_state[f"{name}.{k}"] = dataclasses.replace(sh, key=f"optimizer.{k}.{sh.key}", data=st[k])
    steps = {float(st["step"]) for st in w.optimizer.state.values() if st}
    opt_state["step"] = max(steps) if steps else 0.0   # one AdamW step count for all params
    sd["optimizer"] = opt_state
    if not rng:
        return sd
    return with_rng(w, sd)


def megatron_optimizer_sd(w: LearnerWorker, model_sd: dict, is_loading: bool) -> dict:
    """Megatron's distributed optimizer state in its fully-reshardable format: per-parameter
    moments keyed by the model's sharded keys, so any TP / PP / DP layout can load them."""
    from megatron_specrl.learner.megatron_optim import SHARDING_TYPE
    with w._cpu_shims():
        return w.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                              metadata={"distrib_optim_sharding_type": SHARDING_TYPE})


# -- RNG ------------------------------------------------------------------------------------
def with_rng(w: LearnerWorker, sd: dict) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    pp, tp = w.settings.pp, w.settings.tp
    state = {"cpu": torch.get_rng_state(), "tracker": tracker_states()}
    cuda_states = cuda_rng_states()
    if cuda_states is not None:                 # CUDA's default generators (outside the tracker)
        state["cuda"] = cuda_states
    sd["rng"] = ShardedObject("rng_state", state, (pp, tp), (w.pp_rank, w.tp_rank), replica_id=w.dp_rank)
    return sd


def tracker_states():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    return {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}


def cuda_rng_states(cuda=torch.cuda) -> list[Tensor] | None:
    """Every visible GPU's default generator state (the stream of torch.rand(device="cuda") and of any
    dropout outside Megatron's RNG tracker), for a learner checkpoint; None without CUDA. `cuda`: the
    torch.cuda module (tests pass a fake)."""
    if not cuda.is_available():
        return None
    return [st.clone() for st in cuda.get_rng_state_all()]


def restore_cuda_rng_states(saved: list[Tensor] | None, cuda=torch.cuda) -> int:
    """Restore cuda_rng_states() from a checkpoint; returns how many devices were restored.

    Nothing to restore (a checkpoint from before this key, or saved without CUDA) or no CUDA here: the
    generators stay as seeded, as before. A different number of visible GPUs (the same TP / PP / DP
    layout, else the caller restores no RNG at all): device i gets the state saved for device i, for
    the devices both have, with a warning; not an error, since the RNG streams are for reproducibility
    only and refusing would block an otherwise valid resume (the layout-changed case is not one either)."""
    if not saved or not cuda.is_available():
        return 0
    n_here = cuda.device_count()
    if len(saved) != n_here:
        log.warning("learner checkpoint: CUDA RNG states saved for %d GPU(s), %d visible now: restoring "
                    "the first %d", len(saved), n_here, min(len(saved), n_here))
    fit = list(saved)[:n_here]
    if len(fit) == n_here:
        cuda.set_rng_state_all(fit)
    else:
        for i, st in enumerate(fit):
            cuda.set_rng_state(st, i)
    return len(fit)


# -- HF export ------------------------------------------------------------------------------
def checkpoint_dtype(hf_config) -> torch.dtype | None:
    """The dtype a checkpoint's config.json names (transformers 5: `dtype`, earlier: `torch_dtype`)."""
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


def export_hf(w: LearnerWorker, out_dir: str | Path) -> None:
    """Write the HF checkpoint on rank 0 (+ config / tokenizer copied from the source HF dir): in the
    source config's dtype (bf16 for published models; the learner's fp32 master weights are not
    what users load), in transformers' 5 GB shards, streamed (hf_checkpoint.save_hf_shards: rank 0
    held the whole fp32 model, 280 GB for 70B)."""
    tensors = w.iter_hf_state()     # every rank iterates in lockstep; rank 0 gets the tensors
    if w.rank != 0:
        for _ in tensors:
            pass
    else:
        out = Path(out_dir)
        # a config naming no dtype: fp32, as the export wrote before the gather kept bf16 weights in bf16
        save_hf_shards(tensors, out, dtype=checkpoint_dtype(w.hf_config) or torch.float32)
        for f in w.hf_dir.iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json", ".bin")):
                shutil.copy2(f, out / f.name)
    if w.world_size > 1:
        dist.barrier()
