"""DAPO's generation batch (`trainer.gen_prompts_per_step`, verl's `data.gen_batch_size`): a round rolls out
more prompts than a step trains on, so the group filter usually fills a step in one round."""

from pathlib import Path

import pytest

from megatron_specrl.config import ConfigError, load_config
from megatron_specrl.data.datasets import PromptLoader, PromptRecord
from megatron_specrl.plan import ModelShape, engine_memory

ROOT = Path(__file__).resolve().parent.parent
DAPO = ["algorithm.name=dapo", "algorithm.dynamic_sampling=true", "trainer.prompts_per_step=8"]


def test_unset_means_a_round_is_a_step():
    cfg = load_config(None, DAPO)
    assert cfg.trainer.gen_prompts_per_step == 8
    assert cfg.trainer.round_prompts_key() == "trainer.prompts_per_step=8"
    cfg = load_config(None, [*DAPO, "trainer.gen_prompts_per_step=24"])
    assert cfg.trainer.gen_prompts_per_step == 24
    assert cfg.trainer.round_prompts_key() == "trainer.gen_prompts_per_step=24"


@pytest.mark.parametrize("overrides, needle", [
    (["trainer.prompts_per_step=8", "trainer.gen_prompts_per_step=24"], "without algorithm.dynamic_sampling"),
    ([*DAPO, "trainer.gen_prompts_per_step=4"], "below trainer.prompts_per_step=8"),
])
def test_refused_where_no_filter_chooses_or_a_round_is_smaller_than_a_step(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_loader_draws_whole_rounds():
    """The run's loader is cut into rounds: each draw is a round's prompts, no prompt twice in an epoch."""
    records = [PromptRecord(id=f"p{i}", prompt=f"{i}+1=", answer=str(i + 1)) for i in range(50)]
    loader = PromptLoader(records, batch_size=load_config(None, [*DAPO, "trainer.gen_prompts_per_step=24"])
                          .trainer.gen_prompts_per_step, seed=1)
    first, second = loader.next_batch(), loader.next_batch()
    assert len(first) == len(second) == 24 and not {r.id for r in first} & {r.id for r in second}
    assert loader.epoch == 0 and len(loader.next_batch()) == 24 and loader.epoch == 1   # 2 left over: dropped


def test_the_plan_counts_a_rounds_sequences_in_the_engines_kv():
    shape = ModelShape("llama", hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=1000,
                       tied=False, qkv_bias=False, max_positions=4096)
    one = engine_memory(load_config(None, [*DAPO, "rollout.n_samples=4"]), shape, 80 << 30)
    three = engine_memory(load_config(None, [*DAPO, "rollout.n_samples=4", "trainer.gen_prompts_per_step=24"]),
                          shape, 80 << 30)
    assert (one.sequences_per_engine, three.sequences_per_engine) == (32, 96)
    assert three.kv_batch == 3 * one.kv_batch
