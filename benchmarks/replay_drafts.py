"""Replay a run's rollouts through the draft trees: decode steps without an engine and without timing noise.

A tree-drafted rollout is exact, so its tokens do not depend on the drafts; and with a point-mass
draft vLLM's rejection sampler outputs the draft token exactly when it accepts it. So given the
tokens a run really sampled (`trainer.rollout_data_dir`; bench-rollout writes them per mode), the
drafts a `TreeDrafter` would have proposed and how many of them the engine would have accepted
follow without running the model: each simulated engine step, every running request drafts from
the trees (the same `TreeDrafter` the engines run, fed the same way: siblings' tokens in flight,
earlier steps' responses kept), keeps the draft's common prefix with its real next tokens plus
one sampled token, and the batch's rollout takes as many steps as its slowest request.

Compares drafting policies on the same tokens: `--window W` keeps only the responses of each
prompt's last W rollouts in its tree (0: all, what the engine does; the shared tree then holds those
rollouts too), `--shared-nodes` sets the shared tree's bound (0: each prompt's own tree only), `--own-draft` drafts each
sample's previous response first (rollout.verify=decode), and the length settings. It prints, per
setting, decode steps per rollout, tokens verified per step (draft tokens + running requests: what
a step costs on a CPU), requests running per step, and draft acceptance. With `--step-cost A,B,C`
(bench-rollout's fitted decode-step cost on the machine in question: A ms a step + B ms a request
+ C ms a draft token) it also prints what the decode loop would take per rollout, and what plain
decoding of the same responses would take under the same cost (a GPU's fit from
`benchmarks/bench_verify_cost.py`, fitted over plain and drafted steps alike, turns a CPU run's steps into a
GPU estimate; bench-rollout's fit covers drafted steps only, where requests and draft tokens rise
together, so it prices plain steps badly), so a drafting
policy (`--token-budget`, `--min-prob`, `--draft-tokens`) can be chosen for that machine. The first rollout of each
prompt has no earlier responses; `--from-step` (default: the first step at which every prompt of
the step has been seen before) sets where the summary starts. As in the engine, no draft runs past
a request's last position (prompt + max_new_tokens: `--max-new-tokens`, by default the longest
response the dump marks `finish_reason: length`).

    python benchmarks/replay_drafts.py <dir with <step>.jsonl> [--window 0,1,2] [--own-draft]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict, deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_specrl.rollout.tree_drafting.drafter import SHARED_KEY, RequestOpts, TreeDrafter  # noqa: E402
from megatron_specrl.rollout.dump import read_rollouts  # noqa: E402
from megatron_specrl.rollout.speculative import common_prefix  # noqa: E402


def replay_step(drafter: TreeDrafter, rows: list[dict], tag: str, own: dict | None = None,
                max_new_tokens: int | None = None) -> dict:
    """One rollout's decode loop: returns engine steps, request steps, drafted/accepted tokens and the
    tokens verified per step (drafts + one per running request). `max_new_tokens`: the requests'
    max_tokens, where the engine's drafter stops drafting (None: unknown, drafts run on)."""
    reqs = {f"{tag}/{i}": r for i, r in enumerate(rows)}
    # per request: its drafting options (own draft: the sample's previous response; the last position
    # the engine keeps, past which it drafts nothing) and all its tokens
    opts = {rid: RequestOpts(r["prompt_id"], len(r["prompt_ids"]), len(r["prompt_ids"]), False,
                             tuple(own.get((r["prompt_id"], r["sample_idx"]), ())) if own is not None else (),
                             None if max_new_tokens is None else len(r["prompt_ids"]) + int(max_new_tokens))
            for rid, r in reqs.items()}
    seqs = {rid: r["prompt_ids"] + r["response_ids"] for rid, r in reqs.items()}
    pos = dict.fromkeys(reqs, 1)            # the prefill step samples every request's first token
    gained = dict.fromkeys(reqs, 1)
    running = [rid for rid, r in reqs.items() if r["response_ids"]]
    prefilled = len(running)                 # the requests that ran in the prefill step (steps' first)
    steps, request_steps, drafted, accepted, verified = 1, 0, 0, 0, 0
    first_drafted = first_accepted = 0       # request-steps with a draft, and those whose first token was accepted
    # the step-cost fit's requests: the engine's drafter times each step from its call to the next one
    # and counts that interval against the requests of the step whose call starts it (tree_drafter:
    # add_step_cost(last step's requests, ...)): the prefill step's requests in, the last step's out
    cost_requests = 0
    while running:
        n_running = len(running)
        drafter.begin_step(n_running)
        drafts = {}
        for rid in running:
            drafts[rid] = drafter.request(rid, lambda o=opts[rid]: o, lambda a, b, s=seqs[rid]: s[a:b],
                                          opts[rid].prompt_len + pos[rid], gained[rid]) or []
        drafter.end_step()
        running = [rid for rid in running if pos[rid] < len(reqs[rid]["response_ids"])]
        if not running:
            break
        steps += 1
        cost_requests += n_running
        verified += len(running)
        for rid in running:
            resp, d = reqs[rid]["response_ids"], drafts[rid]
            rest = resp[pos[rid]:]
            match = common_prefix(d, rest)     # the engine outputs a draft token iff it accepts it
            gained[rid] = min(match + 1, len(rest))
            pos[rid] += gained[rid]
            request_steps += 1
            drafted += len(d)
            if d:
                first_drafted += 1
                first_accepted += match > 0
            accepted += match
            verified += len(d)
    drafter.begin_step(0)
    drafter.end_step()                       # every request has ended: its tokens stay in the trees
    # plain decoding of the same responses: step k (the prefill is step 1) samples token k of every
    # response at least k long; counted as above, each interval with the requests of the step starting it,
    # so a response of n tokens counts in steps 1..n, the last step (the longest response's) left out
    lengths = [len(r["response_ids"]) for r in reqs.values()]
    longest = max(lengths, default=0)
    plain_requests = sum(min(n, longest - 1) for n in lengths)
    return {"steps": steps, "request_steps": request_steps, "drafted": drafted, "accepted": accepted,
            "first_drafted": first_drafted, "first_accepted": first_accepted,
            "verified": verified, "prefilled": prefilled, "cost_requests": cost_requests,
            "plain_steps": longest, "plain_cost_requests": plain_requests}


def infer_max_new_tokens(steps: dict[int, list[dict]]) -> int | None:
    """The run's max_new_tokens as its dump shows it: the longest response that ended at its length
    limit (finish_reason "length"); None when none did."""
    return max((len(r["response_ids"]) for rows in steps.values() for r in rows
                if r.get("finish_reason") == "length"), default=None)


def replay(steps: dict[int, list[dict]], window: int, own_draft: bool, settings: dict, max_k: int,
           max_model_len: int, max_new_tokens: int | None = None) -> dict[int, dict]:
    """Every step in order under one policy; window 0 keeps one drafter for the whole run."""
    history: dict[str, deque] = defaultdict(lambda: deque(maxlen=window or None))
    last: dict[tuple, list[int]] = {}
    drafter = TreeDrafter(max_k, max_model_len, settings)
    out = {}
    for step, rows in steps.items():
        if window:
            drafter = TreeDrafter(max_k, max_model_len, settings)
            for pid in dict.fromkeys(r["prompt_id"] for r in rows):
                for old_rows in history[pid]:
                    for resp in old_rows:
                        drafter.trees.insert(pid, resp)
                        if drafter.shared_nodes:
                            drafter.trees.insert(SHARED_KEY, resp)
        out[step] = replay_step(drafter, rows, f"s{step}", last if own_draft else None, max_new_tokens)
        by_prompt = defaultdict(list)
        for r in rows:
            by_prompt[r["prompt_id"]].append(r["response_ids"])
            last[(r["prompt_id"], r["sample_idx"])] = r["response_ids"]
        for pid, resps in by_prompt.items():
            history[pid].append(resps)
    return out



def parse_step_cost(text: str | None) -> tuple[float, float, float] | None:
    """--step-cost A,B,C (ms per step, per request, per draft token), or exit with one line naming it.

    A term may be slightly negative: benchmarks/bench_verify_cost.py prints a least-squares fit, and its
    command line must be taken as printed."""
    if text is None:
        return None
    try:
        cost = tuple(float(x) for x in text.split(","))
    except ValueError:
        cost = ()
    if len(cost) != 3:
        raise SystemExit(f"--step-cost {text!r}: expected three numbers A,B,C (ms per step, per request, "
                         "per draft token)")
    return cost


def _counts(flag: str, text: str, form: str) -> list[int]:
    """A comma-separated list of non-negative integers, or exit with one line naming the flag."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = [-1]
    if min(values) < 0:
        raise SystemExit(f"{flag} {text!r}: expected non-negative integers {form}")
    return values

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rollouts", help="a trainer.rollout_data_dir (bench-rollout: <output>/seed<N>/<mode>/rollouts)")
    ap.add_argument("--window", default="0", help="comma-separated W values: last W rollouts per prompt (0: all)")
    ap.add_argument("--own-draft", action="store_true", help="draft each sample's previous response first")
    ap.add_argument("--draft-tokens", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--min-prob", type=float, default=0.1)
    ap.add_argument("--shared-nodes", default=None, metavar="N[,N...]",
                    help="the shared tree's bound (rollout.drafter.shared_nodes; 0: prompt trees only), one run each")
    ap.add_argument("--calibration", default="on", metavar="on|off[,...]",
                    help="the drafter's calibration of tree frequencies (rollout.drafter.calibrate), one run each")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--from-step", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="the run's rollout.max_new_tokens (default: the longest response that ended at its limit)")
    ap.add_argument("--step-cost", default=None, metavar="A,B,C",
                    help="ms per decode step, per request in it, per draft token (bench-rollout's step cost fit)")
    args = ap.parse_args()
    cost = parse_step_cost(args.step_cost)

    windows = _counts("--window", args.window, "W[,W...] (the last W rollouts per prompt; 0: all)")
    for flag, value, low in (("--draft-tokens", args.draft_tokens, 1), ("--token-budget", args.token_budget, 1),
                             ("--max-model-len", args.max_model_len, 1), ("--max-new-tokens", args.max_new_tokens, 1)):
        if value is not None and value < low:
            raise SystemExit(f"{flag} {value}: expected an integer >= {low}")
    if not 0 <= args.min_prob <= 1:
        raise SystemExit(f"--min-prob {args.min_prob}: expected a probability in [0, 1]")

    calibrations = args.calibration.split(",")
    if not set(calibrations) <= {"on", "off"}:
        raise SystemExit(f"--calibration {args.calibration!r}: expected on, off or on,off")
    shared = [None]
    if args.shared_nodes is not None:
        shared = _counts("--shared-nodes", args.shared_nodes,
                         "N[,N...] (the shared tree's bound in states; 0: prompt trees only)")

    steps = read_rollouts(args.rollouts)
    seen, first_full = set(), None
    for step, rows in steps.items():
        ids = {r["prompt_id"] for r in rows}
        if first_full is None and ids <= seen:
            first_full = step
        seen |= ids
    start = args.from_step if args.from_step is not None else first_full
    if start is None:
        raise SystemExit(f"{args.rollouts}: no step whose prompts all came before; pass --from-step")
    if start > max(steps):      # nothing to summarise
        raise SystemExit(f"--from-step {start}: the dumps in {args.rollouts} end at step {max(steps)}")
    settings = {"token_budget": args.token_budget, "min_prob": args.min_prob}
    max_new = args.max_new_tokens if args.max_new_tokens is not None else infer_max_new_tokens(steps)
    print(f"{args.rollouts}: {len(steps)} rollouts of {len(next(iter(steps.values())))} samples; summary from step "
          f"{start}; max_new_tokens {max_new if max_new is not None else 'unknown (drafts not cut)'}")
    for w, n, cal in ((w, n, cal) for w in windows for n in shared for cal in calibrations):
        policy = dict(settings, calibrate=cal == "on")
        if n is not None:
            policy["shared_nodes"] = n
        res = [r for s, r in replay(steps, w, args.own_draft, policy, args.draft_tokens,
                                    args.max_model_len, max_new).items() if s >= start]
        total = lambda k: sum(r[k] for r in res)
        label = ("" if n is None else f" shared {n}") + ("" if len(calibrations) == 1 else f" calibration {cal}")
        print(f"  window {w or 'all':>3}{' +own' if args.own_draft else ''}{label}: decode steps / rollout "
              f"{statistics.fmean(r['steps'] for r in res):5.1f}  tokens verified / step "
              f"{total('verified') / max(total('steps') - len(res), 1):6.0f}  requests running / step "
              f"{running_per_step(res):5.1f}  draft accepted "
              f"{total('accepted') / max(total('drafted'), 1):4.0%}"
              + ("" if cost is None else priced(res, cost)))


def priced(results: list[dict], cost: tuple[float, float, float]) -> str:
    """The decode loop's price per rollout, drafted and plain, and their ratio."""
    drafted, plain = loop_ms(results, cost), plain_loop_ms(results, cost)
    return f"  decode loop ~{drafted:6.0f} ms / rollout, plain decoding ~{plain:6.0f} ms ({plain / drafted:.2f}x)"


def running_per_step(results: list[dict]) -> float:
    """Requests running per engine step, as the engine counts them (bench-rollout's "requests running /
    step"): every step of the rollout, the prefill's included, with the requests that ran in it."""
    return sum(r["request_steps"] + r["prefilled"] for r in results) / max(sum(r["steps"] for r in results), 1)


def loop_ms(results: list[dict], cost: tuple[float, float, float]) -> float:
    """Mean decode-loop milliseconds per rollout under the cost model, with its terms as the engine's
    fit counted them: one interval from each step's drafter call to the next (every step but the last),
    the requests of the step that starts it (the prefill step's included, the last step's not), the
    draft tokens it verifies. The fit's residuals sum to zero, so on the steps it was fitted on this
    gives the measured loop; priced with the next step's requests instead, it read low by b x (the
    prefill step's requests - the last step's), ~7% of the default bench's loop."""
    a, b, c = cost
    return statistics.fmean(a * (r["steps"] - 1) + b * r["cost_requests"] + c * r["drafted"] for r in results)


def plain_loop_ms(results: list[dict], cost: tuple[float, float, float]) -> float:
    """The same rollouts' decode loop without drafts under the same cost model (a step a token, the
    longest response setting the steps). Its ratio to loop_ms is the decode loops' speedup on the machine
    the cost was fitted on; the prefill, request intake and outputs, the same in both, are left out, so
    a whole rollout's speedup is lower."""
    a, b, _ = cost
    return statistics.fmean(a * (r["plain_steps"] - 1) + b * r["plain_cost_requests"] for r in results)


if __name__ == "__main__":
    main()
