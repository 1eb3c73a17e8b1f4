"""The plan's activation estimate for a bf16 learner on Megatron's local spec (CPU, or a GPU without
TransformerEngine) counts what that spec keeps in fp32: the RMSNorms' tensors and the unfused attention's
fp32 softmax beside its bf16 copy. Without that term the estimate was 39% below the bytes autograd saves
here and 13% below a 0.5B learner's training peak on an H200 (session 28)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from test_learner_layouts import loss_config

from megatron_specrl.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
B, T = 2, 256
BF16 = {"precision": "bfloat16", "distributed_optimizer": True, "recompute_old_logprobs": True}


def _saved_bytes(_rank, hf_dir, out):
    """Bytes autograd saves for one forward-backward of B x T tokens (weights excluded)."""
    from megatron_specrl.config import LearnerConfig
    from megatron_specrl.learner.worker import LearnerWorker
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 264, (B, T), generator=g)
    ones = torch.ones(B, T)
    batch = {"input_ids": ids, "attention_mask": ones.long(), "loss_mask": ones, "advantages": torch.randn(B, T),
             "rollout_logprobs": 0 * ones, "ref_logprobs": 0 * ones, "old_logprobs": 0 * ones}
    res = {}
    for tag, kw in (("float32", {}), ("bfloat16", BF16)):
        w = LearnerWorker(0, 1, "127.0.0.1", free_port(), LearnerConfig(micro_batch_size=B, loss=loss_config(), **kw))
        w.load_hf(hf_dir)
        weights = {p.untyped_storage().data_ptr() for p in w.model.parameters()}
        saved = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:
                saved[ptr] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            w.forward_backward(batch)
        res[tag] = sum(saved.values())
        w.shutdown()
    Path(out).write_text(json.dumps(res))


def test_bf16_local_spec_activations_match_the_saved_bytes(tiny_llama, tmp_path):
    import torch.multiprocessing as mp

    from megatron_specrl.config import load_config
    from megatron_specrl.learner.model_provider import padded_vocab_size
    from megatron_specrl.plan import ModelShape, learner_memory, load_hf_config
    out = tmp_path / "saved.json"
    mp.spawn(_saved_bytes, args=(str(tiny_llama), str(out)), nprocs=1, join=True)
    saved = json.loads(out.read_text())
    s = ModelShape.from_hf(load_hf_config(str(tiny_llama)))
    for tag, kw in (("float32", {}), ("bfloat16", BF16)):
        cfg = load_config(ROOT / "examples" / "tiny-cpu-grpo.yaml", [
            f"model.path={tiny_llama}", f"data.max_prompt_len={T // 4}", f"rollout.max_new_tokens={T - T // 4}",
            "trainer.prompts_per_step=1", f"rollout.n_samples={B}", f"learner.micro_batch_size={B}",
            f"rollout.max_model_len={T}"] + [f"learner.{k}={str(v).lower()}" for k, v in kw.items()])
        est = learner_memory(cfg, s, padded_vocab_size(s.vocab, 1), flash=False).activations
        assert abs(est / saved[tag] - 1) < 0.1, (tag, est, saved[tag])
