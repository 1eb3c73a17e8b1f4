"""The resolve step: what a validated config's unset (auto) keys become, said once at start-up.

Validation (the pydantic validators of config/schema.py) only refuses what cannot run. The keys left unset
are filled by `RunConfig.resolve_auto` (load_config applies it; the rules are the schema's), and `resolve`
here, called where a run is assembled (the CLI's train, `train()`), checks what needs the package's
other modules (reward.name against rewards.py: the schema imports no module that imports it), logs
each chosen value once with why, and warns once for each experimental feature in use.

    cfg = load_config("tiny-cpu-grpo", ["rollout.draft=tree"])
    for key, value, why in resolve(cfg).choices: ...

`megatron-specrl train ... --dry-run` prints the same list.
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
    if r.engine == "sglang":
        out.append("rollout.engine=sglang is experimental: fewer features and checks than the vLLM engine")
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


def resolve(cfg: RunConfig, *, log_choices: bool = True) -> ResolvedChoices:
    """Fill `cfg`'s auto keys in place (nothing is left for a config from load_config), check
    reward.name, and return the choices; with `log_choices`, log them and the experimental features,
    once per config."""
    check_reward(cfg)
    out = ResolvedChoices(cfg.resolve_auto(), experimental_features(cfg))
    if log_choices and not cfg._reported:
        cfg._reported = True
        for line in out.lines():
            log.info("resolved %s", line)
        for line in out.experimental:
            log.warning("%s", line)
    return out
