"""Where the repository is, for tests that read its recipes, docs and scripts."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
