"""Step metrics to three sinks: a JSONL under output_dir, wandb (offline by default), the console."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rich.console import Console

CONSOLE_KEYS = [("eval/accuracy", "eval_acc"), ("reward/mean", "reward"), ("response/mean_len", "len"), ("spec/reuse_ratio", "reuse"),
                ("spec/rollout_s", "rollout_s"), ("train/loss", "loss"), ("time/step_s", "step_s")]


class MetricsLogger:
    def __init__(self, output_dir: str | Path, run_config: dict, *, use_wandb: bool, wandb_mode: str,
                 project: str, run_name: str | None, resume_step: int = 0):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        # a run starting at step 0 (fresh, or resumed before its first checkpoint) logs its step-0
        # eval again: keep no row of an earlier run in this output_dir, not even that one
        truncate_jsonl(self.path, resume_step if resume_step > 0 else -1)
        truncate_jsonl(self.dir / "data_order.jsonl", resume_step)
        self.console = Console(stderr=True)
        self.wandb = None
        if use_wandb and wandb_mode != "disabled":
            import wandb
            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb = wandb.init(project=project, name=run_name, dir=str(self.dir), mode=wandb_mode,
                                    config=run_config, resume="allow", id=self._wandb_id())
            # A resumed run continues this wandb run and logs the steps since its checkpoint again;
            # wandb drops a log(step=s) below its current step, so those would be lost. As wandb
            # documents for out-of-order steps (define_metric), its own step only counts log calls
            # and the charts' x-axis is the training step logged as "step": nothing is dropped, and
            # a replayed step shows beside its pre-crash value (metrics.jsonl keeps the replayed one).
            # (Rewinding the run instead, resume_from="<id>?_step=N", is a private-preview feature.)
            self.wandb.define_metric("step")
            self.wandb.define_metric("*", step_metric="step")

    def _wandb_id(self) -> str:
        """One wandb run per output_dir, so a resumed run continues its curves."""
        f = self.dir / "wandb_run_id"
        if not f.exists():
            import uuid
            f.write_text(uuid.uuid4().hex[:12])
        return f.read_text().strip()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.wandb is not None:
            self.wandb.log({"step": step, **metrics})
        shown = "  ".join(f"{label}={metrics[k]:.3g}" for k, label in CONSOLE_KEYS if k in metrics)
        self.console.print(f"[bold]step {step}[/bold]  {shown}")

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def truncate_jsonl(path: Path, step: int) -> None:
    """On resume, drop lines of steps after the checkpoint: they will be run again.
    A torn last line (killed mid-write) is dropped too. The kept lines go to a temporary file that
    replaces the old one: rewritten in place, a kill or a full disk here would lose the whole log."""
    if not path.exists():
        return
    kept = []
    for ln in path.read_text().splitlines():
        try:
            row = json.loads(ln)
        except json.JSONDecodeError:
            continue
        if row.get("step", 0) <= step:
            kept.append(ln)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write("".join(ln + "\n" for ln in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


def plot_metrics(metrics_path: str | Path, out_dir: str | Path) -> list[Path]:
    """One PNG per curve: reward, response length, rollout seconds, reuse ratio, eval accuracy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, name in [("reward/mean", "reward"), ("response/mean_len", "response_length"),
                      ("spec/rollout_s", "rollout_seconds"), ("spec/reuse_ratio", "reuse_ratio"),
                      ("eval/accuracy", "eval_accuracy")]:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
