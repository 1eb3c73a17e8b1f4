"""The cluster path (plan.py, cluster/launch.py) with real-shaped HF configs.

The tests of this subject that start processes or engines; the rest are in tests/unit/test_cluster_configs.py.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from megatron_specrl import checkpoint as ckpt
from megatron_specrl.cluster.launch import launch_main


from tests.helpers.paths import REPO_ROOT as ROOT

FAKE_SRUN = textwrap.dedent("""\
    #!/bin/bash
    while [ $# -gt 0 ]; do
        case "$1" in -w) shift ;; --*) ;; *) break ;; esac
        shift
    done
    exec "$@"
""")


FAKE_PYTHON = textwrap.dedent("""\
    #!/bin/bash
    case "$*" in
        *"--print-head-ip"*) echo 127.0.0.1 ;;
        "-m megatron_specrl."*) exit 0 ;;
        *) exec "$REAL_PYTHON" "$@" ;;
    esac
""")


# `ray get-auth-token --generate` writes $HOME/.ray/auth_token (the script's private directory); the rest exits
FAKE_RAY = textwrap.dedent("""\
    #!/bin/bash
    if [ "$1" = get-auth-token ]; then mkdir -p "$HOME/.ray" && printf fake-token > "$HOME/.ray/auth_token"; fi
    exit 0
""")


FAKE_TRAIN = '#!/bin/bash\nprintf "%s\\n" "$@" > "$TRAIN_ARGS_FILE"\nexit 1\n'


def run_script(tmp_path, overrides, restart_count):
    out = tmp_path / "run"
    script = tmp_path / "job.sbatch"
    assert launch_main(["qwen2.5-7b-dapo-1node", f"output_dir={out}", *overrides, "--venv", str(tmp_path / "venv"),
                        "--max-requeues", "0", "--out", str(script)]) == 0
    bin_dir, venv_bin = tmp_path / "bin", tmp_path / "venv" / "bin"
    for d, name, text in ((bin_dir, "srun", FAKE_SRUN), (bin_dir, "scontrol", "#!/bin/bash\necho node-a\n"),
                          (venv_bin, "python", FAKE_PYTHON), (venv_bin, "ray", FAKE_RAY),
                          (venv_bin, "megatron-specrl", FAKE_TRAIN)):
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
        (d / name).chmod(0o755)
    args_file = tmp_path / "train_args.txt"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node-a",
           "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": str(restart_count), "REAL_PYTHON": sys.executable,
           "PYTHONPATH": str(ROOT), "TRAIN_ARGS_FILE": str(args_file)}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    return args_file.read_text().split()


def save_checkpoint(root: Path, step: int) -> Path:
    tmp = ckpt.begin(root, step)
    (tmp / "weights.bin").write_bytes(b"x")
    return ckpt.commit(tmp, {"step": step}, keep=10)


def test_a_restart_after_resume_never_continues_the_run(tmp_path):
    """The first attempt trains with trainer.resume=never as asked; the requeued one with resume=auto
    (`never` would refuse the directory the first attempt wrote, exit 2, and the job would stop there)."""
    assert run_script(tmp_path, ["trainer.resume=never"], 0)[-1] == "trainer.resume=never"
    assert run_script(tmp_path, ["trainer.resume=never"], 1)[-1] == "trainer.resume=auto"


def test_a_restart_after_an_explicit_checkpoint_continues_from_the_newest(tmp_path):
    """Started from another run's step 100: a restart before this run saved goes back to step 100; once it
    saved step 120 in its output_dir, a restart continues from there instead of setting it aside."""
    start = save_checkpoint(tmp_path / "earlier" / "checkpoints", 100)
    args = run_script(tmp_path, [f"trainer.resume={start}"], 1)
    assert args[-1] == f"trainer.resume={start}"
    save_checkpoint(tmp_path / "run" / "checkpoints", 120)
    assert run_script(tmp_path, [f"trainer.resume={start}"], 0)[-1] == f"trainer.resume={start}"
    assert run_script(tmp_path, [f"trainer.resume={start}"], 1)[-1] == "trainer.resume=auto"


