"""One learner rank: a Megatron GPTModel slice (TP x PP x DP) that scores and trains on RL batches.

The trainer wraps it with `ray.remote(LearnerWorker)`; tests run it as a plain
object in torch.multiprocessing children. Every rank receives the same full
batch dict (CPU tensors); each DP rank takes its rows, the pipeline runs through
Megatron's get_forward_backward_func(), and results are gathered so that global
rank 0 returns the full [B, T] tensor.

Optimizer: with `learner.distributed_optimizer` the model is wrapped in Megatron's
DistributedDataParallel and stepped by Megatron's distributed Adam (Adam moments sharded
over the DP ranks; megatron_optim.py, CPU shims in patches/). Without it: torch AdamW over
the local shards, replicated on every DP rank, with our own gradient all-reduce (DP) and
global-norm clipping. Both give the same weights (tests/test_distributed_optimizer.py).

Precision (`learner.precision`): float32 (default) builds and trains the model in fp32. bfloat16 is
Megatron-LM's --bf16: the GPTModel is built with params_dtype bf16 and wrapped in Megatron's
Float16Module (bf16 inputs on the first stage, fp32 outputs on the last: logits, log-probs and losses
are fp32), which Megatron's DDP wraps (fp32 main_grad accumulation and reduction) and Megatron's
distributed optimizer steps (fp32 master weights and Adam moments, bf16=True); the critic and the
frozen reference are bf16 too. `self.model` stays the bare GPTModel (its bf16 parameters are what
resync and the HF export read); the forward goes through `self.f16`.

Roles: `policy` (LM head, trained), `critic` (value head, trained) and `reference`:
the policy's initial weights, frozen, for the KL term. A reference has the policy's
layout and LM head, scores with compute_logprobs (same temperature convention), and
has no optimizer, no gradients and no checkpoint: it is rebuilt from the HF dir.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
from functools import partial
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_specrl.learner import hf_mapping as hm
from megatron_specrl.learner.hf_checkpoint import HFCheckpoint, save_hf_shards
from megatron_specrl.learner import losses as L
from megatron_specrl.learner.logprobs import token_logprobs
from megatron_specrl.learner.model_provider import ROLES
from megatron_specrl.learner.parallel import cuda_to_cpu, destroy, init_distributed

log = logging.getLogger(__name__)

PER_TOKEN_KEYS = ("input_ids", "attention_mask", "loss_mask", "old_logprobs", "rollout_logprobs", "advantages",
                  "ref_logprobs", "returns", "old_values")


POLICY_METRICS = ("approx_kl", "entropy", "kl", "loss", "pg_clipfrac", "pg_clipfrac_dual", "pg_loss",
                  "ratio_mean", "tis_mean")
CRITIC_METRICS = ("loss", "value_mean", "vf_clipfrac", "vf_loss")


def load_hf_state(hf_dir: str | Path) -> HFCheckpoint:
    """The tensors of an HF directory's safetensors, each read when a rank asks for it (hf_checkpoint)."""
    return HFCheckpoint(hf_dir)


# The dtypes iter_hf_state's PP send can carry (indexed in its shape header): parameters', main_grad's.
_GATHER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _checkpoint_dtype(hf_config) -> torch.dtype | None:
    """The dtype a checkpoint's config.json names (transformers 5: `dtype`, earlier: `torch_dtype`)."""
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


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


def _model_param_name(name: str, params) -> str:
    """The model's name for a converted (local-spec) parameter name; unknown names stay as they are
    (the loader reports them as not in the model)."""
    try:
        return hm.local_param_name(name, params)
    except KeyError:
        return name


def release_cached_gpu_memory(cuda=torch.cuda) -> bool:
    """Hand the blocks torch's caching allocator keeps after a pass back to the driver (empty_cache);
    False without CUDA. Freed tensors stay reserved by this process otherwise, invisible to the other
    processes on its GPU: colocated, the critic's and the reference's ranks and the vLLM engine share
    it (actors.learner_bundles), and the engine's wake_up maps its weights and KV cache anew after the
    step (vLLM's CuMemAllocator), so a learner still holding its activations makes it fail out of
    memory where the plan's model, which counts them only while the learner runs, says it fits.
    `cuda`: the torch.cuda module (tests pass a fake)."""
    if not cuda.is_available():
        return False
    cuda.empty_cache()
    return True


def split_microbatches(rows: list[int], lengths: list[int], micro_batch_size: int,
                       max_tokens: int | None) -> list[list[int]]:
    """Fixed-size microbatches, or (dynamic batching) greedy packs with n * max_len <= max_tokens.

    A row longer than max_tokens is an error, as in verl (RunConfig refuses a budget below
    data.max_prompt_len + rollout.max_new_tokens, so this is a guard)."""
    if not max_tokens:
        return [rows[i:i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]
    out, cur, cur_max = [], [], 0
    for r, n in zip(rows, lengths):
        if n > max_tokens:
            raise ValueError(f"row {r} has {n} tokens (prompt + response), more than "
                             f"learner.max_tokens_per_microbatch={max_tokens}: raise the budget")
        new_max = max(cur_max, n)
        if cur and new_max * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, new_max = [], n
        cur.append(r)
        cur_max = new_max
    if cur:
        out.append(cur)
    return out


class LearnerWorker:
    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, settings,
                 seed: int = 1, role: str = "policy"):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.rank, self.world_size, self.settings, self.seed, self.role = rank, world_size, settings, seed, role
        self.frozen = role == "reference"
        tp, pp = settings.tp, settings.pp
        if world_size != tp * pp * settings.dp:
            raise ValueError(f"world_size={world_size} != tp*pp*dp = {tp}*{pp}*{settings.dp}")
        init_distributed(rank, world_size, master_addr, master_port, tp, pp, seed)
        from megatron.core import parallel_state as ps
        self.ps = ps
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.first_stage, self.last_stage = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        # collectives on the default group take tensors on self.device: it is NCCL on GPUs, which
        # refuses CPU tensors (gloo on this CPU takes either)
        coords = torch.tensor([self.pp_rank, self.dp_rank, self.tp_rank], dtype=torch.long, device=self.device)
        table = [torch.zeros(3, dtype=torch.long, device=self.device) for _ in range(world_size)]
        dist.all_gather(table, coords)
        self.rank_of = {tuple(t.tolist()): r for r, t in enumerate(table)}   # (pp, dp, tp) -> global rank
        self.model = None
        self.f16 = None           # Megatron's Float16Module around self.model (learner.precision=bfloat16)
        self.ddp = None           # Megatron DDP wrapper of self.model (learner.distributed_optimizer)
        self.optimizer = None
        self.train_steps = 0      # train_step calls so far (the lr warm-up's position; checkpointed)
        self.hf_config = None
        self.hf_dir = None

    # ------------------------------------------------------------------ model
    def _require_trainable(self, what: str) -> None:
        if self.frozen:
            raise RuntimeError(f"{what}: the reference model is frozen (the KL anchor at the initial weights); "
                               "it has no optimizer and is never trained or checkpointed")

    def build(self, hf_dir: str | Path) -> None:
        """Build this rank's model slice (random init) + optimizer (none for a frozen reference)
        from an HF config directory."""
        from transformers import AutoConfig
        from megatron_specrl.learner.model_provider import build_gpt_model

        s = self.settings
        self.hf_dir = Path(hf_dir)
        self.hf_config = AutoConfig.from_pretrained(str(hf_dir))
        torch.manual_seed(self.seed)
        if self.bf16:
            from megatron.core.transformer.module import Float16Module
            if not self.frozen and not s.distributed_optimizer:
                raise ValueError("learner.precision=bfloat16 needs learner.distributed_optimizer=true (fp32 master "
                                 "weights live in Megatron's optimizer)")
            self.model = build_gpt_model(self.hf_config, s.tp, s.pp, dtype=torch.bfloat16, role=self.role,
                                         recompute=s.recompute).to(self.device)
            self.f16 = Float16Module(self.model.config, self.model)   # where Megatron-LM wraps it
        else:
            self.model = build_gpt_model(self.hf_config, s.tp, s.pp, role=self.role,
                                         recompute=s.recompute).to(self.device)
        if self.frozen:
            self.model.requires_grad_(False)
            self.model.eval()
        else:
            self._build_optimizer()

    @property
    def bf16(self) -> bool:
        """learner.precision=bfloat16 (Megatron's bf16 mixed precision)."""
        return getattr(self.settings, "precision", "float32") == "bfloat16"

    def load_hf(self, hf_dir: str | Path) -> None:
        """Build this rank's model slice and load its shards from HF safetensors (bf16: rounded to the
        bf16 parameters, and the optimizer's fp32 master weights re-read from them)."""
        s = self.settings
        self.build(hf_dir)
        hf_state = load_hf_state(hf_dir)
        shards = hm.hf_to_megatron_shards(hf_state, self.hf_config, s.tp, s.pp, only=(self.tp_rank, self.pp_rank))
        self._load_local_shards(shards[(self.tp_rank, self.pp_rank)])
        del hf_state, shards
        self._reload_main_params()

    def _reload_main_params(self) -> None:
        """bf16: copy the model's parameters into the optimizer's fp32 master weights (Megatron's
        reload_model_params, as Megatron-LM after loading weights without optimizer state); the fp32
        path's master weights are the parameters themselves."""
        if self.bf16 and self.optimizer is not None:
            with self._cpu_shims():
                self.optimizer.reload_model_params()

    def _load_local_shards(self, local: dict[str, Tensor]) -> None:
        params = dict(self.model.named_parameters())
        # The converter names the local spec's parameters; the TransformerEngine spec (GPUs with TE
        # installed) fuses the pre-norms into the next linear (hf_mapping.TE_RENAMES): its names.
        local = {_model_param_name(k, params): v for k, v in local.items()}
        if self.role == "critic":
            local.pop("output_layer.weight", None)   # the value head is new, not in the HF checkpoint
        for name, p in params.items():
            if self.role == "critic" and name == "output_layer.weight":
                continue
            if name not in local:
                raise hm.CheckpointError(f"no weights for Megatron parameter {name!r} (tp={self.tp_rank}, pp={self.pp_rank})")
            t = local[name]
            if tuple(t.shape) != tuple(p.shape):
                raise hm.CheckpointError(f"tensor for {name!r} has shape {list(t.shape)}, model expects {list(p.shape)}")
            with torch.no_grad():
                p.copy_(t.to(p.dtype))
        extra = set(local) - set(params)
        if extra:
            raise hm.CheckpointError(f"converted tensors not in the model: {sorted(extra)}")

    def _build_optimizer(self) -> None:
        s = self.settings
        if s.distributed_optimizer:
            from megatron_specrl.learner import megatron_optim
            self.ddp, self.optimizer = megatron_optim.build(self.f16 if self.f16 is not None else self.model, s)
            return
        self.ddp = None
        lr = s.lr
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr,
                                           weight_decay=s.weight_decay, betas=(0.9, 0.999), eps=1e-8)

    # ------------------------------------------------------------------ batches
    def _dp_rows(self, rows: list[int]) -> list[int]:
        dp = self.settings.dp
        if len(rows) % dp:
            raise ValueError(f"{len(rows)} rows are not divisible by dp={dp}")
        n = len(rows) // dp
        return rows[self.dp_rank * n:(self.dp_rank + 1) * n]

    def _microbatches(self, batch: dict, rows: list[int]) -> list[dict]:
        am = batch["attention_mask"]
        lengths = [int(am[r].nonzero().max()) + 1 if am[r].any() else 1 for r in rows]
        groups = split_microbatches(rows, lengths, self.settings.micro_batch_size,
                                    self.settings.max_tokens_per_microbatch)
        out = []
        for g in groups:
            T = max(lengths[rows.index(r)] for r in g)
            idx = torch.tensor(g, dtype=torch.long)
            mb = {k: v[idx, :T].to(self.device) for k, v in batch.items()
                  if isinstance(v, Tensor) and v.dim() == 2 and k in PER_TOKEN_KEYS}
            mb["rows"] = idx
            mb["temperature"] = float(batch.get("temperature", 1.0))
            out.append(mb)
        return out

    def _forward(self, model, mb):
        ids = mb["input_ids"]
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device).unsqueeze(0).expand(B, -1)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=ids.device), diagonal=1)[None, None]
        return model(ids, pos, causal)

    def _heads(self, output: Tensor, mb: dict, with_entropy: bool, entropy_grad: bool = True):
        """Model output on the last stage -> (per-token values, entropy) aligned with input_ids."""
        if self.role == "critic":
            v = output[..., 0].float()
            return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], dim=1), None
        return token_logprobs(output, mb["input_ids"], self.hf_config.vocab_size, mb["temperature"], with_entropy,
                              entropy_grad)

    def _run_schedule(self, mbs: list[dict], loss_builder, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data_iterator, model):
            mb = next(data_iterator)
            return self._forward(model, mb), partial(loss_builder, mb)

        fb = get_forward_backward_func()
        with self._cpu_shims():
            return fb(forward_step_func=step, data_iterator=iter(mbs), model=[self.ddp or self.f16 or self.model],
                      num_microbatches=len(mbs), seq_length=max(m["input_ids"].shape[1] for m in mbs),
                      micro_batch_size=max(m["input_ids"].shape[0] for m in mbs), forward_only=forward_only)

    def _cpu_shims(self):
        """Scoped CUDA -> CPU rewrites around Megatron calls: the schedules', plus DDP's and the
        optimizer's with Megatron's optimizer (null contexts on GPUs)."""
        if self.ddp is not None:
            from megatron_specrl.learner.megatron_optim import on_cpu
            return on_cpu()
        return cuda_to_cpu()

    def _gather_rows(self, B: int, T: int, pieces: list[tuple[Tensor, Tensor]], to_all: bool) -> Tensor | None:
        """Assemble per-row results from (last stage, tp 0, every DP rank) into one [B, T] tensor."""
        full = torch.zeros(B, T, dtype=torch.float32, device=self.device)   # the default group's device
        if self.last_stage and self.tp_rank == 0:
            for rows, vals in pieces:
                full[rows, : vals.shape[1]] = vals.detach().float().to(self.device)
        if self.world_size > 1:
            if to_all:
                dist.all_reduce(full)
            else:
                dist.reduce(full, dst=0)
        return full.cpu() if (to_all or self.rank == 0) else None

    @torch.no_grad()
    def _score(self, batch: dict, to_all: bool) -> Tensor | None:
        B, T = batch["input_ids"].shape
        mbs = self._microbatches(batch, self._dp_rows(list(range(B))))
        self.model.eval()

        def loss_fn(mb, output):
            vals, _ = self._heads(output, mb, with_entropy=False)
            return vals.sum() * 0.0, {"rows": mb["rows"], "vals": vals * mb["attention_mask"].to(vals.dtype)}

        store = self._run_schedule(mbs, loss_fn, forward_only=True)
        if not self.frozen:
            self.model.train()
        return self._gather_rows(B, T, [(d["rows"], d["vals"]) for d in store], to_all)

    def compute_logprobs(self, batch: dict) -> Tensor | None:
        """Per-token log-probs [B, T] (0 at t=0 and on padding) on global rank 0; None elsewhere."""
        if self.role not in ("policy", "reference"):
            raise RuntimeError(f"compute_logprobs needs role='policy' or 'reference', not {self.role!r}")
        out = self._score(batch, to_all=False)
        release_cached_gpu_memory()    # the forward's blocks, for the processes sharing this GPU
        return out

    def compute_values(self, batch: dict) -> Tensor | None:
        """Critic values [B, T] aligned like compute_logprobs, on global rank 0; None elsewhere."""
        if self.role != "critic":
            raise RuntimeError("compute_values needs role='critic'")
        out = self._score(batch, to_all=False)
        release_cached_gpu_memory()
        return out

    # ------------------------------------------------------------------ training
    def train_step(self, batch: dict) -> dict[str, float]:
        """ppo_epochs x mini_batches optimizer steps on one rollout batch; returns averaged metrics.

        With recompute_old_logprobs the PPO ratio's old log-probs are this policy's, scored here
        once (the step's only extra forward pass), unless the caller scored them already
        (`old_logprobs_scored`: the KL in the reward needs them before the advantages);
        `rollout_learner_logprob_abs_diff` reports their mean |difference| from the rollout engine's
        on response tokens."""
        self._require_trainable("train_step")
        s = self.settings
        B = batch["input_ids"].shape[0]
        batch = dict(batch)
        extra: dict[str, float] = {}
        if self.role == "policy":
            if s.recompute_old_logprobs:
                if not batch.get("old_logprobs_scored"):
                    batch["old_logprobs"] = self._score(batch, to_all=True)
                if batch.get("rollout_logprobs") is not None:
                    m = batch["loss_mask"].to(torch.float32)
                    diff = (batch["old_logprobs"] - batch["rollout_logprobs"]).abs() * m
                    extra["rollout_learner_logprob_abs_diff"] = float(diff.sum() / m.sum().clamp(min=1.0))
            elif "old_logprobs" not in batch:
                batch["old_logprobs"] = batch["rollout_logprobs"]
        if B % s.mini_batches:
            raise ValueError(f"batch size {B} is not divisible by mini_batches={s.mini_batches}")
        per_mini = B // s.mini_batches
        lr = self._set_lr()
        history: list[dict[str, float]] = []
        for _epoch in range(s.ppo_epochs):
            for m in range(s.mini_batches):
                rows = list(range(m * per_mini, (m + 1) * per_mini))
                history.append(self._optimizer_step(batch, rows))
        self.train_steps += 1
        # the step's activations and temporaries: colocated, the engines wake into this memory next
        release_cached_gpu_memory()
        return {**{k: sum(h[k] for h in history) / len(history) for k in history[0]}, **extra, "lr": lr}

    def _set_lr(self) -> float:
        """This training step's lr (learner.lr_warmup_steps, verl's constant schedule with warm-up), set
        on every parameter group of either optimizer (Megatron's scheduler sets its groups so too)."""
        s = self.settings
        lr = s.lr * min(1.0, self.train_steps / s.lr_warmup_steps) if s.lr_warmup_steps else s.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _optimizer_step(self, batch: dict, rows: list[int], step: bool = True) -> dict[str, float]:
        lc = self.settings.loss
        mask_all = batch["loss_mask"][rows]
        denom = L.aggregation_denominator(mask_all, lc.agg_mode)
        n_tokens = max(float(mask_all.sum()), 1.0)
        mbs = self._microbatches(batch, self._dp_rows(rows))
        n_mb = len(mbs)

        def loss_fn(mb, output):
            # entropy_coef 0: the entropy is a metric only, computed without autograd (logprobs.py)
            vals, ent = self._heads(output, mb, with_entropy=True, entropy_grad=lc.entropy_coef != 0)
            if self.role == "critic":
                loss, met = L.value_loss(vals, mb["old_values"], mb["returns"], mb["loss_mask"], lc.value_clip,
                                         lc.agg_mode, denom, lc.loss_scale_factor)
                summed = {"vf_loss": loss.detach()}
            else:
                loss, met = L.rl_policy_objective(vals, ent, mb, lc, denom)
                summed = {k: met.pop(k) for k in ("pg_loss", "kl", "entropy") if k in met}
            w = float(mb["loss_mask"].sum()) / n_tokens
            reported = {k: v.detach().clone() for k, v in summed.items()}
            reported.update({k: v.detach() * w for k, v in met.items()})
            reported["loss"] = loss.detach().clone()
            # The schedule divides by the number of microbatches; undo it: `denom` is already global.
            # Megatron's DDP averages gradients over DP; ours sum them (global denominators).
            return loss * (n_mb * dp_scale), reported

        dp_scale = self.settings.dp if self.ddp is not None else 1
        if self.ddp is not None:
            return self._megatron_step(mbs, loss_fn, step)
        self.optimizer.zero_grad(set_to_none=False)
        store = self._run_schedule(mbs, loss_fn, forward_only=False)
        grad_norm = self._finalize_grads(clip=step)
        if step:
            if not math.isfinite(grad_norm):   # AdamW would turn every weight NaN; as Megatron's: skip, raise
                self.optimizer.zero_grad(set_to_none=False)
                raise RuntimeError(f"non-finite gradients (grad norm {grad_norm}): the optimizer step was "
                                   "skipped (a NaN / inf reward, advantage or log-prob in the batch?)")
            self.optimizer.step()
        return self._reduce_metrics(store, grad_norm)

    def _megatron_step(self, mbs: list[dict], loss_fn, step: bool) -> dict[str, float]:
        """Megatron DDP + optimizer: grads accumulate in DDP's buffer, finalize_model_grads reduces
        them over DP (reduce-scatter with the distributed optimizer; all-reduce without a step, so
        that every rank holds full gradients for iter_hf_state(grads=True)) and ties embeddings
        across PP; megatron_optim.step() computes the global norm once, checks it, clips by it, updates
        this rank's shard and all-gathers the parameters."""
        from megatron.core.distributed import finalize_model_grads
        for p in self._params():
            p.grad = None
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.ddp.force_all_reduce = not step      # overlapped reduce: all-reduce instead of reduce-scatter
        try:
            store = self._run_schedule(mbs, loss_fn, forward_only=False)
        finally:
            self.ddp.force_all_reduce = False
        with self._cpu_shims():
            finalize_model_grads([self.ddp], force_all_reduce=not step)
            if step:
                # Megatron's step() would step Adam on NaN gradients (fp32: no loss scaler to find them):
                # megatron_optim.step checks the global norm (the same on every rank: all raise) before
                # the update, and clips by that norm instead of computing it a second time.
                from megatron_specrl.learner import megatron_optim
                ok, grad_norm = megatron_optim.step(self.optimizer)
                if not math.isfinite(grad_norm):
                    raise RuntimeError(f"non-finite gradients (grad norm {grad_norm}): the optimizer step was "
                                       "skipped (a NaN / inf reward, advantage or log-prob in the batch?)")
                if not ok:
                    raise RuntimeError("Megatron's optimizer skipped the step (non-finite gradients)")
            else:
                for p in self._params():
                    if p.dtype == p.main_grad.dtype:    # bf16 params: iter_hf_state reads main_grad
                        p.grad = p.main_grad.detach().clone()
                self.optimizer.prepare_grads()
                grad_norm = self.optimizer.get_grad_norm()
        return self._reduce_metrics(store, float(grad_norm))

    def forward_backward(self, batch: dict) -> dict[str, float]:
        """Gradients of the RL loss on the whole batch (finalised over DP/PP, unclipped), no step.

        For tests and debugging: read them with iter_hf_state(grads=True).
        """
        self._require_trainable("forward_backward")
        batch = dict(batch)
        if self.role == "policy" and "old_logprobs" not in batch:
            batch["old_logprobs"] = batch["rollout_logprobs"]
        return self._optimizer_step(batch, list(range(batch["input_ids"].shape[0])), step=False)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _finalize_grads(self, clip: bool = True) -> float:
        """Tied-embedding grad sync (PP), DP all-reduce (sum: losses use global denominators), clip."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        ps = self.ps
        params = self._params()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if (self.settings.pp > 1 and getattr(self.model, "share_embeddings_and_output_weights", False)
                and ps.is_rank_in_embedding_group()):
            w = self.model.shared_embedding_or_output_weight()
            dist.all_reduce(w.grad, group=ps.get_embedding_group())
        if self.settings.dp > 1:
            grads = [p.grad for p in params]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=ps.get_data_parallel_group())
            for g, f in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(f)
        sq = torch.zeros(1, dtype=torch.float32, device=self.device)
        for p in params:
            if param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False):
                sq += p.grad.float().pow(2).sum()
        if self.world_size > 1:
            dist.all_reduce(sq, group=ps.get_model_parallel_group())
        norm = float(sq.sqrt())
        max_norm = self.settings.grad_clip
        if clip and max_norm and norm > max_norm and math.isfinite(norm):
            for p in params:
                p.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def _reduce_metrics(self, store: list[dict], grad_norm: float) -> dict[str, float]:
        # Only the last stage holds metrics; every rank must all-reduce the same fixed key list.
        keys = POLICY_METRICS if self.role == "policy" else CRITIC_METRICS
        vec = torch.zeros(len(keys), dtype=torch.float64, device=self.device)   # NCCL takes no CPU tensors
        if self.last_stage and self.tp_rank == 0:
            for d in store:
                for i, k in enumerate(keys):
                    if k in d:
                        vec[i] += float(d[k])
        if self.world_size > 1:
            dist.all_reduce(vec)
        out = {k: float(v) for k, v in zip(keys, vec)}
        out["grad_norm"] = grad_norm
        return out

    # ------------------------------------------------------------------ weights out
    def _param_order(self, mapping=None):
        """Global deterministic order: (pp stage, rule, local idx, global idx) for every parameter."""
        cfg, pp = self.hf_config, self.settings.pp
        mapping = hm.get_mapping(cfg, mapping)
        order = []
        for p in range(pp):
            for rule, local, g in hm.stage_rules(cfg, mapping, pp, p):
                if rule.megatron == "output_layer.weight" and (hm._tied(cfg) or self.role == "critic"):
                    continue
                order.append((p, rule.megatron.format(i=local), g))
        return order

    def iter_hf_state(self, miswire: dict[str, str] | None = None, grads: bool = False,
                      dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
        """Yield full HF (name, tensor) pairs on global rank 0; every rank must iterate in lockstep.

        The owning stage's DP-rank-0 TP group all-gathers a parameter, its TP rank 0 sends the
        shards to global rank 0, which merges them: one full tensor in flight at a time.
        `grads=True` yields gradients instead (tests). `miswire` (hf_mapping.MISWIRINGS) renames HF
        modules on the way out: the resync checker's injected wrong mapping. Tensors keep the dtype
        they live in (bf16 parameters of a bf16 learner are gathered and yielded in bf16, half the
        bytes of fp32); consumers cast where they need another. `dtype` (resync: the engine's) casts each
        floating shard where it lives, before the TP gather: the gather, the PP send, the copy to the
        host and the merge on rank 0 then move the engine's bytes (an fp32 learner resyncing a bf16
        engine: half), and the cast runs on the GPU instead of rank 0's single CPU thread. Casting is
        elementwise, so the merged tensors equal a cast after the merge bit for bit.
        """
        mapping = hm.miswired(hm.get_mapping(self.hf_config), miswire)
        ps = self.ps
        tp = self.settings.tp
        params = dict(self.model.named_parameters())
        for stage, name, g in self._param_order(mapping):
            src = self.rank_of[(stage, 0, 0)]
            shards = None
            if self.pp_rank == stage and self.dp_rank == 0:
                param = params[hm.local_param_name(name, params)]
                src_t = param if not grads else param.grad if param.grad is not None else param.main_grad
                local = src_t.detach()
                if dtype is not None and local.is_floating_point():
                    local = local.to(dtype)
                local = local.contiguous()
                if tp > 1:
                    gathered = [torch.empty_like(local) for _ in range(tp)]
                    dist.all_gather(gathered, local, group=ps.get_tensor_model_parallel_group())
                    shards = gathered
                else:
                    shards = [local]
            # sent to global rank 0 on self.device (the default group is NCCL on GPUs: no CPU tensors),
            # moved to the CPU only there, one full tensor at a time
            if src != 0:
                if self.rank == src:
                    full = torch.stack(shards)
                    shape = torch.tensor(list(full.shape) + [0] * (4 - full.dim())
                                         + [_GATHER_DTYPES.index(full.dtype)], dtype=torch.long, device=self.device)
                    dist.send(shape, dst=0)
                    dist.send(full, dst=0)
                elif self.rank == 0:
                    shape = torch.zeros(5, dtype=torch.long, device=self.device)
                    dist.recv(shape, src=src)
                    full = torch.empty([int(x) for x in shape[:4] if x > 0], dtype=_GATHER_DTYPES[int(shape[4])],
                                       device=self.device)
                    dist.recv(full, src=src)
                    shards = list(full.unbind(0))
            if self.rank == 0:
                shards = [t.cpu() for t in shards]
                for hf_name, t in hm.merge_tp_shards_to_hf(name, shards, self.hf_config, g, mapping):
                    yield hf_name, t
            shards = None

    def export_hf(self, out_dir: str | Path) -> None:
        """Write the HF checkpoint on rank 0 (+ config / tokenizer copied from the source HF dir): in the
        source config's dtype (bf16 for published models; the learner's fp32 master weights are not
        what users load), in transformers' 5 GB shards, streamed (hf_checkpoint.save_hf_shards: rank 0
        held the whole fp32 model, 280 GB for 70B)."""
        tensors = self.iter_hf_state()     # every rank iterates in lockstep; rank 0 gets the tensors
        if self.rank != 0:
            for _ in tensors:
                pass
        else:
            out = Path(out_dir)
            # a config naming no dtype: fp32, as the export wrote before the gather kept bf16 weights in bf16
            save_hf_shards(tensors, out, dtype=_checkpoint_dtype(self.hf_config) or torch.float32)
            for f in self.hf_dir.iterdir():
                if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json", ".bin")):
                    shutil.copy2(f, out / f.name)
        if self.world_size > 1:
            dist.barrier()

    # ------------------------------------------------------------------ checkpoints
    def _sharded_state_dict(self, optimizer: bool = True, rng: bool = True, is_loading: bool = False) -> dict:
        model_sd = self.model.sharded_state_dict(prefix="model.")
        sd: dict = {"model": model_sd}
        if not optimizer:
            return sd
        if self.ddp is not None:
            sd["optimizer"] = self._megatron_optimizer_sd(model_sd, is_loading)
            return self._with_rng(sd) if rng else sd
        named = dict(self.model.named_parameters())
        opt_state: dict = {}
        for name, p in named.items():
            sh = model_sd.get("model." + name)
            if sh is None or p not in self.optimizer.state or not self.optimizer.state[p]:
                continue
            st = self.optimizer.state[p]
            for k in ("exp_avg", "exp_avg_sq"):
                opt_state[f"{name}.{k}"] = dataclasses.replace(sh, key=f"optimizer.{k}.{sh.key}", data=st[k])
        steps = {float(st["step"]) for st in self.optimizer.state.values() if st}
        opt_state["step"] = max(steps) if steps else 0.0   # one AdamW step count for all params
        sd["optimizer"] = opt_state
        if not rng:
            return sd
        return self._with_rng(sd)

    def _megatron_optimizer_sd(self, model_sd: dict, is_loading: bool) -> dict:
        """Megatron's distributed optimizer state in its fully-reshardable format: per-parameter
        moments keyed by the model's sharded keys, so any TP / PP / DP layout can load them."""
        from megatron_specrl.learner.megatron_optim import SHARDING_TYPE
        with self._cpu_shims():
            return self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                     metadata={"distrib_optim_sharding_type": SHARDING_TYPE})

    def _with_rng(self, sd: dict) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedObject
        pp, tp = self.settings.pp, self.settings.tp
        state = {"cpu": torch.get_rng_state(), "tracker": self._tracker_states()}
        cuda_states = cuda_rng_states()
        if cuda_states is not None:                 # CUDA's default generators (outside the tracker)
            state["cuda"] = cuda_states
        sd["rng"] = ShardedObject("rng_state", state, (pp, tp), (self.pp_rank, self.tp_rank),
                                  replica_id=self.dp_rank)
        return sd

    def _tracker_states(self):
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        return {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}

    def _ensure_optimizer_state(self) -> None:
        """Materialise AdamW state (zeros) so that loading has tensors to fill."""
        if self.ddp is not None:
            from megatron_specrl.learner.megatron_optim import ensure_state
            return ensure_state(self.optimizer)
        for p in self._params():
            st = self.optimizer.state[p]
            if not st:
                st["step"] = torch.tensor(0.0)
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)

    def save_checkpoint(self, path: str | Path) -> None:
        """Megatron dist checkpoint (model + AdamW state + RNG), synchronous writer."""
        from megatron.core import dist_checkpointing

        from megatron_specrl.patches.megatron_core_0_16_1_sync_save import in_process_results_queue
        self._require_trainable("save_checkpoint")
        path = Path(path)
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        if self.world_size > 1:
            dist.barrier()
        self._ensure_optimizer_state()
        sd = self._sharded_state_dict()
        with self._cpu_shims(), in_process_results_queue():   # no Manager process for a synchronous save
            dist_checkpointing.save(sd, str(path), async_sharded_save=False)
        if self.rank == 0:
            (path / "specrl_learner.json").write_text(json.dumps(
                {"tp": self.settings.tp, "pp": self.settings.pp, "dp": self.settings.dp, "role": self.role,
                 "distributed_optimizer": self.ddp is not None, "train_steps": self.train_steps,
                 "precision": "bfloat16" if self.bf16 else "float32"}))
        if self.world_size > 1:
            dist.barrier()

    def load_checkpoint(self, path: str | Path, load_optimizer: bool = True) -> None:
        """Load a dist checkpoint saved at any TP/PP split (dist_checkpointing reshards the model
        and optimizer); per-rank RNG state is restored only when the layout is unchanged."""
        from megatron.core import dist_checkpointing
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        if self.model is None:
            raise RuntimeError("call load_hf (or build the model) before load_checkpoint")
        load_optimizer = load_optimizer and not self.frozen   # a reference may load weights, nothing else
        meta_file = Path(path) / "specrl_learner.json"
        if not meta_file.is_file():
            raise hm.CheckpointError(f"{path} is not a megatron-specrl learner checkpoint (no specrl_learner.json)")
        meta = json.loads(meta_file.read_text())
        same_layout = (meta["tp"], meta["pp"], meta["dp"]) == (self.settings.tp, self.settings.pp, self.settings.dp)
        saved_dist = bool(meta.get("distributed_optimizer", False))
        if load_optimizer and saved_dist != (self.ddp is not None):
            raise hm.CheckpointError(
                f"{path} holds {'Megatron distributed' if saved_dist else 'torch AdamW'} optimizer state; this "
                f"learner has learner.distributed_optimizer={self.ddp is not None}: set it to {saved_dist} to resume")
        saved_precision = meta.get("precision", "float32")
        here = "bfloat16" if self.bf16 else "float32"
        if saved_precision != here:
            raise hm.CheckpointError(f"{path} holds a learner.precision={saved_precision} model; this learner has "
                                     f"learner.precision={here}: set it to {saved_precision} to resume or convert")
        if load_optimizer:
            self._ensure_optimizer_state()
            self.train_steps = int(meta.get("train_steps", 0))   # the lr warm-up continues where it was
        sd = self._sharded_state_dict(optimizer=load_optimizer, rng=load_optimizer and same_layout, is_loading=True)
        with self._cpu_shims():
            loaded = dist_checkpointing.load(sd, str(path))
        model_sd = {k[len("model."):]: v for k, v in loaded["model"].items()}
        self.model.load_state_dict(model_sd, strict=False)
        if load_optimizer and self.ddp is not None:
            from megatron_specrl.learner import megatron_optim
            with self._cpu_shims():
                megatron_optim.load_state_dict(self.optimizer, loaded["optimizer"])
            loaded["optimizer"] = {}
        elif self.ddp is not None:
            self._reload_main_params()      # bf16 weights without optimizer state: fresh fp32 master weights
        named = dict(self.model.named_parameters())
        # (without load_optimizer, dist_checkpointing still returns the checkpoint's common, non-sharded
        # optimizer entries: ignore them)
        opt = dict(loaded.get("optimizer", {})) if load_optimizer else {}
        step = opt.pop("step", None)
        for key, val in opt.items():
            name, k = key.rsplit(".", 1)
            st = self.optimizer.state[named[name]]
            st[k] = val
            st["step"] = torch.tensor(float(step))
        if "rng" in loaded:
            torch.set_rng_state(loaded["rng"]["cpu"])
            get_cuda_rng_tracker().set_states(loaded["rng"]["tracker"])
            restore_cuda_rng_states(loaded["rng"].get("cuda"))   # absent in older checkpoints

    def shutdown(self) -> None:
        """Free the model and optimizer state, then leave the process groups. Every holder of the model
        is dropped: a bf16 learner's Float16Module kept it (and DDP's fp32 grad buffers and the fp32
        master weights, 4.7 GiB for a 0.5B model on an H200) alive after shutdown."""
        import gc
        self.model = self.f16 = self.ddp = self.optimizer = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        destroy()
