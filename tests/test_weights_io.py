"""One detect() of weight formats; atomic publishing: a file appears whole or not at all, with the umask mode."""

import os

import pytest

from ldm.utils.atomic import atomic_path, honour_umask, verify
from ldm.weights.formats import COLOSSAL_FILES, Format, detect, is_our_checkpoint


def test_detect_tells_formats_by_content_not_name(tiny_sd, tmp_path):
    assert detect(tiny_sd) is Format.DIFFUSERS
    colossal = tmp_path / "step-000010.ckpt"
    (colossal / COLOSSAL_FILES["model"]).mkdir(parents=True)
    (colossal / COLOSSAL_FILES["trainer"]).write_bytes(b"")
    assert detect(colossal) is Format.COLOSSAL
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert detect(tmp_path / "weights.bin") is Format.FILE
    assert detect(tiny_sd / "unet") is Format.OTHER_FOLDER
    assert detect(tmp_path / "nothing") is Format.MISSING
    ours = {"ldm": {"parts": {"unet": {}}}, "state_dict": {"unet.conv_in.weight": 0}}
    single_file = {"ldm": {"parts": {"unet": {}}}, "state_dict": {"model.diffusion_model.out.2.weight": 0}}
    assert is_our_checkpoint(ours) and not is_our_checkpoint(single_file)


def test_atomic_path_publishes_whole_files_with_the_umask_mode(tmp_path):
    target = tmp_path / "out" / "model.safetensors"
    umask = os.umask(0o022)
    try:
        with atomic_path(target, checksum=True) as partial:
            partial.write_bytes(b"weights")
            assert not target.exists()
    finally:
        os.umask(umask)
    assert target.read_bytes() == b"weights"
    assert oct(target.stat().st_mode & 0o777) == oct(0o644)
    assert verify(target) is None
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.safetensors", "model.safetensors.sha256"]

    with pytest.raises(OSError, match="disk full"):
        with atomic_path(target) as partial:
            partial.write_bytes(b"half")
            raise OSError("disk full")
    assert target.read_bytes() == b"weights", "a failed write leaves the published file as it was"
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.safetensors", "model.safetensors.sha256"]


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["umask-022", "umask-077"])
def test_honour_umask_gives_a_written_tree_the_modes_of_new_files(tmp_path, umask):
    """What libraries leave owner-only (temporary files, `mkdtemp` folders) gets the modes the umask gives."""
    tree = tmp_path / "tree"
    (tree / "unet").mkdir(parents=True)
    (tree / "unet" / "weights.safetensors").write_bytes(b"w")
    (tree / "model_index.json").write_text("{}")
    (tree / "link").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_bytes(b"not ours")
    for path, mode in [(tree, 0o700), (tree / "unet", 0o700), (tree / "unet" / "weights.safetensors", 0o600)]:
        os.chmod(path, mode)
    os.chmod(tmp_path / "elsewhere", 0o640)
    previous = os.umask(umask)
    try:
        honour_umask(tree)
    finally:
        os.umask(previous)
    found = {p.name: oct(p.stat().st_mode & 0o777) for p in [tree, *tree.rglob("*")] if not p.is_symlink()}
    assert found == {
        "tree": oct(0o777 & ~umask),
        "unet": oct(0o777 & ~umask),
        "weights.safetensors": oct(0o666 & ~umask),
        "model_index.json": oct(0o666 & ~umask),
    }
    assert (tmp_path / "elsewhere").stat().st_mode & 0o777 == 0o640, "a link is not followed out of the tree"
