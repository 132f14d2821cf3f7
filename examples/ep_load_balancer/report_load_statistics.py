"""Per-layer expert-load statistics of a recorded run (same as `jaxllm eplb report`).

python examples/ep_load_balancer/report_load_statistics.py --expert_statistic_path $EXPERT_STATISTIC_PATH
"""

import sys

from sharding.eplb.cli import main

if __name__ == "__main__":
    sys.exit(main(["report", *sys.argv[1:]]))
