"""patches/sglang_0_5_23_seeded_sampling.py against a fake `sglang` (its two patched names): a request's seed
decides its tokens whatever its batch, unseeded requests keep one drawn seed, and the patch acts only on
SGLang 0.5.23's CPU path. The real engine's replay through it: tests/e2e/test_recipes.py (PPO on SGLang)."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from megatron_specrl.patches import sglang_0_5_23_seeded_sampling as patch
from megatron_specrl.patches import sglang_engine_patches


def req(seed=None, params=None):
    return SimpleNamespace(sampling_params=params or SimpleNamespace(sampling_seed=seed))


def test_requests_keep_their_seed_and_unseeded_ones_keep_one_drawn_seed():
    shared = SimpleNamespace(sampling_seed=None)          # SGLang may hand requests one params object
    a, b, c = req(7), req(params=shared), req(params=shared)
    draws = iter([101, 202, 303])
    assert patch.request_seeds([a, b, c], draw=lambda: next(draws)) == [7, 101, 202]
    assert patch.request_seeds([c, b], draw=lambda: 999) == [202, 101]   # the same seed in a later batch
    assert shared.sampling_seed is None


def test_a_rows_token_depends_on_its_seed_and_position_only():
    torch.manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(6, 50), dim=-1)
    logprobs[:, 0] = float("-inf")                        # a banned token (SGLang's custom logit processor)
    seeds, positions = torch.arange(6, dtype=torch.int64) * 1000 + 3, torch.tensor([5, 5, 9, 12, 0, 40])
    tokens = patch.multinomial_with_seed(logprobs, seeds, positions)
    assert tokens.shape == (6, 1) and (tokens != 0).all()
    order = torch.tensor([4, 2, 0])                       # other companions, in another order
    assert patch.multinomial_with_seed(logprobs[order].float(), seeds[order], positions[order]).equal(tokens[order])
    again = patch.multinomial_with_seed(logprobs, seeds, positions + 1)
    assert not again.equal(tokens)                        # the next position draws other noise


def test_seeded_draws_follow_the_distribution():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    n = 20000
    tokens = patch.multinomial_with_seed(p.log().expand(n, 4), torch.arange(n, dtype=torch.int64),
                                         torch.full((n,), 17))
    freq = torch.bincount(tokens.view(-1), minlength=4).double() / n
    assert (freq - p).abs().max() < 0.015                 # 4 standard errors of the largest cell


@pytest.fixture
def fake_sglang(monkeypatch):
    # the patch's state is per process: an in-process SGLang engine started earlier in this worker (its
    # plugin runs here too, under the variable _enter_sglang_cpu sets) left it applied to the real sglang
    patch.revert()

    class SamplingBatchInfo:
        def __init__(self, device="cpu"):
            self.sampling_seed, self.device = None, device

        def adjusted_from_schedule_batch(self, batch, vocab_size):   # upstream: a placeholder for overrides
            pass

    upstream = object()
    mods = {name: types.ModuleType(name) for name in (
        "sglang", "sglang.srt", "sglang.srt.sampling", "sglang.srt.sampling.sampling_batch_info",
        "sglang.srt.layers", "sglang.srt.layers.sampler")}
    mods["sglang"].__version__ = "0.5.23"
    mods["sglang.srt.sampling.sampling_batch_info"].SamplingBatchInfo = SamplingBatchInfo
    mods["sglang.srt.layers.sampler"].multinomial_with_seed = upstream
    mods["sglang.srt.layers"].sampler = mods["sglang.srt.layers.sampler"]
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setenv(patch.CPU_ENV, "1")
    yield SimpleNamespace(SamplingBatchInfo=SamplingBatchInfo, sampler=mods["sglang.srt.layers.sampler"],
                          upstream=upstream, module=mods["sglang"])
    patch.revert()


def test_the_patch_seeds_every_batch_on_sglangs_cpu_path_only(fake_sglang, monkeypatch):
    info_cls, sampler = fake_sglang.SamplingBatchInfo, fake_sglang.sampler
    monkeypatch.delenv(patch.CPU_ENV)
    assert not patch.apply() and sampler.multinomial_with_seed is fake_sglang.upstream   # a GPU: untouched
    monkeypatch.setenv(patch.CPU_ENV, "1")
    fake_sglang.module.__version__ = "0.5.22"
    assert not patch.apply()
    fake_sglang.module.__version__ = "0.5.23"
    monkeypatch.delenv(sglang_engine_patches.ENV, raising=False)
    sglang_engine_patches.plugin()
    assert not patch.is_applied()                          # only in processes our engine marked
    monkeypatch.setenv(sglang_engine_patches.ENV, "1")
    sglang_engine_patches.plugin()
    assert patch.is_applied() and sampler.multinomial_with_seed is patch.multinomial_with_seed

    info = info_cls()
    info.adjusted_from_schedule_batch(SimpleNamespace(reqs=[req(5), req(9)]), 50)
    assert info.sampling_seed.tolist() == [5, 9] and info.sampling_seed.dtype == torch.int64
    own = info_cls()
    own.sampling_seed = torch.tensor([1, 2])               # SGLang's deterministic mode built it: kept
    own.adjusted_from_schedule_batch(SimpleNamespace(reqs=[req(5), req(9)]), 50)
    assert own.sampling_seed.tolist() == [1, 2]
    patch.revert()
    assert sampler.multinomial_with_seed is fake_sglang.upstream
    info = info_cls()
    info.adjusted_from_schedule_batch(SimpleNamespace(reqs=[req(5)]), 50)
    assert info.sampling_seed is None
