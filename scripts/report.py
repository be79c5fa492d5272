"""Write a run's report again: RUN/report.html (plots, sample grids, checkpoints, config; self-contained).

The same as the `ldm-report` command (`ldm.cli.report`).
"""

import sys

from ldm.cli.report import main

if __name__ == "__main__":
    sys.exit(main())
