"""HF safetensors <-> Megatron dist checkpoint at any TP/PP (and, for MoE models, EP) split.

Both directions run the real learner ranks (tp*pp*ep gloo processes on CPU; EP ranks are data-parallel
ranks holding different experts) so the
checkpoint is exactly what training writes and reads:

  hf-to-mcore: load HF weights into each rank's slice, save a dist checkpoint
               (model + fresh optimizer state) and keep the HF config/tokenizer in <out>/hf/.
  mcore-to-hf: build the model at --tp/--pp (default 1x1; dist checkpointing reshards),
               load the checkpoint's model weights and export HF safetensors.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from megatron_specrl.learner.ports import free_port


def _rank_main(rank: int, world: int, port: int, direction: str, src: str, out: str, tp: int, pp: int,
               ep: int = 1) -> None:
    from megatron_specrl.config import LearnerConfig
    from megatron_specrl.learner.worker import LearnerWorker

    settings = LearnerConfig(tp=tp, pp=pp, dp=ep, ep=ep)
    if direction == "mcore-to-hf" and _saved_precision(src) == "bfloat16":
        # a learner.precision=bfloat16 checkpoint loads into a bf16 model (its weights export as they trained)
        settings = LearnerConfig(tp=tp, pp=pp, dp=ep, ep=ep, precision="bfloat16", distributed_optimizer=True)
    w = LearnerWorker(rank, world, "127.0.0.1", port, settings)
    try:
        if direction == "hf-to-mcore":
            w.load_hf(src)
            w.save_checkpoint(out)
        else:
            w.build(Path(src) / "hf")
            w.load_checkpoint(src, load_optimizer=False)
            w.export_hf(out)
    finally:
        w.shutdown()


def _saved_precision(ckpt: str | Path) -> str:
    """learner.precision of a learner checkpoint (older ones: float32)."""
    import json
    meta = Path(ckpt) / "specrl_learner.json"
    return json.loads(meta.read_text()).get("precision", "float32") if meta.is_file() else "float32"


def copy_hf_metadata(hf_dir: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json", ".bin")):
            shutil.copy2(f, dst / f.name)


def check_hf_dir(hf_dir: Path) -> None:
    """One-line errors for an HF directory the learner cannot load, before any rank is spawned."""
    from transformers import AutoConfig

    from megatron_specrl.learner.model_provider import check_hf_config
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir} has no config.json")
    if not any(hf_dir.glob("*.safetensors")):
        raise FileNotFoundError(f"{hf_dir} has no *.safetensors weights (PyTorch .bin checkpoints are not read)")
    check_hf_config(AutoConfig.from_pretrained(str(hf_dir), local_files_only=True))


def hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, tp: int = 1, pp: int = 1, ep: int = 1) -> Path:
    import torch.multiprocessing as mp
    from megatron_specrl.plan import check_convert_layout
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    check_hf_dir(hf_dir)
    check_convert_layout(hf_dir, tp, pp, ep)   # before the ranks spawn (as the CLI's `convert` checks it)
    out_dir.mkdir(parents=True, exist_ok=True)
    world = tp * pp * ep
    mp.spawn(_rank_main, args=(world, free_port("127.0.0.1"), "hf-to-mcore", str(hf_dir), str(out_dir), tp, pp, ep),
             nprocs=world, join=True)
    copy_hf_metadata(hf_dir, out_dir / "hf")
    return out_dir


def mcore_to_hf(ckpt_dir: str | Path, out_dir: str | Path, tp: int = 1, pp: int = 1, ep: int = 1) -> Path:
    import torch.multiprocessing as mp
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "hf" / "config.json").is_file():
        raise FileNotFoundError(f"{ckpt_dir} has no hf/config.json: pass a directory written by `convert "
                                f"hf-to-mcore` or a training checkpoint's learner/ (checkpoints/step_*/learner)")
    from megatron_specrl.plan import check_convert_layout
    check_convert_layout(ckpt_dir / "hf", tp, pp, ep)
    world = tp * pp * ep
    mp.spawn(_rank_main, args=(world, free_port("127.0.0.1"), "mcore-to-hf", str(ckpt_dir), str(out_dir), tp, pp, ep),
             nprocs=world, join=True)
    return Path(out_dir)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-specrl convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF safetensors dir -> Megatron dist checkpoint")
    a.add_argument("--hf", required=True, help="HF model directory (config.json + *.safetensors)")
    a.add_argument("--out", required=True, help="output dist checkpoint directory")
    b = sub.add_parser("mcore-to-hf", help="Megatron dist checkpoint -> HF safetensors dir")
    b.add_argument("--ckpt", required=True, help="dist checkpoint directory written by hf-to-mcore or training")
    b.add_argument("--out", required=True, help="output HF directory")
    for s in (a, b):
        s.add_argument("--tp", type=int, default=1)
        s.add_argument("--pp", type=int, default=1)
        s.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (mixture-of-experts models)")
    return p


def convert_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.direction == "hf-to-mcore":
            out = hf_to_mcore(args.hf, args.out, args.tp, args.pp, args.ep)
        else:
            out = mcore_to_hf(args.ckpt, args.out, args.tp, args.pp, args.ep)
    except Exception as e:  # a spawned rank's error arrives with its traceback: its last line is the message
        lines = [line for line in str(e).splitlines() if line.strip()]
        print(f"convert failed: {lines[-1] if lines else type(e).__name__}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(convert_main(sys.argv[1:]))
