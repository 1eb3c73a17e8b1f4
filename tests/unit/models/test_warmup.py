"""SFT warm-up: produces a loadable HF checkpoint, lowers the loss, and is cached.
"""

import pytest
import torch
from megatron_specrl.data import synthetic
from megatron_specrl.models import warmup
from megatron_specrl.models.warmup import read_warmup_info, warmup_key, warmup_sft

@pytest.fixture(scope="module")
def warmed(tiny_llama, tmp_path_factory):
    cache = tmp_path_factory.mktemp("warmup-cache")
    return cache, warmup_sft(tiny_llama, cache, steps=20, lr=3e-3, seed=0, batch_size=16)


def test_short_warmup_writes_a_loadable_checkpoint_and_lowers_loss(warmed, tiny_llama):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache, out = warmed
    assert out.parent == cache and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]      # no temp dir left behind
    info = read_warmup_info(out)
    assert len(info["losses"]) == 20
    assert sum(info["losses"][-5:]) / 5 < 0.6 * info["losses"][0]

    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    assert tok.eos_token_id == 1 and tok.pad_token_id == 0
    assert not torch.equal(model.lm_head.weight, base.lm_head.weight)      # trained ...
    # ... and the response loss is lower than the base model's on fresh problems
    p = synthetic.make_problems(1, seed=99)[0]
    prompt = tok(p.prompt, add_special_tokens=False).input_ids
    resp = tok(p.trace, add_special_tokens=False).input_ids + [tok.eos_token_id]
    ids = torch.tensor([prompt + resp])
    labels = torch.tensor([[-100] * len(prompt) + resp])
    with torch.no_grad():
        assert model(input_ids=ids, labels=labels).loss < base(input_ids=ids, labels=labels).loss


def test_second_call_hits_the_cache(warmed, tiny_llama, monkeypatch):
    cache, out = warmed
    monkeypatch.setattr(warmup, "_train", lambda *a, **k: pytest.fail("cache miss: trained again"))
    assert warmup_sft(tiny_llama, cache, steps=20, lr=3e-3, seed=0, batch_size=16) == out


def test_cache_key_covers_the_recipe(tiny_llama, tiny_qwen2):
    k = warmup_key(tiny_llama, 20, 3e-3, 0, 16)
    assert k == warmup_key(tiny_llama, 20, 3e-3, 0, 16)
    assert len({k, warmup_key(tiny_llama, 21, 3e-3, 0, 16), warmup_key(tiny_llama, 20, 1e-3, 0, 16),
                warmup_key(tiny_llama, 20, 3e-3, 1, 16), warmup_key(tiny_llama, 20, 3e-3, 0, 8),
                warmup_key(tiny_qwen2, 20, 3e-3, 0, 16), warmup_key(tiny_llama, 20, 3e-3, 0, 16, (8, 12))}) == 7
    assert warmup_key(tiny_llama, 20, 3e-3, 0, 16, (3, 6)) == k     # the default task: caches stay valid


def test_a_half_written_dir_is_not_trusted(tiny_llama, tmp_path, monkeypatch):
    final = tmp_path / f"warmup-{warmup_key(tiny_llama, 2, 3e-3, 0, 4)}"
    final.mkdir()
    (final / "config.json").write_text("{}")        # crashed before the marker was written
    out = warmup_sft(tiny_llama, tmp_path, steps=2, lr=3e-3, seed=0, batch_size=4)
    assert out == final and read_warmup_info(out)["steps"] == 2

    monkeypatch.setattr(warmup, "_train", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        warmup_sft(tiny_llama, tmp_path, steps=3, lr=3e-3, seed=0, batch_size=4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]    # the failed attempt left nothing


def test_synthetic_accuracy_reports_rates(warmed):
    from megatron_specrl.models.warmup import synthetic_accuracy

    _, out = warmed
    for temperature in (0.0, 1.0):
        stats = synthetic_accuracy(out, n=8, temperature=temperature, max_new_tokens=24, batch_size=4)
        assert set(stats) == {"format_rate", "accuracy"}
        assert 0.0 <= stats["accuracy"] <= stats["format_rate"] <= 1.0




def test_a_run_waiting_for_another_runs_build_says_so(tmp_path, caplog):
    """A run blocked on another run's warm-up (up to minutes) logs why it waits, naming the directory,
    and goes on once the other releases it."""
    import fcntl
    import logging
    import os
    import threading

    from megatron_specrl.models.cache import build_once

    cache = tmp_path / "cache"
    cache.mkdir()
    held = os.open(cache, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)                  # "another run" holds the directory
    threading.Timer(1.0, os.close, args=(held,)).start()

    def build(tmp):
        (tmp / "done").write_text("")
    with caplog.at_level(logging.WARNING, logger="megatron_specrl.models.cache"):
        out = build_once(cache / "tiny-llama-seed0", "done", build)
    assert (out / "done").is_file()
    assert [r.getMessage() for r in caplog.records] == [
        f"another run is building in {cache}: waiting for it (its result is reused if it is what this run needs)"]


def test_a_cache_on_a_filesystem_without_flock_still_builds(tmp_path, monkeypatch):
    """Lustre mounted without `flock` answers flock with ENOSYS: the cached model is built without the lock
    rather than failing every run that resolves a model there."""
    import errno
    import fcntl

    from megatron_specrl.models.cache import build_once

    def refuse(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(fcntl, "flock", refuse)

    def build(tmp):
        (tmp / "done").write_text("")
    out = build_once(tmp_path / "cache" / "tiny-llama-seed0", "done", build)
    assert (out / "done").is_file() and [p.name for p in out.parent.iterdir()] == ["tiny-llama-seed0"]
