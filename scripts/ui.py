"""The local web app: plan, launch, watch and resume runs, read reports, sample, convert (`pip install -e .[ui]`).

The same as the `ldm-ui` command (`ldm.cli.ui`).
"""

import sys

from ldm.cli.ui import main

if __name__ == "__main__":
    sys.exit(main())
