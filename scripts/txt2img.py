"""Generate images from a checkpoint or an exported pipeline folder.

The same as the `ldm-txt2img` command (`ldm.cli.txt2img`).
"""

from ldm.cli.txt2img import main

if __name__ == "__main__":
    main()
