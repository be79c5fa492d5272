"""Export a checkpoint as a diffusers pipeline folder: `python scripts/export_diffusers.py --ckpt CKPT --out DIR`.

The same as the `ldm-export-diffusers` command (`ldm.cli.export_diffusers`).
"""

from ldm.cli.export_diffusers import main

if __name__ == "__main__":
    main()
