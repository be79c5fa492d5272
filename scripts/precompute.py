"""Encode a configured dataset once into MDS shards to train from (`ldm.data.precompute`).

The same as the `ldm-precompute` command (`ldm.cli.precompute`).
"""

import sys

from ldm.cli.precompute import main

if __name__ == "__main__":
    sys.exit(main())
