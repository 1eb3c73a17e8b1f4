"""Where the files the package reads beside its code are: the recipes (examples/: the YAML files, the
cluster models' shape-only config.json files, the sample data) and the GPU stack's version pins
(docker/constraints-gpu.txt). Every reader asks here, so a wheel works outside the checkout.

In the repository they stay where users see them; setup.py maps examples/ and docker/ into the wheel as
megatron_specrl/_data/examples and megatron_specrl/_data/docker (package data: one copy in git).
`shipped_path` takes the installed copy where there is one, else the checkout's: an editable install
and a run from the repository read the repository's files, a wheel its own.

The generated pages under docs/ do not ship: their writers (config.docs, metrics.keys) are developer
tools that rewrite a checkout's page (`CHECKOUT`, None in a wheel install, where they need --out).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

PACKAGE_DATA = "_data"   # setup.py's folder for examples/ and docker/ inside the installed package

_INSTALLED = Path(str(resources.files(__package__))) / PACKAGE_DATA
_ROOT = Path(__file__).resolve().parent.parent
# the repository this module sits in (setup.py beside the package), if any
CHECKOUT: Path | None = _ROOT if (_ROOT / "setup.py").is_file() else None


def shipped_path(rel: str) -> Path:
    """`rel` as the repository names it ("examples/tiny-cpu-grpo.yaml", "docker/constraints-gpu.txt"):
    the installed copy, else the checkout's. It may not exist (an unknown recipe): callers name it."""
    installed = _INSTALLED / rel
    if installed.exists() or CHECKOUT is None:
        return installed
    return CHECKOUT / rel


def recipe_file(rel: str) -> str:
    """A file a recipe names with `${shipped:examples/...}` (a cluster recipe's shape-only model and
    sample data): the path as written where it exists from the working directory (a checkout's root,
    the only place such a relative path worked before), else the shipped copy's."""
    return rel if Path(rel).exists() else str(shipped_path(rel))
