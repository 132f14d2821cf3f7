"""Expert placement YAML from a recorded run (same as `jaxllm eplb generate-config`).

    python examples/ep_load_balancer/generate_eplb_config.py --ep_size 8 --num_slots 80 \
        --expert_statistic_path $EXPERT_STATISTIC_PATH --output_path ./moe_load_balancer.yaml
"""

import sys

from sharding.eplb.cli import main

if __name__ == "__main__":
    sys.exit(main(["generate-config", *sys.argv[1:]]))
