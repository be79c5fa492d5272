"""The families registry: each family's knowledge is in its module of `ldm.families`; generic code names none."""

import re
from pathlib import Path

from ldm.families import ARCHITECTURES, CONFIGS, FAMILIES, LAYOUTS, layout_of_keys

LDM = Path(__file__).resolve().parents[1] / "ldm"


def test_generic_code_names_no_family():
    """Outside `ldm/families/`, no module says `sdxl` nor holds a family's name as a string (a branch on it)."""
    names = "|".join(re.escape(name) for name in FAMILIES)
    quoted = re.compile(rf"""["']({names})["']""")
    offenders = []
    for path in sorted(LDM.rglob("*.py")):
        if path.is_relative_to(LDM / "families"):
            continue
        text = path.read_text()
        if re.search("sdxl", text, re.IGNORECASE) or quoted.search(text):
            offenders.append(str(path.relative_to(LDM.parent)))
    assert offenders == []


def test_every_family_has_its_architecture_layout_and_configs():
    for family in FAMILIES.values():
        architecture = ARCHITECTURES[family.architecture]
        assert family.text_layout is None or LAYOUTS[family.text_layout] in architecture.layouts
        for part in family.networks:
            assert (family.network_folder / part / "config.json").is_file(), (family.name, part)
        assert (family.folder / "scheduler" / "scheduler_config.json").is_file()
        if family.original_config is not None:
            assert (CONFIGS / "original" / family.original_config).is_file()


def test_a_files_layout_is_told_by_its_text_encoder_keys_or_its_own_denoiser():
    """A UNet layout by its text encoders' keys; a layout with a denoiser of its own (an MMDiT) by that denoiser's
    keys, since its files may hold no text encoder."""
    for layout in LAYOUTS.values():
        keys = [prefix + "x.weight" for _, prefix, _ in layout.text]
        assert layout_of_keys(["model.diffusion_model.conv_in.weight", *keys]) == layout.name
        if layout.denoiser is None:
            assert layout.detect_key.startswith(tuple(prefix for _, prefix, _ in layout.text))
        else:
            assert layout.detect_key.startswith("model.diffusion_model.")
            assert layout_of_keys([layout.detect_key, "first_stage_model.x.weight"]) == layout.name
