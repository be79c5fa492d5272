"""A scraped folder: odd modes decode correctly, undecodable files are skipped (and listed) or stop the run."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from ldm.data.folder import BAD_SAMPLES, FolderDataset
from ldm.data.images import BadImage, decode_image


def pixel(example: dict) -> torch.Tensor:
    """The centre pixel of an example, back in 0..255."""
    values = example["pixel_values"]
    return ((values[:, values.shape[1] // 2, values.shape[2] // 2] + 1) * 127.5).round()


def test_modes_decode_to_what_the_pixels_mean(tmp_path, caplog):
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg", quality=100)  # pure red
    sixteen = np.full((8, 8), 65535 // 2, dtype=np.uint16)
    Image.fromarray(sixteen).save(tmp_path / "sixteen.png")  # mid grey at 16 bits
    Image.new("RGBA", (8, 8), (0, 0, 0, 0)).save(tmp_path / "clear.png")  # fully transparent black
    palette = Image.new("P", (8, 8), 0)
    palette.putpalette([0, 0, 255] + [0, 0, 0] * 255)
    palette.save(tmp_path / "palette.png")  # blue through a palette
    Image.new("RGB", (1, 1), (0, 255, 0)).save(tmp_path / "tiny.png")  # one green pixel
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° to display
    Image.new("RGB", (8, 4), (255, 255, 255)).save(tmp_path / "rotated.jpg", exif=exif)
    expected = {"cmyk": (255, 0, 0), "sixteen": (128, 128, 128), "clear": (255, 255, 255),
                "palette": (0, 0, 255), "tiny": (0, 255, 0)}  # fmt: skip
    with caplog.at_level("WARNING", logger="ldm.data.folder"):
        data = FolderDataset(tmp_path, size=4)
    assert f"6 of 6 images in {tmp_path} have no .txt caption; they train with an empty caption" in caplog.text
    assert {caption for _, caption in data.examples} == {""}
    names = [path.stem for path, _ in data.examples]
    for i, name in enumerate(names):
        if name in expected:
            assert torch.allclose(pixel(data[i]), torch.tensor(expected[name], dtype=torch.float32), atol=3), name
    assert decode_image(tmp_path / "rotated.jpg").size == (4, 8), "EXIF orientation applied"
    (tmp_path / "caption.txt").write_text("ein Bild von Köln 🐈\n", encoding="utf-8")
    (tmp_path / "caption.png").write_bytes((tmp_path / "tiny.png").read_bytes())
    captions = dict((p.stem, c) for p, c in FolderDataset(tmp_path, size=4).examples)
    assert captions["caption"] == "ein Bild von Köln 🐈"


def write_bad_files(root):
    """Five kinds of undecodable file, and two good images."""
    root.mkdir()
    good = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 20, 30)).save(good, "JPEG")
    (root / "a_truncated.jpg").write_bytes(good.getvalue()[: len(good.getvalue()) // 2])
    (root / "b_empty.png").write_bytes(b"")
    (root / "c_text.jpg").write_text("<html>not an image</html>")
    (root / "d_good.jpg").write_bytes(good.getvalue())
    Image.new("RGB", (64, 64)).save(root / "e_bomb.png")  # a bomb once the pixel limit is lowered
    Image.new("RGB", (16, 16), (200, 100, 50)).save(root / "f_good.png")
    return root


@pytest.fixture
def small_pixel_limit(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 64x64 = 4096 > 2x the limit: DecompressionBombError


def test_bad_files_are_skipped_listed_and_the_epoch_keeps_its_length(tmp_path, monkeypatch, small_pixel_limit):
    root = write_bad_files(tmp_path / "scraped")
    monkeypatch.setenv("LDM_RUN_DIR", str(tmp_path))
    data = FolderDataset(root, size=8)
    assert len(data) == 6
    examples = [data[i] for i in range(len(data))]
    assert len(examples) == 6 and all(e["pixel_values"].shape == (3, 8, 8) for e in examples)
    assert torch.equal(examples[0]["pixel_values"], examples[3]["pixel_values"]), (
        "a bad file is replaced by the next good one"
    )
    listed = (tmp_path / BAD_SAMPLES).read_text().splitlines()
    assert sorted(line.split("\t")[0].rsplit("/", 1)[1] for line in listed) == [
        "a_truncated.jpg", "b_empty.png", "c_text.jpg", "e_bomb.png",
    ]  # fmt: skip
    reasons = {line.split("\t")[0].rsplit("/", 1)[1]: line.split("\t")[1] for line in listed}
    assert "empty file" in reasons["b_empty.png"] and "decompression bomb" in reasons["e_bomb.png"].lower()
    data[0]
    assert len((tmp_path / BAD_SAMPLES).read_text().splitlines()) == 4, "each file is listed once"


def test_bad_files_stop_the_run_when_asked(tmp_path, small_pixel_limit):
    root = write_bad_files(tmp_path / "scraped")
    with pytest.raises(BadImage, match=r"a_truncated.jpg: not a usable image .*on_bad_sample: skip"):
        FolderDataset(root, size=8, on_bad_sample="error")  # the first file is bad: at setup already
    for name in ("a_truncated.jpg", "b_empty.png", "c_text.jpg"):
        (root / name).unlink()
    data = FolderDataset(root, size=8, on_bad_sample="error")
    assert data[0]["pixel_values"].shape == (3, 8, 8)
    with pytest.raises(BadImage, match=r"e_bomb.png: not a usable image"):
        data[1]
    with pytest.raises(ValueError, match="on_bad_sample: got 'ignore'; valid: skip, error"):
        FolderDataset(root, size=8, on_bad_sample="ignore")


def test_no_decodable_image_and_undecodable_captions(tmp_path):
    root = tmp_path / "junk"
    root.mkdir()
    (root / "x.png").write_bytes(b"")
    with pytest.raises(BadImage, match="none of the 1 images"):
        FolderDataset(root, size=8)  # at setup, before any training
    Image.new("RGB", (8, 8)).save(root / "y.png")
    (root / "y.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=r"y.txt: caption is not UTF-8 text"):
        FolderDataset(root, size=8)


def test_a_run_with_bad_files_in_worker_processes_trains_and_says_so(tiny_sd, tmp_path):
    from tests.helpers import finetune_args, train_once

    root = write_bad_files(tmp_path / "scraped")
    (root / "e_bomb.png").unlink()  # the pixel limit is not lowered in the worker processes
    logdir = tmp_path / "logs"
    argv = finetune_args(tiny_sd, root, logdir, "data.params.num_workers=2", "lightning.callbacks.image_logger=null")
    run_dir = train_once(argv, logdir)
    listed = sorted(line.split("\t")[0].rsplit("/", 1)[1] for line in (run_dir / BAD_SAMPLES).read_text().splitlines())
    assert set(listed) == {"a_truncated.jpg", "b_empty.png", "c_text.jpg"}
    log = (run_dir / "train.log").read_text()
    assert "data: skipping" in log
    assert (
        f"data: 3 undecodable file(s) skipped so far in this run, each replaced by the next image; listed in {run_dir}"
        in log
    )
