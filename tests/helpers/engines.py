"""The prompt and the sharpening of the tiny Llama (tests/integration/engines/conftest.py: `sharp_llama`) whose
engine tests see clear acceptance and rejection."""

from __future__ import annotations

import random


EOS = 1
SHARPEN = 12.0
PROMPT = [random.Random(0).randrange(3, 263) for _ in range(8)]
