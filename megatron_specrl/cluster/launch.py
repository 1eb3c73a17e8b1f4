"""`megatron-specrl launch`: check the whole plan, then render (and optionally submit) a Slurm job
that starts a Ray cluster and trains.

The plan check (plan.py) runs first, always, and nothing is written when it fails: a layout that
cannot run would otherwise fail only after the job left the queue. The script then:
  1. runs the GPU stack check (gpu_stack.py) on every node, so a broken install fails in seconds;
  2. starts the Ray head on the first node and a worker on each other node with `srun`, and waits
     with ray_join.py until every node's GPUs have joined (a timeout, never a fixed sleep); Ray's token
     authentication is on for every step, with a fresh token per job attempt in a file only the user can
     read (RAY_AUTH_TOKEN_PATH; the token itself is never in the script or its log), the dashboard off
     unless --dashboard (then on the head's localhost only) (docs/cluster.md, "Who can reach a job");
  3. runs `megatron-specrl train ... ray.address=auto trainer.resume=auto` on the head;
  4. stops Ray on exit (an EXIT trap), exits with train's status, and requeues itself after a
     failure other than a config error (2) up to --max-requeues times; resume=auto continues from
     the newest complete checkpoint. Slurm's --requeue covers preemption and node failure. A restart
     continues the job's own run even where the first attempt started with trainer.resume=never or
     from an explicit checkpoint (`continues_own_run`).
Every path and override is shell-quoted.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

TEMPLATE = """#!/bin/bash
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus_per_node}
#SBATCH --cpus-per-task={cpus_per_node}
#SBATCH --time={time}
#SBATCH --output={log_file}
#SBATCH --open-mode=append
#SBATCH --requeue
{extra_sbatch}# Rendered by `megatron-specrl launch` after the plan check passed; the plan is in {plan_file}.
set -euo pipefail
{env_exports}
VENV={venv}
WORKDIR={workdir}
RECIPE={recipe}
TRAIN_ARGS=({train_args})
# A port of this job's own (the job id's) unless --ray-port was given: a second job's head on a shared
# node at the same port fails, and its nodes and driver would join the first job's cluster instead.
RAY_PORT={ray_port}
{ray_client_port}GPUS_PER_NODE={gpus_per_node}
CPUS_PER_NODE={cpus_per_node}
JOIN_TIMEOUT_S={join_timeout_s}
MAX_REQUEUES={max_requeues}
ENGINE={engine}
OUTPUT_DIR={output_dir}
FIRST_RESUME={first_resume}

cd "$WORKDIR"
# Ray token authentication (Ray's default for a `ray start` cluster is none: anyone who reaches its ports
# could run code as this user). A fresh token per job attempt, generated into a directory only this user
# can read, on the shared file system the other nodes read it from; never printed (stdout to /dev/null).
RAY_AUTH_DIR="$OUTPUT_DIR/.ray-auth/${{SLURM_JOB_ID}}-${{SLURM_RESTART_COUNT:-0}}"
rm -rf "$RAY_AUTH_DIR"
(umask 077 && mkdir -p "$RAY_AUTH_DIR" && env -u RAY_AUTH_TOKEN -u RAY_AUTH_TOKEN_PATH HOME="$RAY_AUTH_DIR" \\
    "$VENV/bin/ray" get-auth-token --generate >/dev/null)
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$RAY_AUTH_DIR/.ray/auth_token"
unset RAY_AUTH_TOKEN
chmod 600 "$RAY_AUTH_TOKEN_PATH"
# on every step as well: where srun does not pass the batch environment on (--export=NONE) every node and
# the driver still start with the token
RAY_AUTH=(env RAY_AUTH_MODE=token "RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH")
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
num_nodes=${{#nodes[@]}}
head_node=${{nodes[0]}}
# The head's routable address as Ray picks it (the host name can resolve to loopback on Debian hosts).
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" "${{RAY_AUTH[@]}}" \\
    "$VENV/bin/python" -m megatron_specrl.cluster.ray_join --print-head-ip --nodes "$num_nodes")
export RAY_ADDRESS="$head_ip:$RAY_PORT"
ray_pids=()

# Stops this job's `ray start --block` steps only: `ray stop` would kill every Ray on the node,
# another job's (of the same user, on a shared node) included.
# shellcheck disable=SC2329  # invoked by the EXIT trap below
stop_ray() {{
    if [ "${{#ray_pids[@]}}" -gt 0 ]; then
        kill "${{ray_pids[@]}}" 2>/dev/null || true
    fi
    rm -rf "$RAY_AUTH_DIR"
}}
trap stop_ray EXIT

# 1. The GPU stack imports, has the pinned versions and sees its GPUs, on every node.
srun --nodes="$num_nodes" --ntasks-per-node=1 "${{RAY_AUTH[@]}}" "$VENV/bin/python" -m megatron_specrl.cluster.gpu_stack \\
    --gpus "$GPUS_PER_NODE" --engine "$ENGINE"

# 2. Ray: the head on the first node, a worker on each other node; wait until all have joined.
#    --cpus-per-task on each step: srun of Slurm 22.05+ does not inherit sbatch's (SLURM_CPUS_PER_TASK), and
#    the step's CPU binding would hold Ray and every learner and engine process under it to one core.
#    The dashboard {dashboard_note};
#    the Ray client server (Ray 2.60 starts one on every head) listens on RAY_CLIENT_PORT, behind the token.
srun --nodes=1 --ntasks=1 --cpus-per-task="$CPUS_PER_NODE" -w "$head_node" "${{RAY_AUTH[@]}}" "$VENV/bin/ray" start --head \\
    --node-ip-address="$head_ip" --port="$RAY_PORT" --ray-client-server-port="$RAY_CLIENT_PORT" {dashboard_args} \\
    --num-gpus="$GPUS_PER_NODE" --num-cpus="$CPUS_PER_NODE" --block &
ray_pids+=("$!")
for node in "${{nodes[@]:1}}"; do
    srun --nodes=1 --ntasks=1 --cpus-per-task="$CPUS_PER_NODE" -w "$node" "${{RAY_AUTH[@]}}" "$VENV/bin/ray" start --address="$RAY_ADDRESS" \\
        --num-gpus="$GPUS_PER_NODE" --num-cpus="$CPUS_PER_NODE" --block &
    ray_pids+=("$!")
done
"${{RAY_AUTH[@]}}" "$VENV/bin/python" -m megatron_specrl.cluster.ray_join --address "$RAY_ADDRESS" --nodes "$num_nodes" \\
    --gpus-per-node "$GPUS_PER_NODE" --timeout-s "$JOIN_TIMEOUT_S"

# 3. Train on the head node; resume=auto continues a requeued job from its newest checkpoint. A restart
#    continues this job's own run also where the first attempt had trainer.resume=never (which would refuse
#    the directory it wrote) or an explicit checkpoint (which would set the run's later checkpoints aside).
if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ] && [ "$FIRST_RESUME" != auto ] && "$VENV/bin/python" -c \
    'import sys; from megatron_specrl.cluster.launch import continues_own_run as c; sys.exit(0 if c(*sys.argv[1:]) else 1)' \
    "$OUTPUT_DIR" "$FIRST_RESUME"; then
    TRAIN_ARGS+=(trainer.resume=auto)
fi
rc=0
srun --overlap --nodes=1 --ntasks=1 -w "$head_node" "${{RAY_AUTH[@]}}" "$VENV/bin/megatron-specrl" train "$RECIPE" \\
    "${{TRAIN_ARGS[@]}}" || rc=$?

# 4. Requeue after a failure that is not a config error (exit 2), a bounded number of times.
if [ "$rc" -ne 0 ] && [ "$rc" -ne 2 ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt "$MAX_REQUEUES" ]; then
    echo "train exited with $rc; requeueing (restart ${{SLURM_RESTART_COUNT:-0}} of $MAX_REQUEUES)" >&2
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$rc"
"""


def render(recipe: str, nodes: int, gpus_per_node: int, cpus_per_node: int, time: str, partition: str | None,
           account: str | None, overrides: list[str], venv: str, log_dir: str, workdir: str, engine: str = "vllm",
           ray_port: int | None = None, join_timeout_s: int = 600, max_requeues: int = 3, plan_file: str = "",
           output_dir: str | None = None, first_resume: str = "auto", ray_client_port: int | None = None,
           dashboard: bool = False) -> str:
    q = shlex.quote
    extra = "".join(f"#SBATCH --{k}={v}\n" for k, v in (("partition", partition), ("account", account)) if v)
    train_args = ["ray.address=auto", "trainer.resume=auto", *overrides]
    return TEMPLATE.format(
        job_name=_sbatch_value(f"specrl-{Path(recipe).stem}", "recipe"), nodes=nodes, gpus_per_node=gpus_per_node,
        cpus_per_node=cpus_per_node, time=time, log_file=_sbatch_value(log_dir.replace("%", "%%") + "/%x-%j.out"),   # %% : a literal % in the directory
        extra_sbatch=extra, plan_file=plan_file or "the job's output directory", venv=q(venv), workdir=q(workdir),
        recipe=q(recipe), train_args=" ".join(q(a) for a in train_args),
        ray_port=ray_port if ray_port is not None else "$((6379 + SLURM_JOB_ID % 500))",
        # Ray 2.60's `ray start --head` opens a client server whenever ray[client] is installed (on 10001 unless
        # given, which every job on the node would share): the job's own port unless --ray-client-port
        ray_client_port=(f"RAY_CLIENT_PORT={ray_client_port}\n" if ray_client_port is not None else
                         "RAY_CLIENT_PORT=$((RAY_PORT + 500))\n"),
        dashboard_note=("binds to the head's localhost only (reach it through `ssh -L`)" if dashboard else
                        "is off (launch --dashboard starts it, bound to the head's localhost)"),
        dashboard_args=("--include-dashboard=true --dashboard-host=127.0.0.1" if dashboard else
                        "--include-dashboard=false"),
        # the SPECRL_* values the plan was checked with (a later `sbatch` from another shell gets the same run)
        env_exports="".join(f"export {k}={q(v)}\n" for k, v in sorted(os.environ.items()) if k.startswith("SPECRL_")),
        join_timeout_s=join_timeout_s, max_requeues=max_requeues, engine=q(engine),
        output_dir=q(output_dir or log_dir), first_resume=q(first_resume))


def continues_own_run(output_dir: str, first_resume: str) -> bool:
    """Whether a restarted job resumes with trainer.resume=auto instead of the first attempt's setting:
    after `never` always (the first attempt wrote the directory, which `never` refuses); after an explicit
    checkpoint once the run has saved a newer one in output_dir (resuming the explicit one again would set
    the run's later checkpoints aside and repeat its steps)."""
    from megatron_specrl import checkpoint as ckpt
    if first_resume == "auto":
        return False
    if first_resume == "never":
        return True
    latest = ckpt.find_latest(Path(output_dir) / "checkpoints")
    if latest is None:
        return False
    try:
        first_step = ckpt.load_state(Path(first_resume))["step"]
    except (OSError, ValueError, KeyError):
        return True
    return ckpt.load_state(latest)["step"] > first_step


def _sbatch_value(value: str, key: str = "output_dir") -> str:
    """#SBATCH lines are not shell: sbatch splits them at whitespace, takes ' and " as quotes, a backslash
    as an escape and an unquoted # as the start of a comment (sbatch/opt.c, get_argument). Inside double
    quotes only \\ and " are special, so the value is double-quoted with those two escaped. A backslash
    left in a file name also turns off Slurm's %-patterns (%x, %j), so it is refused with newlines."""
    if "\n" in value or "\\" in value:
        from megatron_specrl.config import ConfigError
        raise ConfigError(f"{key}={value!r}: a backslash or newline cannot be passed to an #SBATCH line")
    if not any(c.isspace() or c in "'\"#" for c in value):
        return value
    return '"' + value.replace('"', '\\"') + '"'


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-specrl launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--nodes", type=int, help="sets cluster.nodes (default: the recipe's)")
    p.add_argument("--gpus-per-node", type=int, help="sets cluster.gpus_per_node (default: the recipe's)")
    p.add_argument("--cpus-per-node", type=int, default=64)
    p.add_argument("--time", default="24:00:00")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--venv", default=str(Path(sys.prefix)))
    p.add_argument("--ray-port", type=int, help="the Ray head's GCS port (default: 6379 + the job id mod 500)")
    p.add_argument("--ray-client-port", type=int,
                   help="the Ray client server's port, for ray.init('ray://HEAD:PORT') from outside the job "
                        "(default: the GCS port + 500; Ray 2.60 opens one on every head, behind the job's token)")
    p.add_argument("--dashboard", action="store_true",
                   help="start Ray's dashboard, bound to the head node's localhost (default: off)")
    p.add_argument("--join-timeout-s", type=int, default=600, help="how long nodes may take to join Ray")
    p.add_argument("--max-requeues", type=int, default=3)
    p.add_argument("--out", help="where to write the sbatch script (default: <output_dir>/launch.sbatch)")
    p.add_argument("--submit", action="store_true", help="run sbatch on the rendered script")
    return p


def launch_main(argv: list[str]) -> int:
    from megatron_specrl.config import load_config, resolve_recipe
    from megatron_specrl.plan import build_plan

    args = build_parser().parse_intermixed_args(argv)
    recipe = resolve_recipe(args.recipe)
    overrides = list(args.overrides)
    # --nodes / --gpus-per-node are the cluster.* keys, so the plan and the job see the same numbers
    if args.nodes is not None:
        overrides.append(f"cluster.nodes={args.nodes}")
    if args.gpus_per_node is not None:
        overrides.append(f"cluster.gpus_per_node={args.gpus_per_node}")
    cfg = load_config(recipe, overrides)
    # raises PlanError before anything is written; a submitted job loads model.path as it is, a rendered
    # script may yet get the checkpoint's (SPECRL_MODEL at sbatch time), so only --submit refuses a shape-only one
    plan = build_plan(cfg, loads_model=args.submit)
    out = Path(args.out or Path(cfg.output_dir) / "launch.sbatch")
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)    # #SBATCH --output's directory: Slurm creates none
    plan_file = out.with_suffix(".plan.txt")
    script = render(str(Path(recipe).resolve()), cfg.cluster.nodes, cfg.cluster.gpus_per_node, args.cpus_per_node,
                    args.time, args.partition, args.account, overrides, args.venv,
                    log_dir=str(Path(cfg.output_dir).resolve()), workdir=os.getcwd(), engine=cfg.rollout.engine,
                    ray_port=args.ray_port, join_timeout_s=args.join_timeout_s, max_requeues=args.max_requeues, plan_file=str(plan_file),
                    first_resume=cfg.trainer.resume, ray_client_port=args.ray_client_port, dashboard=args.dashboard)
    out.write_text(script)
    plan_file.write_text("\n".join(f"{k}: {v}" for k, v in plan.rows()) + "\n")
    print(f"wrote {out}")
    if args.submit:
        return subprocess.call(["sbatch", str(out)])
    return 0
