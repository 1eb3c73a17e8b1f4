"""Compare engine weights and log-probs with the learner's after a resync: see megatron_specrl/diagnostics/check.py."""

import sys

from megatron_specrl.diagnostics.check import check_resync_main

if __name__ == "__main__":
    sys.exit(check_resync_main(sys.argv[1:]))
