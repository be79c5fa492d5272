"""Export a LoRA checkpoint: the adapters for diffusers, or (--merge) a full pipeline with them merged in.

The same as the `ldm-export-lora` command (`ldm.cli.export_lora`).
"""

from ldm.cli.export_lora import main

if __name__ == "__main__":
    main()
