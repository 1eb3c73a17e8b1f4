"""A learner rank's checkpoint I/O: Megatron dist checkpoints (model + optimizer state + RNG, saved at
one TP / PP / DP layout and loaded at any, dist_checkpointing resharding them) and the HF export.
Functions of a LearnerState: the rank as its checkpoints see it, which the LearnerWorker
(learner/worker.py) hands over for each save / load / export; they read nothing else of the worker."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_specrl.learner import hf_mapping as hm
from megatron_specrl.learner import optimizer as optim
from megatron_specrl.learner.hf_checkpoint import save_hf_shards

log = logging.getLogger(__name__)

META = "specrl_learner.json"   # the layout, role, optimizer and precision a checkpoint was saved with


@dataclass(frozen=True)
class LearnerState:
    """A learner rank as its checkpoints see it: its place in the TP x PP x DP layout, its role and
    precision, its model slice and optimizer, its step count and the HF directory it was built from.

    LearnerWorker.checkpoint_state() builds one for each call from its own attributes, so the two
    cannot drift: the model and optimizer are the worker's objects (a load fills them in place), the
    step count a copy (`load` returns the checkpoint's, for the worker to keep)."""
    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    role: str
    bf16: bool                  # learner.precision=bfloat16
    model: Any = None           # the bare GPTModel slice
    ddp: Any = None             # Megatron's DDP wrapper (learner.distributed_optimizer), else None
    optimizer: Any = None       # Megatron's distributed optimizer, torch AdamW, or None (a reference)
    train_steps: int = 0
    hf_config: Any = None
    hf_dir: Path | None = None

    @property
    def frozen(self) -> bool:
        """A reference: it loads weights, nothing else, and is never saved."""
        return self.role == "reference"

    def cpu_shims(self):
        return optim.cpu_shims(self.ddp)

    def ensure_optimizer_state(self) -> None:
        optim.ensure_state(self.ddp, self.optimizer, optim.trainable(self.model))


# -- dist checkpoints -----------------------------------------------------------------------
def save(w: LearnerState, path: str | Path) -> None:
    """Megatron dist checkpoint (model + optimizer state + RNG), synchronous writer."""
    from megatron.core import dist_checkpointing

    from megatron_specrl.patches.megatron_core_0_16_1_sync_save import in_process_results_queue
    path = Path(path)
    if w.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    if w.world_size > 1:
        dist.barrier()
    w.ensure_optimizer_state()
    sd = sharded_state_dict(w)
    with w.cpu_shims(), in_process_results_queue():   # no Manager process for a synchronous save
        dist_checkpointing.save(sd, str(path), async_sharded_save=False)
    if w.rank == 0:
        (path / META).write_text(json.dumps(
            {"tp": w.tp, "pp": w.pp, "dp": w.dp, "role": w.role,
             "distributed_optimizer": w.ddp is not None, "train_steps": w.train_steps,
             "precision": "bfloat16" if w.bf16 else "float32"}))
    if w.world_size > 1:
        dist.barrier()


def read_meta(w: LearnerState, path: str | Path, load_optimizer: bool) -> dict:
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


def load(w: LearnerState, path: str | Path, load_optimizer: bool = True) -> int | None:
    """Load a dist checkpoint saved at any TP/PP split (dist_checkpointing reshards the model
    and optimizer); per-rank RNG state is restored only when the layout is unchanged. Returns the
    checkpoint's step count with the optimizer state (the lr warm-up continues where it was), else None."""
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    if w.model is None:
        raise RuntimeError("call load_hf (or build the model) before load_checkpoint")
    load_optimizer = load_optimizer and not w.frozen   # a reference may load weights, nothing else
    meta = read_meta(w, path, load_optimizer)
    same_layout = (meta["tp"], meta["pp"], meta["dp"]) == (w.tp, w.pp, w.dp)
    train_steps = None
    if load_optimizer:
        w.ensure_optimizer_state()
        train_steps = int(meta.get("train_steps", 0))
    sd = sharded_state_dict(w, optimizer=load_optimizer, rng=load_optimizer and same_layout, is_loading=True)
    with w.cpu_shims():
        loaded = dist_checkpointing.load(sd, str(path))
    model_sd = {k[len("model."):]: v for k, v in loaded["model"].items()}
    w.model.load_state_dict(model_sd, strict=False)
    if load_optimizer and w.ddp is not None:
        from megatron_specrl.learner import megatron_optim
        with w.cpu_shims():
            megatron_optim.load_state_dict(w.optimizer, loaded["optimizer"])
        loaded["optimizer"] = {}
    elif w.ddp is not None:          # bf16 weights without optimizer state: fresh fp32 master weights
        optim.reload_main_params(w.ddp, w.optimizer, w.bf16)
    # (without load_optimizer, dist_checkpointing still returns the checkpoint's common, non-sharded
    # optimizer entries: ignore them)
    _load_adamw_state(w, dict(loaded.get("optimizer", {})) if load_optimizer else {})
    if "rng" in loaded:
        torch.set_rng_state(loaded["rng"]["cpu"])
        get_cuda_rng_tracker().set_states(loaded["rng"]["tracker"])
        restore_cuda_rng_states(loaded["rng"].get("cuda"))   # absent in older checkpoints
    return train_steps


def _load_adamw_state(w: LearnerState, opt: dict) -> None:
    """The AdamW moments of sharded_state_dict's `optimizer` entry back into the torch optimizer."""
    named = dict(w.model.named_parameters())
    step = opt.pop("step", None)
    for key, val in opt.items():
        name, k = key.rsplit(".", 1)
        st = w.optimizer.state[named[name]]
        st[k] = val
        st["step"] = torch.tensor(float(step))


def sharded_state_dict(w: LearnerState, optimizer: bool = True, rng: bool = True, is_loading: bool = False) -> dict:
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


def megatron_optimizer_sd(w: LearnerState, model_sd: dict, is_loading: bool) -> dict:
    """Megatron's distributed optimizer state in its fully-reshardable format: per-parameter
    moments keyed by the model's sharded keys, so any TP / PP / DP layout can load them."""
    from megatron_specrl.learner.megatron_optim import SHARDING_TYPE
    with w.cpu_shims():
        return w.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                              metadata={"distrib_optim_sharding_type": SHARDING_TYPE})


# -- RNG ------------------------------------------------------------------------------------
def with_rng(w: LearnerState, sd: dict) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    pp, tp = w.pp, w.tp
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


def export_hf(w: LearnerState, tensors: Iterator[tuple[str, Tensor]], out_dir: str | Path) -> None:
    """Write the HF checkpoint on rank 0 (+ config / tokenizer copied from the source HF dir): in the
    source config's dtype (bf16 for published models; the learner's fp32 master weights are not
    what users load), in transformers' 5 GB shards, streamed (hf_checkpoint.save_hf_shards: rank 0
    held the whole fp32 model, 280 GB for 70B). `tensors`: the worker's iter_hf_state(), which every
    rank iterates in lockstep; rank 0 gets the tensors."""
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
