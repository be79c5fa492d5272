"""Train a latent diffusion model: `python main.py -t -b config.yaml [key.path=value ...]`.

The same as the `ldm-train` command (`ldm.cli.train`); flags as in CompVis `main.py`.
"""

import sys

from ldm.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
