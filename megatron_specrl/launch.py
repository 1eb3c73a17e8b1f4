"""`megatron-specrl launch`: render (and optionally submit) a Slurm job that starts a Ray cluster and trains.

Node 0 runs `ray start --head` and the driver; the other nodes join with
`ray start --address`. The driver then runs `megatron-specrl train` with
`ray.address=auto`, so placement is Ray's, exactly as in a local run.
"""

from __future__ import annotations

import argparse
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
#SBATCH --output={log_dir}/%x-%j.out
{partition_line}{account_line}
set -euo pipefail
nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
head=${{nodes[0]}}
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address | awk '{{print $1}}')
port={ray_port}
export RAY_ADDRESS="$head_ip:$port"

srun --nodes=1 --ntasks=1 -w "$head" {venv}/bin/ray start --head --node-ip-address="$head_ip" --port=$port \\
    --num-gpus={gpus_per_node} --num-cpus={cpus_per_node} --block &
sleep 20
for node in "${{nodes[@]:1}}"; do
  srun --nodes=1 --ntasks=1 -w "$node" {venv}/bin/ray start --address="$RAY_ADDRESS" \\
      --num-gpus={gpus_per_node} --num-cpus={cpus_per_node} --block &
done
sleep 20

srun --overlap --nodes=1 --ntasks=1 -w "$head" {venv}/bin/megatron-specrl train {recipe} ray.address=auto {overrides}
"""


def render(recipe: str, nodes: int, gpus_per_node: int, cpus_per_node: int, time: str, partition: str | None,
           account: str | None, overrides: list[str], venv: str, log_dir: str, ray_port: int = 6379) -> str:
    if nodes < 1 or gpus_per_node < 0:
        raise ValueError("--nodes must be >= 1 and --gpus-per-node >= 0")
    return TEMPLATE.format(
        job_name=f"specrl-{Path(recipe).stem}", nodes=nodes, gpus_per_node=gpus_per_node,
        cpus_per_node=cpus_per_node, time=time, log_dir=log_dir, ray_port=ray_port, venv=venv,
        partition_line=f"#SBATCH --partition={partition}\n" if partition else "",
        account_line=f"#SBATCH --account={account}\n" if account else "",
        recipe=shlex.quote(recipe), overrides=" ".join(shlex.quote(o) for o in overrides))


def launch_main(argv: list[str]) -> int:
    from megatron_specrl.config import load_config, resolve_recipe

    p = argparse.ArgumentParser(prog="megatron-specrl launch", description=__doc__)
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--cpus-per-node", type=int, default=64)
    p.add_argument("--time", default="24:00:00")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--venv", default=str(Path(sys.prefix)))
    p.add_argument("--out", help="where to write the sbatch script (default: <output_dir>/launch.sbatch)")
    p.add_argument("--submit", action="store_true", help="run sbatch on the rendered script")
    args = p.parse_args(argv)
    recipe = resolve_recipe(args.recipe)
    cfg = load_config(recipe, args.overrides)   # fail here, not on the cluster
    out = Path(args.out or Path(cfg.output_dir) / "launch.sbatch")
    out.parent.mkdir(parents=True, exist_ok=True)
    script = render(str(recipe), args.nodes, args.gpus_per_node, args.cpus_per_node, args.time, args.partition,
                    args.account, args.overrides, args.venv, log_dir=str(Path(cfg.output_dir).resolve()))
    out.write_text(script)
    print(f"wrote {out}")
    if args.submit:
        return subprocess.call(["sbatch", str(out)])
    return 0
