"""One learner rank: a Megatron GPTModel slice (TP x PP x DP) that scores and trains on RL batches.

The trainer wraps it with `ray.remote(LearnerWorker)`; tests run it as a plain
object in torch.multiprocessing children. Every rank receives the same full
batch dict (CPU tensors); each DP rank takes its rows, the pipeline runs through
Megatron's get_forward_backward_func(), and results are gathered so that global
rank 0 returns the full [B, T] tensor.

Optimizer (learner/optimizer.py): with `learner.distributed_optimizer` the model is wrapped in
Megatron's DistributedDataParallel and stepped by Megatron's distributed Adam (Adam moments sharded
over the DP ranks; megatron_optim.py, CPU shims in patches/). Without it: torch AdamW over
the local shards, replicated on every DP rank, with our own gradient all-reduce (DP) and
global-norm clipping. Both give the same weights (tests/integration/learner/test_distributed_optimizer.py).
Checkpoints (Megatron dist checkpoints, the HF export): learner/checkpoint_io.py.

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

import logging
import math
from functools import partial
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_specrl.learner import checkpoint_io, optimizer
from megatron_specrl.learner import hf_mapping as hm
from megatron_specrl.learner.hf_checkpoint import HFCheckpoint
from megatron_specrl.learner import losses as L
from megatron_specrl.learner.logprobs import token_logprobs
from megatron_specrl.learner.model_provider import ROLES
from megatron_specrl.learner.parallel import destroy, init_distributed

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


def _model_param_name(name: str, params) -> str:
    """The model's name for a converted (local-spec) parameter name; unknown names stay as they are
    (the loader reports them as not in the model)."""
    try:
        return hm.local_param_name(name, params)
    except KeyError:
        return name


def _padded(t: Tensor, width: int) -> Tensor:
    """[B, T'] -> [B, width] with zero columns after T' (padding: masked out of every loss)."""
    return t if t.shape[1] >= width else torch.nn.functional.pad(t, (0, width - t.shape[1]))


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
        self.ep = settings.ep
        init_distributed(rank, world_size, master_addr, master_port, tp, pp, seed, ep=self.ep)
        from megatron.core import parallel_state as ps
        self.ps = ps
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        # an MoE model's experts: this rank's expert-parallel rank, its place among the ranks holding
        # the same experts (expert data parallel) and its expert-TP rank
        self.ep_rank, self.edp_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_data_parallel_rank()
        self.etp_rank = ps.get_expert_tensor_parallel_rank()
        self.first_stage, self.last_stage = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        # collectives on the default group take tensors on self.device: it is NCCL on GPUs, which
        # refuses CPU tensors (gloo on this CPU takes either)
        coords = torch.tensor([self.pp_rank, self.dp_rank, self.tp_rank, self.ep_rank, self.edp_rank, self.etp_rank],
                              dtype=torch.long, device=self.device)
        table = [torch.zeros(6, dtype=torch.long, device=self.device) for _ in range(world_size)]
        dist.all_gather(table, coords)
        self.rank_of = {tuple(t[:3].tolist()): r for r, t in enumerate(table)}   # (pp, dp, tp) -> global rank
        # (pp, ep, edp, etp) -> global rank: where an expert's shards live
        self.expert_rank_of = {tuple(t[:1].tolist() + t[3:].tolist()): r for r, t in enumerate(table)}
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
                                         recompute=s.recompute, **self._moe_args()).to(self.device)
            self.f16 = Float16Module(self.model.config, self.model)   # where Megatron-LM wraps it
        else:
            self.model = build_gpt_model(self.hf_config, s.tp, s.pp, role=self.role,
                                         recompute=s.recompute, **self._moe_args()).to(self.device)
        if self.frozen:
            self.model.requires_grad_(False)
            self.model.eval()
        else:
            self._build_optimizer()

    def _moe_args(self) -> dict:
        """The expert-parallel size, and the load-balancing loss's scale: the AdamW path sums
        gradients over DP ranks (global-denominator losses), Megatron's DDP averages them."""
        dp = self.settings.dp
        return dict(ep=self.ep, aux_loss_scale=1.0 if self.settings.distributed_optimizer else 1.0 / dp)

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
        shards = hm.hf_to_megatron_shards(hf_state, self.hf_config, s.tp, s.pp, only=(self.tp_rank, self.pp_rank),
                                          ep=self.ep, ep_rank=self.ep_rank)
        local = shards[(self.tp_rank, self.pp_rank)]
        if self.etp_rank != self.tp_rank:   # an expert's TP slice follows the expert-TP rank
            by_etp = hm.hf_to_megatron_shards(hf_state, self.hf_config, s.tp, s.pp, only=(self.etp_rank, self.pp_rank),
                                              ep=self.ep, ep_rank=self.ep_rank)[(self.etp_rank, self.pp_rank)]
            local.update({k: v for k, v in by_etp.items() if hm.expert_index(k) is not None})
        self._load_local_shards(local)
        del hf_state, shards, local
        optimizer.reload_main_params(self.ddp, self.optimizer, self.bf16)   # bf16: fresh fp32 master weights

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
        self.ddp, self.optimizer = optimizer.build(self.model, self.f16, self.settings)

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
        sp = self.settings.tp if self.model is not None and self.model.config.sequence_parallel else 1
        for g in groups:
            T = max(lengths[rows.index(r)] for r in g)
            T = -(-T // sp) * sp    # sequence parallelism splits the sequence over the TP ranks
            idx = torch.tensor(g, dtype=torch.long)
            mb = {k: _padded(v[idx, :T], T).to(self.device) for k, v in batch.items()
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
        if not self.model.config.num_moe_experts:
            return model(ids, pos, causal)
        return model(ids, pos, causal, padding_mask=self._padding_mask(mb))

    def _padding_mask(self, mb) -> Tensor:
        """[B, T] True at padding, for MoE routers: padded positions (a microbatch's shorter rows, the
        sequence-parallel round-up) then count in no load-balancing loss, as HF's attention mask keeps
        them out of its. GPTModel splits the mask over the sequence-parallel ranks on the first pipeline
        stage only; later stages get their part here."""
        pad = ~mb["attention_mask"].bool()
        if self.model.config.sequence_parallel and not self.first_stage:
            tp, r = self.settings.tp, self.tp_rank
            pad = pad[:, r * pad.shape[1] // tp:(r + 1) * pad.shape[1] // tp]
        return pad.contiguous()

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
        """Scoped CUDA -> CPU rewrites around Megatron calls (optimizer.cpu_shims; null contexts on GPUs)."""
        return optimizer.cpu_shims(self.ddp)

    def _gather_rows(self, B: int, T: int, pieces: list[tuple[Tensor, Tensor]], to_all: bool) -> Tensor | None:
        """Assemble per-row results from (last stage, tp 0, every DP rank) into one [B, T] tensor."""
        full = torch.zeros(B, T, dtype=torch.float32, device=self.device)   # the default group's device
        if self.last_stage and self.tp_rank == 0:
            for rows, vals in pieces:
                vals = vals[:, :T]    # a sequence-parallel microbatch may be padded past the batch
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
                    delta = batch["old_logprobs"] - batch["rollout_logprobs"]
                    n = m.sum().clamp(min=1.0)
                    extra["rollout_learner_logprob_abs_diff"] = float((delta.abs() * m).sum() / n)
                    # the spread of the learner / engine probability ratio over response tokens: where an
                    # MoE router picks other experts in the engine than in the learner, it widens
                    ratio = torch.exp(delta.clamp(max=20.0)) * m
                    mean = ratio.sum() / n
                    extra["rollout_learner_ratio_std"] = math.sqrt(float((((ratio - mean) ** 2) * m).sum() / n))
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
        return optimizer.set_lr(self.optimizer, self.settings, self.train_steps)

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

        def schedule():
            return self._run_schedule(mbs, loss_fn, forward_only=False)

        if self.ddp is not None:   # the two optimizer paths (learner/optimizer.py)
            store, grad_norm = optimizer.megatron_step(self.ddp, self.optimizer, self._params(), schedule,
                                                       self._cpu_shims, step)
        else:
            store, grad_norm = optimizer.adamw_step(self.optimizer, schedule, self._finalize_grads, step)
        out = self._reduce_metrics(store, grad_norm)
        if self.model.config.num_moe_experts:
            out["moe_load_balancing_loss"] = self._load_balancing_loss(n_mb)
        return out

    def _load_balancing_loss(self, n_microbatches: int) -> float:
        """The MoE routers' load-balancing loss (before router_aux_loss_coef) of this optimizer step, the
        mean over layers, microbatches and data-parallel replicas, from Megatron's MoE loss tracker (which
        the step's forward passes filled; cleared here)."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker
        entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        local = torch.zeros(1, dtype=torch.float64, device=self.device)
        if entry is not None:
            local += entry["values"].double().sum() / max(n_microbatches, 1)
        clear_aux_losses_tracker()
        if self.world_size > 1:
            dist.all_reduce(local)
        # each layer lives on one stage, in dp copies, and in tp copies too unless sequence parallelism
        # splits the tokens over the TP ranks (each then holds its part of the loss)
        copies = self.settings.dp * (1 if self.model.config.sequence_parallel else self.settings.tp)
        return float(local) / (copies * self.hf_config.num_hidden_layers)

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
        return optimizer.trainable(self.model)

    def _finalize_grads(self, clip: bool = True) -> float:
        """The AdamW path's gradient sync and clip (optimizer.finalize_grads)."""
        return optimizer.finalize_grads(self._params(), self.model, self.settings, self.ps, self.device,
                                        self.world_size, clip)

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
            owner = hm.expert_owner(name, self.hf_config, self.ep)
            if owner is None:   # dense: the stage's DP-rank-0 TP group holds it
                src = self.rank_of[(stage, 0, 0)]
                holds = self.pp_rank == stage and self.dp_rank == 0
                tp_group, local_name = ps.get_tensor_model_parallel_group, name
            else:               # an expert: its EP rank's first expert-data-parallel copy
                src = self.expert_rank_of[(stage, owner, 0, 0)]
                holds = self.pp_rank == stage and self.ep_rank == owner and self.edp_rank == 0
                tp_group, local_name = ps.get_expert_tensor_parallel_group, hm.ep_local_name(name, self.hf_config,
                                                                                              self.ep)
            shards = None
            if holds:
                param = params[hm.local_param_name(local_name, params)]
                src_t = param if not grads else param.grad if param.grad is not None else param.main_grad
                local = src_t.detach()
                if dtype is not None and local.is_floating_point():
                    local = local.to(dtype)
                local = local.contiguous()
                if tp > 1:
                    gathered = [torch.empty_like(local) for _ in range(tp)]
                    dist.all_gather(gathered, local, group=tp_group())
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
        """The HF checkpoint, written on rank 0 (checkpoint_io.export_hf)."""
        checkpoint_io.export_hf(self.checkpoint_state(), self.iter_hf_state(), out_dir)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> checkpoint_io.LearnerState:
        """This rank as checkpoint I/O sees it, built from the attributes each call (their only owner)."""
        s = self.settings
        return checkpoint_io.LearnerState(
            rank=self.rank, world_size=self.world_size, tp=s.tp, pp=s.pp, dp=s.dp, tp_rank=self.tp_rank,
            pp_rank=self.pp_rank, dp_rank=self.dp_rank, role=self.role, bf16=self.bf16, model=self.model,
            ddp=self.ddp, optimizer=self.optimizer, train_steps=self.train_steps, hf_config=self.hf_config,
            hf_dir=self.hf_dir)

    def save_checkpoint(self, path: str | Path) -> None:
        """Megatron dist checkpoint (model + optimizer state + RNG; checkpoint_io.save)."""
        self._require_trainable("save_checkpoint")
        checkpoint_io.save(self.checkpoint_state(), path)

    def load_checkpoint(self, path: str | Path, load_optimizer: bool = True) -> None:
        """A dist checkpoint saved at any TP/PP split (checkpoint_io.load); with the optimizer state,
        the step count continues from the checkpoint's."""
        train_steps = checkpoint_io.load(self.checkpoint_state(), path, load_optimizer)
        if train_steps is not None:
            self.train_steps = train_steps

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
