"""Convert weights between an original SD single file, a diffusers folder and our checkpoints, without training.

The same as the `ldm-convert` command (`ldm.cli.convert`).
"""

from ldm.cli.convert import main

if __name__ == "__main__":
    main()
