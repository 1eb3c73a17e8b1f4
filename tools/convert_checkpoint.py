#!/usr/bin/env python
"""HF <-> Megatron dist checkpoint conversion (same as `megatron-specrl convert`).

  python tools/convert_checkpoint.py hf-to-mcore --hf DIR --out CKPT --tp 2 --pp 2
  python tools/convert_checkpoint.py mcore-to-hf --ckpt CKPT --out DIR
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_specrl.learner.convert import convert_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(convert_main(sys.argv[1:]))
