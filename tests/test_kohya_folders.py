"""kohya-ss/sd-scripts concept folders (`10_sks dog/`): repeats per epoch, folder-name captions, `.caption` files."""

from __future__ import annotations

import collections
import contextlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from ldm.data import DataModule
from ldm.data.folder import BAD_SAMPLES, FolderDataset


def image(path: Path, caption: str | None = None, extension: str = ".txt", seed: int = 0) -> Path:
    """A random 16 px RGB image at `path`, with a caption file next to it when `caption` is given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(path)
    if caption is not None:
        path.with_suffix(extension).write_text(caption + "\n")
    return path


def kohya_folder(root: Path) -> Path:
    """`10_sks dog/`: one image captioned by a .caption file, one by the folder's name; `5_style/`: three .txt."""
    image(root / "10_sks dog" / "a.png", "sks dog on a beach", ".caption", seed=1)
    image(root / "10_sks dog" / "b.png", seed=2)
    for i in range(3):
        image(root / "5_style" / f"s{i}.png", f"style {i}", seed=10 + i)
    (root / "logs").mkdir()  # a subfolder without images plays no part
    return root


def test_repeats_make_the_epoch_and_folder_names_caption(tmp_path, caplog):
    with caplog.at_level("INFO", logger="ldm.data.folder"):
        data = FolderDataset(kohya_folder(tmp_path / "train"), size=8)
    assert len(data.examples) == 5 and len(data) == 2 * 10 + 3 * 5
    assert dict((p.name, c) for p, c in data.examples) == {
        "a.png": "sks dog on a beach", "b.png": "sks dog", "s0.png": "style 0", "s1.png": "style 1",
        "s2.png": "style 2",
    }  # fmt: skip
    assert (
        "data: 2 concept folder(s) (10_sks dog: 2 images x 10, 1 captioned 'sks dog' by the folder name; "
        "5_style: 3 images x 5), 35 examples per epoch" in caplog.text
    )
    dm = DataModule(data, batch_size=4, shuffle=True, seed=3)
    dm.setup("fit")
    served = collections.Counter(c for batch in dm.train_dataloader() for c in batch["caption"])
    assert served == {"sks dog on a beach": 10, "sks dog": 10, "style 0": 5, "style 1": 5, "style 2": 5}


def test_caption_files_txt_and_caption(tmp_path, caplog):
    root = tmp_path / "plain"
    image(root / "a.png", "from caption", ".caption")
    image(root / "b.png", "from txt", ".txt")
    image(root / "c.png", "txt wins", ".txt")
    (root / "c.caption").write_text("caption loses\n")
    with caplog.at_level("INFO", logger="ldm.data.folder"):
        captions = {p.stem: c for p, c in FolderDataset(root, size=8).examples}
    assert captions == {"a": "from caption", "b": "from txt", "c": "txt wins"}
    assert f"1 image(s) in {root} have more than one caption file (first: {root / 'c.png'}); each reads its .txt" in (
        caplog.text
    )
    captions = {p.stem: c for p, c in FolderDataset(root, size=8, caption_extension=".caption").examples}
    assert captions == {"a": "from caption", "b": "from txt", "c": "caption loses"}


def test_plain_nested_folders_are_served_once_each(tmp_path, caplog):
    root = tmp_path / "photos"
    image(root / "cats" / "a.png", "a cat")
    image(root / "cats" / "2023_summer" / "b.png", "a cat in summer")
    image(root / "c.png", "at the root")
    with caplog.at_level("INFO", logger="ldm.data.folder"):
        data = FolderDataset(root, size=8)
    assert len(data) == len(data.examples) == 3
    assert f"data: {root / 'cats' / '2023_summer'} looks like a kohya concept folder, but only immediate" in (
        caplog.text
    )
    assert "concept folder(s)" not in caplog.text


def test_a_dataset_folder_one_level_up_gets_a_hint(tmp_path, caplog):
    root = kohya_folder(tmp_path / "dataset" / "img").parent
    with caplog.at_level("WARNING", logger="ldm.data.folder"):
        assert len(FolderDataset(root, size=8)) == 5
    assert f"set data.params.root: {root / 'img'} to use its repeat count" in caplog.text


def test_images_outside_concept_folders_are_an_error_unless_plain(tmp_path):
    root = kohya_folder(tmp_path / "mixed")
    image(root / "extra" / "x.png", "extra")
    with pytest.raises(ValueError, match=r"^root: .*mixed has kohya concept folders .* and images outside them "
                       r"\(.*extra\), which would have no repeat count; move those into a concept folder"):  # fmt: skip
        FolderDataset(root, size=8)
    plain = FolderDataset(root, size=8, layout="plain")
    assert len(plain) == len(plain.examples) == 6
    assert {c for _, c in plain.examples} >= {"sks dog on a beach", ""}, "no folder-name captions when plain"
    (root / "extra" / "x.png").unlink()
    image(root / "loose.png", "at the root")
    with pytest.raises(ValueError, match=r"images outside them \(.*loose.png\)"):
        FolderDataset(root, size=8, layout="kohya")
    (root / "loose.png").unlink()
    image(root / "0_off" / "y.png")
    with pytest.raises(ValueError, match=r"0_off serves its images 0 times an epoch; name it `1_off` or more"):
        FolderDataset(root, size=8)


def test_layout_kohya_needs_concept_folders_and_metadata_keeps_precedence(tmp_path, caplog):
    root = tmp_path / "hf"
    image(root / "a.png", "a")
    with pytest.raises(ValueError, match=r"^root: no immediate subfolder of .* is named `<repeats>_<name>`"):
        FolderDataset(root, size=8, layout="kohya")
    kohya_folder(root)
    (root / "a.png").unlink()
    (root / "metadata.jsonl").write_text('{"file_name": "10_sks dog/b.png", "text": "from metadata"}\n')
    with caplog.at_level("WARNING", logger="ldm.data.folder"):
        data = FolderDataset(root, size=8)
    assert len(data) == 1 and data[0]["caption"] == "from metadata"
    assert "lists the examples, once each; the repeat counts of its concept folders (10_sks dog, 5_style)" in (
        caplog.text
    )
    with pytest.raises(ValueError, match=r"metadata.jsonl lists the examples, so the concept folders"):
        FolderDataset(root, size=8, layout="kohya")


def test_a_repeated_bad_image_is_skipped_and_listed_once(tmp_path, monkeypatch):
    root = kohya_folder(tmp_path / "train")
    (root / "10_sks dog" / "b.png").write_bytes(b"")
    monkeypatch.setenv("LDM_RUN_DIR", str(tmp_path))
    data = FolderDataset(root, size=8)
    examples = [data[i] for i in range(len(data))]
    assert len(examples) == 35
    assert collections.Counter(e["caption"] for e in examples)["sks dog"] == 0, "replaced by the next image"
    assert len((tmp_path / BAD_SAMPLES).read_text().splitlines()) == 1
    assert data.bad == {1}


CPU = SimpleNamespace(root_device=torch.device("cpu"))  # the trainer's strategy: where caches are encoded


class FakeModel:
    """What the caches ask of the model: encode images and captions, counting what they were given."""

    trainable, training, text_parts = ("unet",), True, ("tokenizer", "text_encoder")

    def __init__(self) -> None:
        self.images, self.captions = 0, []

    def encode_posterior(self, pixels: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.images += len(pixels)
        return pixels.mean(dim=1, keepdim=True), None

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]:
        self.captions += captions
        return {"hidden": torch.tensor([[float(len(c))] for c in captions])}

    def configure_model(self) -> None: ...

    def networks_on(self, device: torch.device, names: tuple[str, ...]) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def eval(self) -> None: ...

    def train(self, mode: bool) -> None: ...


def test_caches_encode_each_repeated_image_and_caption_once(tmp_path):
    data = FolderDataset(kohya_folder(tmp_path / "train"), size=8)
    model = FakeModel()
    dm = DataModule(data, batch_size=5, cache_latents=True, cache_text=True, shuffle=False)
    dm.trainer = SimpleNamespace(lightning_module=model, global_rank=0, world_size=1, strategy=CPU)
    dm.setup("fit")
    assert model.images == 5 and sorted(model.captions) == sorted({c for _, c in data.examples} | {""})
    assert len(dm.dataset) == 35
    served = [(batch["caption"], batch["latents"], batch["cond"]["hidden"]) for batch in dm.train_dataloader()]
    captions = [c for caps, _, _ in served for c in caps]
    assert collections.Counter(captions) == {c: 10 if "sks" in c else 5 for _, c in data.examples}
    lengths = torch.cat([hidden for _, _, hidden in served]).flatten().tolist()
    assert lengths == [float(len(c)) for c in captions], "each index's cached caption is its own"
    latents = torch.cat([latent for _, latent, _ in served])
    for i, caption in enumerate(captions):  # each repeat serves its image's one latent
        torch.testing.assert_close(latents[i], latents[captions.index(caption)])


def test_one_step_of_training_on_a_kohya_folder(tiny_sd, tmp_path):
    from tests.helpers import finetune_args, train_once

    logdir = tmp_path / "logs"
    argv = finetune_args(tiny_sd, kohya_folder(tmp_path / "train"), logdir, "lightning.callbacks.image_logger=null",
                         "lightning.trainer.max_steps=1", "data.params.cache_latents=true")  # fmt: skip
    log = (train_once(argv, logdir) / "train.log").read_text()
    assert "data: 2 concept folder(s) (10_sks dog: 2 images x 10" in log
    assert "cache_latents: encoded 5 images once" in log
