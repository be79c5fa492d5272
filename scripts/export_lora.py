"""Export a LoRA: a checkpoint's adapters as a LoRA file (kohya's format by default, or diffusers'), or
(--merge) a full pipeline with them merged in; or merge a LoRA file into a pretrained model.

The same as the `ldm-export-lora` command (`ldm.cli.export_lora`).
"""

from ldm.cli.export_lora import main

if __name__ == "__main__":
    main()
