"""`launch`: the plan check first, then a quoted, shellcheck-clean Slurm + Ray script whose node-joining
logic and training run for real on a two-"node" Ray cluster on this machine (fake srun / scontrol).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
import pytest
from megatron_specrl.cli import main
from megatron_specrl.cluster.launch import launch_main
from megatron_specrl.config import ConfigError
from megatron_specrl.learner.ports import free_port
from tests.helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
SHELLCHECK = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)


def render(tmp_path, *args) -> str:
    out = tmp_path / "job dir" / "job.sbatch"
    assert launch_main([*args, "--out", str(out)]) == 0
    return out.read_text()


def test_renders_head_workers_join_check_and_driver(tmp_path):
    text = render(tmp_path, "qwen2.5-32b-dapo-4node", "learner.lr=2e-6", "--partition", "gpu",
                  "--venv", "/opt/my venv", "--account", "rl")
    assert "#SBATCH --nodes=4" in text and "#SBATCH --gpus-per-node=8" in text and "#SBATCH --requeue" in text
    assert "#SBATCH --partition=gpu" in text and "#SBATCH --account=rl" in text
    assert "VENV='/opt/my venv'" in text and '"$VENV/bin/ray" start --head' in text
    assert 'start --address="$RAY_ADDRESS"' in text and "megatron_specrl.cluster.ray_join" in text
    assert "megatron_specrl.cluster.gpu_stack" in text and "trap stop_ray EXIT" in text
    assert "TRAIN_ARGS=(ray.address=auto trainer.resume=auto learner.lr=2e-6)" in text
    assert "sleep" not in text and 'exit "$rc"' in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    # srun (Slurm 22.05+) does not inherit sbatch's cpus-per-task: each Ray step asks for the node's CPUs
    ray_steps = [ln for ln in text.splitlines() if '"$VENV/bin/ray" start' in ln]
    assert len(ray_steps) == 2 and all('--cpus-per-task="$CPUS_PER_NODE"' in ln for ln in ray_steps)
    assert (tmp_path / "job dir" / "job.plan.txt").read_text().startswith("model: ")


@pytest.mark.parametrize("recipe", ["qwen2.5-7b-dapo-1node", "llama-3.1-70b-dapo-8node", "tiny-cpu-dapo"])
def test_rendered_scripts_pass_bash_n_and_shellcheck(recipe, tmp_path):
    text = render(tmp_path, recipe, "output_dir=/tmp/out dir/x", "--venv", "/opt/my venv")
    script = tmp_path / "job dir" / "job.sbatch"
    assert '#SBATCH --output="/tmp/out dir/x/%x-%j.out"' in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    proc = subprocess.run([SHELLCHECK, "--severity=info", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_bad_override_fails_before_rendering(tmp_path):
    with pytest.raises(ConfigError, match="learner.nope"):
        launch_main(["tiny-cpu-dapo", "learner.nope=1", "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


def test_nodes_zero_is_one_line(tmp_path, capsys):
    assert main(["launch", "qwen2.5-7b-dapo-1node", "--nodes", "0", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["megatron-specrl: config error: invalid value for 'cluster.nodes': 0 "
                   "(Input should be greater than or equal to 1)"]
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- two local "nodes"

FAKE_SRUN = textwrap.dedent("""\
    #!/bin/bash
    # srun on one machine: drop Slurm's options, run the command once per node asked for.
    # `ray stop` is skipped: this machine is shared, the test kills the job's process group instead.
    n=1
    while [ $# -gt 0 ]; do
        case "$1" in
            --nodes=*) n=${1#--nodes=} ;;
            -w) shift ;;
            --*) ;;
            *) break ;;
        esac
        shift
    done
    case "$*" in *"ray stop"*) exit 0 ;; esac
    if [ "$n" -gt 1 ]; then
        for _ in $(seq "$n"); do "$@" || exit $?; done
        exit 0
    fi
    exec "$@"
""")
FAKE_SCONTROL = textwrap.dedent("""\
    #!/bin/bash
    case "$1" in
        show) printf 'node-a\\nnode-b\\n' ;;
        requeue) echo "requeue $2" >> "$FAKE_SLURM_LOG" ;;
    esac
""")


def _kill_group(pgid: int) -> None:
    """The job's process group (ray start --block and the raylets it spawned), which this test started."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)


def test_ray_join_counts_alive_nodes_with_their_gpus_and_names_a_missing_head():
    from megatron_specrl.cluster.ray_join import ClusterJoinTimeout, ready_nodes, wait_for_cluster
    nodes = [{"Alive": True, "Resources": {"GPU": 8.0}}, {"Alive": False, "Resources": {"GPU": 8.0}},
             {"Alive": True, "Resources": {"GPU": 4.0}}, {"Alive": True, "Resources": {"CPU": 64.0}}]
    assert len(ready_nodes(nodes, 8)) == 1 and len(ready_nodes(nodes, 4)) == 2 and len(ready_nodes(nodes, 0)) == 3
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    with pytest.raises(ClusterJoinTimeout, match="the Ray head did not accept connections within 1 s"):
        wait_for_cluster(address, nodes=2, gpus_per_node=8, timeout_s=1, poll_s=0.2)


def test_ray_port_is_the_jobs_own_unless_given(tmp_path):
    """Two jobs on one node both used 6379: the second head failed and its workers and driver joined the
    first job's Ray cluster; `ray stop --force` in the EXIT trap killed every Ray on the node."""
    text = render(tmp_path, "qwen2.5-32b-dapo-4node")
    port_lines = "\n".join(ln for ln in text.splitlines() if ln.startswith(("RAY_PORT=", "RAY_CLIENT_PORT=")))
    ports = [subprocess.run(["bash", "-c", port_lines + '\necho "$RAY_PORT $RAY_CLIENT_PORT"'], capture_output=True,
                            text=True, env={"SLURM_JOB_ID": str(job)}).stdout.split() for job in (1001, 1002)]
    assert ports[0] != ports[1] and all(len(set(p)) == 2 for p in ports)
    assert '--ray-client-server-port="$RAY_CLIENT_PORT"' in text and "ray\" stop" not in text
    assert "RAY_PORT=7001\n" in render(tmp_path, "qwen2.5-32b-dapo-4node", "--ray-port", "7001")


def test_log_dir_exists_and_specrl_env_is_pinned(tmp_path, monkeypatch):
    """Slurm opens #SBATCH --output itself and creates no directory (the job failed with no log when
    --out was elsewhere); a later `sbatch` from a shell without SPECRL_* trained other paths."""
    monkeypatch.setenv("SPECRL_OUT", str(tmp_path / "new out"))
    monkeypatch.setenv("SPECRL_MODEL", str(ROOT / "examples" / "models" / "qwen2.5-32b"))
    text = render(tmp_path, "qwen2.5-32b-dapo-4node")
    assert (tmp_path / "new out").is_dir()
    assert f"export SPECRL_OUT='{tmp_path / 'new out'}'\n" in text and "export SPECRL_MODEL=" in text
    script = tmp_path / "job dir" / "job.sbatch"
    proc = subprocess.run([SHELLCHECK, "--severity=info", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_head_ip_is_rays_routable_address_and_loopback_is_refused_for_several_nodes(monkeypatch, tmp_path):
    """`hostname --ip-address` is loopback where /etc/hosts maps the host's name to 127.0.x.1 (this machine):
    the head then listened where no other node could reach it. The script asks Ray for the address."""
    import ray.util

    from megatron_specrl.cluster import ray_join
    script = launch_main_script(tmp_path)
    assert "hostname --ip-address" not in script and "ray_join --print-head-ip" in script
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.1.1")
    assert ray_join.head_ip(1) == "127.0.1.1"                  # one node: loopback reaches itself
    with pytest.raises(ray_join.ClusterJoinTimeout, match="loopback"):
        ray_join.head_ip(2)
    assert ray_join.main(["--print-head-ip", "--nodes", "2"]) == 3
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.1.2.3")
    assert ray_join.head_ip(4) == "10.1.2.3"


def launch_main_script(tmp_path) -> str:
    out = tmp_path / "job.sbatch"
    assert launch_main(["tiny-cpu-grpo", f"output_dir={tmp_path / 'o'}", "--nodes", "2", "--gpus-per-node", "0",
                        "--out", str(out)]) == 0
    return out.read_text()


# --------------------------------------------------------------------------- Ray token authentication

def _steps(text: str) -> list[str]:
    """The script's commands that start a process on a node or talk to Ray: every srun and ray_join line."""
    return [ln.strip() for ln in text.replace("\\\n", " ").splitlines()     # continuation lines joined
            if not ln.lstrip().startswith("#") and ("srun " in ln or "megatron_specrl.cluster.ray_join" in ln)]


def test_every_step_runs_with_the_jobs_token_and_the_script_holds_none(tmp_path):
    """Ray's `ray start` cluster has no authentication by default: anyone reaching its ports runs code as
    the job's user. The script generates a fresh token per job attempt into a directory of mode 0700,
    passes its path (never the token) to every step, keeps the dashboard off and removes the token on exit."""
    text = render(tmp_path, "qwen2.5-32b-dapo-4node")
    steps = _steps(text)
    assert len(steps) == 6, steps     # head ip, gpu stack, head, workers, ray_join, train
    assert all('"${RAY_AUTH[@]}"' in ln for ln in steps), steps
    assert 'RAY_AUTH=(env RAY_AUTH_MODE=token "RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH")' in text
    assert 'export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$RAY_AUTH_DIR/.ray/auth_token"' in text
    assert "(umask 077 && mkdir -p \"$RAY_AUTH_DIR\"" in text and "get-auth-token --generate >/dev/null)" in text
    assert 'chmod 600 "$RAY_AUTH_TOKEN_PATH"' in text and 'rm -rf "$RAY_AUTH_DIR"\n}' in text
    assert "RAY_AUTH_TOKEN=" not in text
    assert "--include-dashboard=false" in text and "--dashboard-host" not in text
    on = render(tmp_path, "qwen2.5-32b-dapo-4node", "--dashboard", "--ray-client-port", "12001")
    assert "--include-dashboard=true --dashboard-host=127.0.0.1" in on and "RAY_CLIENT_PORT=12001\n" in on


def test_the_token_is_generated_private_and_never_printed(tmp_path):
    """The script's token lines, run: the file is the user's alone (0600 in a 0700 directory), distinct per
    job attempt, and neither the script's output nor the rendered files contain it."""
    text = render(tmp_path, "tiny-cpu-grpo", f"output_dir={tmp_path / 'o'}")
    start, end = text.index('RAY_AUTH_DIR="$OUTPUT_DIR'), text.index("mapfile -t nodes")
    lines = "\n".join(ln for ln in text.splitlines() if ln.startswith(("VENV=", "OUTPUT_DIR=")))
    snippet = f"set -euo pipefail\n{lines}\n{text[start:end]}\necho \"$RAY_AUTH_TOKEN_PATH\"\n"
    tokens = []
    for restart in ("0", "1"):
        proc = subprocess.run(["bash", "-c", snippet], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": restart,
                                   "RAY_AUTH_TOKEN": "from-the-users-shell"})
        assert proc.returncode == 0, proc.stderr
        path = Path(proc.stdout.strip().splitlines()[-1])
        token = path.read_text()
        assert len(token) >= 32 and token != "from-the-users-shell"
        assert path.stat().st_mode & 0o777 == 0o600 and path.parent.parent.stat().st_mode & 0o777 == 0o700
        assert token not in proc.stdout + proc.stderr
        tokens.append(token)
    assert tokens[0] != tokens[1]
    for f in (tmp_path / "job dir").iterdir():
        assert not any(t in f.read_text() for t in tokens), f


FAKE_VENV = {
    "python": '#!/bin/bash\nexec "$REAL_PYTHON" "$@"\n',
    "ray": '#!/bin/bash\nexec "$REAL_RAY" "$@"\n',
    # the job's train step: clients without the job's token (none, another job's), then train with another
    # job's token, a client with the job's own and a driver (init_ray, as train's) running a task; then the
    # job's own train (the real entry point, with the step's arguments)
    "megatron-specrl": textwrap.dedent("""\
        #!/bin/bash
        probe() { "$REAL_PYTHON" -m megatron_specrl.cluster.ray_join --address "$RAY_ADDRESS" --nodes 2 --timeout-s 60; }
        cp "$RAY_AUTH_TOKEN_PATH" "$PROBE_DIR/token"
        stat -c %a "$RAY_AUTH_TOKEN_PATH" > "$PROBE_DIR/mode"
        env -u RAY_AUTH_MODE -u RAY_AUTH_TOKEN_PATH HOME="$PROBE_DIR/outsider" bash -c "$(declare -f probe); probe" \\
            > "$PROBE_DIR/none.txt" 2>&1; echo "rc=$?" >> "$PROBE_DIR/none.txt"
        (RAY_AUTH_TOKEN_PATH="$OTHER_TOKEN" probe) > "$PROBE_DIR/other.txt" 2>&1; echo "rc=$?" >> "$PROBE_DIR/other.txt"
        (RAY_AUTH_TOKEN_PATH="$OTHER_TOKEN" "$REAL_PYTHON" -m megatron_specrl.cli train tiny-cpu-grpo ray.address=auto \\
            model.warmup_steps=0 output_dir="$PROBE_DIR/train") > "$PROBE_DIR/train.txt" 2>&1
        echo "rc=$?" >> "$PROBE_DIR/train.txt"
        probe > "$PROBE_DIR/own.txt" 2>&1; echo "rc=$?" >> "$PROBE_DIR/own.txt"
        "$REAL_PYTHON" -c 'import ray; from megatron_specrl.cluster.actors import init_ray; from megatron_specrl.config import \
        RayConfig; init_ray(RayConfig(address="auto")); print(ray.get(ray.remote(lambda: "a task ran").remote()))' \
            > "$PROBE_DIR/driver.txt" 2>&1
        exec "$REAL_SPECRL" "$@"
        """),
}


@pytest.mark.slow
def test_two_node_ray_cluster_runs_a_tiny_job_and_refuses_a_client_without_its_token(tmp_path):
    """The rendered script, under a fake srun, starts a Ray head and a worker on loopback, waits until
    both joined (ray_join), checks the stack on each "node", trains a tiny GRPO step, and stops. On that
    cluster a client with no token or another job's is refused in one line (ray_join exit 3, train exit 2
    naming the token), the job's own joins; the token file is 0600 and gone after the job, and the job's
    log never shows it. One test, so one cluster starts (each took a minute)."""
    bin_dir, venv, probe = tmp_path / "bin", tmp_path / "venv", tmp_path / "probe"
    for d, files in ((bin_dir, {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL}), (venv / "bin", FAKE_VENV)):
        d.mkdir(parents=True)
        for name, body in files.items():
            (d / name).write_text(body)
            (d / name).chmod(0o755)
    (probe / "outsider").mkdir(parents=True)
    other = tmp_path / "other-job" / "auth_token"
    other.parent.mkdir()
    other.write_text("0" * 64)
    out, script = tmp_path / "run out", tmp_path / "job.sbatch"
    assert launch_main(["tiny-cpu-grpo", f"output_dir={out}", "trainer.total_steps=1", "model.warmup_steps=0",
                        "data.num_synthetic=16", "trainer.prompts_per_step=8", "rollout.n_samples=4",
                        "rollout.max_new_tokens=16", "rollout.kv_cache_gb=0.25", "data.num_eval=0",
                        "trainer.eval_every=0", "trainer.checkpoint_every=0",
                        "logging.wandb=false", "logging.plots=false", "trainer.export_hf=false",
                        "--nodes", "2", "--gpus-per-node", "0", "--cpus-per-node", "2", "--venv", str(venv),
                        "--ray-port", str(free_port("127.0.0.1")), "--join-timeout-s", "180",
                        "--out", str(script)]) == 0
    bin_real = Path(sys.executable).parent
    # RAY_AUTH_MODE=disabled in the user's shell: the script's token mode still holds
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="node-[a-b]",
               SLURM_JOB_ID="43", SLURM_RESTART_COUNT="0", FAKE_SLURM_LOG=str(tmp_path / "slurm.log"),
               REAL_PYTHON=sys.executable, REAL_RAY=str(bin_real / "ray"), REAL_SPECRL=str(bin_real / "megatron-specrl"),
               PYTHONPATH=str(ROOT), PROBE_DIR=str(probe), OTHER_TOKEN=str(other),
               MEGATRON_SPECRL_CACHE=str(tmp_path / "cache"), RAY_AUTH_MODE="disabled")
    for k in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(k, None)
    proc = subprocess.Popen(["bash", str(script)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=900)
    finally:
        _kill_group(proc.pid)
    assert proc.returncode == 0, log[-4000:]
    assert log.count("gpu_stack[") == 2 and "ray_join: 2 node(s) joined" in log
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows][-1] == 1
    assert not (tmp_path / "slurm.log").exists()       # a finished job does not requeue
    token = (probe / "token").read_text()
    assert len(token) >= 32 and token not in log and (probe / "mode").read_text().strip() == "600"
    assert not (out / ".ray-auth" / "43-0").exists()             # removed by the EXIT trap
    for name in ("none", "other"):
        text = (probe / f"{name}.txt").read_text()
        assert text.endswith("rc=3\n") and "refused this process's token (AuthenticationError: " in text, text
    train = [ln for ln in (probe / "train.txt").read_text().splitlines() if ln.startswith("megatron-specrl:")]
    assert (probe / "train.txt").read_text().endswith("rc=2\n"), (probe / "train.txt").read_text()[-3000:]
    assert len(train) == 1 and train[0].startswith("megatron-specrl: config error: ray.address=auto: the Ray head") \
        and "refused this process's token" in train[0], train
    own = (probe / "own.txt").read_text()
    assert "ray_join: 2 node(s) joined" in own and own.endswith("rc=0\n"), own
    assert "a task ran" in (probe / "driver.txt").read_text()     # the driver (init_ray) and its workers
