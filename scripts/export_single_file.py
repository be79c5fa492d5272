"""Export a checkpoint as one original-layout SD file (A1111, ComfyUI, diffusers' `from_single_file`).

The same as the `ldm-export-single-file` command (`ldm.cli.export_single_file`).
"""

from ldm.cli.export_single_file import main

if __name__ == "__main__":
    main()
