"""Plan the memory of one training step of a config, on fake tensors (no GPU, no weights needed).

The same as the `ldm-plan-memory` command (`ldm.cli.plan_memory`).
"""

from ldm.cli.plan_memory import main

if __name__ == "__main__":
    main()
