"""The resolve step: a loaded config becomes the one config a run reads, resolved and frozen, once.

Validation (the pydantic validators of config/schema.py) only refuses what cannot run. `resolve` here
turns a validated config into the run's: the keys left unset (auto) filled by `RunConfig.resolve_auto`
(load_config filled them already; the rules are the schema's), reward.name checked against rewards.py
(the schema imports no module that imports it), and the result frozen, so the CLI's --dry-run, train(),
build_run and the engine factory all read the same values and none re-resolves. It is pure: it builds,
downloads and starts nothing, so --dry-run runs it too. What does build, rollout.draft_model's directory
(a tiny draft model is built and warmed up), is located once at run assembly (run/build.prepare_model),
which puts the directory into the frozen config that Run.cfg holds.

    cfg = resolve(load_config("tiny-cpu-grpo", ["rollout.draft=tree"]))
    for key, value, why in resolved_choices(cfg).choices: ...

train() logs those choices once (log_resolved); `megatron-specrl train ... --dry-run` prints the same list.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from megatron_specrl.config import Choice, ConfigError, RunConfig

log = logging.getLogger(__name__)


@dataclass
class ResolvedChoices:
    """The auto values a run uses (key, value, why) and its experimental features (one line each)."""
    choices: list[Choice] = field(default_factory=list)
    experimental: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [f"{c.key}={_text(c.value)}  ({c.why})" for c in self.choices]

    def as_dict(self) -> dict:
        return {c.key: c.value for c in self.choices}


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def experimental_features(cfg: RunConfig) -> list[str]:
    """One line per experimental feature the config turns on (their descriptions say Experimental)."""
    r, out = cfg.rollout, []
    if r.spec_mode == "coupled":
        out.append("rollout.spec_mode=coupled is experimental: the policy is trained on the noise it is then "
                   "sampled with")
    if cfg.trainer.overlap == "exact":
        out.append("trainer.overlap=exact is experimental: the batch generated ahead is refreshed under the new "
                   "weights before it is trained")
    if r.runahead:
        out.append(f"rollout.runahead={r.runahead} is experimental: its requests only feed the draft trees")
    if r.draft == "model":
        out.append("rollout.draft=model is experimental: the draft model's weights stay fixed while the policy "
                   "trains (watch draft_model/accept_rate)")
    return out


def check_reward(cfg: RunConfig) -> None:
    """reward.name must name a known reward function (a built-in, a registered name or a dotted path)."""
    name = cfg.reward.name
    if name is None:
        return
    from megatron_specrl.rewards import UnknownRewardError, get_reward
    try:
        get_reward(name)
    except UnknownRewardError as e:
        raise ConfigError(f"invalid value for 'reward.name': {name!r} (Value error, {e})") from None


def resolve(cfg: RunConfig) -> RunConfig:
    """The resolve step: check reward.name and return a frozen copy of `cfg` with its auto keys filled
    (nothing is left to fill in a config from load_config; one built with RunConfig.model_validate gets
    them here). Called once per run: by the CLI's train, or by train() when handed a loaded config."""
    check_reward(cfg)
    out = cfg.model_copy(deep=True)
    out.resolve_auto()
    out._freeze()
    return out


def resolved_choices(cfg: RunConfig) -> ResolvedChoices:
    """What the resolve step chose for `cfg`'s auto keys and the experimental features it turns on: the
    lines train() logs and --dry-run prints."""
    return ResolvedChoices(cfg.auto_chosen, experimental_features(cfg))


def log_resolved(cfg: RunConfig) -> None:
    """Log each auto value with why, and warn for each experimental feature: train() calls it once."""
    report = resolved_choices(cfg)
    for line in report.lines():
        log.info("resolved %s", line)
    for line in report.experimental:
        log.warning("%s", line)
