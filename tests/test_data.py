"""Folder data, caption sources, transforms, and the resumable sampler."""

import pytest
import torch

from examples.digits.data import DigitsDataset
from ldm.data import DataModule, ResumableSampler
from ldm.data.folder import FolderDataset
from tests.conftest import write_images


def test_txt_captions_and_transforms(image_folder):
    ds = FolderDataset(image_folder, size=16, random_crop=True, flip=True)
    assert len(ds) == 6
    example = ds[2]
    assert example["caption"] == "a photo of thing 2"
    assert example["pixel_values"].shape == (3, 16, 16)
    assert -1.0 <= example["pixel_values"].min() < example["pixel_values"].max() <= 1.0
    torch.testing.assert_close(ds.get(2, seed=5)["pixel_values"], ds.get(2, seed=5)["pixel_values"])
    assert FolderDataset(image_folder, size=8, channels=1)[0]["pixel_values"].shape == (1, 8, 8)


def test_metadata_jsonl(tmp_path):
    root = write_images(tmp_path / "hf", n=3, metadata=True)
    ds = FolderDataset(root, size=8)
    assert [ds[i]["caption"] for i in range(3)] == [f"metadata caption {i}" for i in range(3)]
    (root / "metadata.jsonl").write_text('{"file_name": "img0.png", "text": "ok"}\n{"text": "no file"}\n')
    with pytest.raises(ValueError, match=r"metadata.jsonl:2: expected"):
        FolderDataset(root, size=8)


def test_center_crop_keeps_the_middle(tmp_path):
    from PIL import Image

    root = tmp_path / "stripes"
    root.mkdir()
    image = Image.new("RGB", (30, 10), "black")
    image.paste((255, 255, 255), (10, 0, 20, 10))  # white middle third
    image.save(root / "a.png")
    pixels = FolderDataset(root, size=10)[0]["pixel_values"]
    assert pixels.shape == (3, 10, 10) and pixels.min() > 0.9


def test_empty_folder_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no images"):
        FolderDataset(tmp_path, size=8)


def test_sampler_resumes_mid_epoch_exactly():
    full = ResumableSampler(10, batch_size=3, shuffle=True, seed=7, caption_dropout=0.5, rank=0, world_size=1)
    full.set_epoch(2)
    everything = list(full)
    assert sorted(i for i, _, _ in everything) == list(range(10))
    resumed = ResumableSampler(10, batch_size=3, shuffle=True, seed=7, caption_dropout=0.5, rank=0, world_size=1)
    resumed.resume(epoch=2, batches_done=2)
    resumed.set_epoch(2)
    assert list(resumed) == everything[6:]
    assert list(resumed) == everything, "the skip applies once; the next pass of that epoch is whole"
    resumed.set_epoch(3)
    assert [i for i, _, _ in resumed] != [i for i, _, _ in everything], "each epoch shuffles differently"
    assert 0 < sum(d for _, d, _ in everything) < 10


def test_sampler_shards_by_rank():
    shards = [list(ResumableSampler(10, 2, True, 0, 0.0, rank, 2)) for rank in range(2)]
    assert not {i for i, _, _ in shards[0]} & {i for i, _, _ in shards[1]}
    assert len(shards[0]) == len(shards[1]) == 5


def test_datamodule_caption_dropout_and_loader():
    dm = DataModule({"target": "examples.digits.data.DigitsDataset", "params": {"split": "test"}}, batch_size=16,
                    caption_dropout=1.0)  # fmt: skip
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["pixel_values"].shape == (16, 1, 32, 32)
    assert batch["caption"] == [""] * 16
    with pytest.raises(ValueError, match="caption_dropout"):
        DataModule(dm.dataset_spec, caption_dropout=1.5)


def test_drop_last_serves_only_full_batches_and_refuses_a_dataset_smaller_than_one():
    from ldm.config import ConfigError

    spec = {"target": "examples.digits.data.DigitsDataset", "params": {"split": "test"}}  # 180 digits
    sizes = {}
    for drop_last in (False, True):
        dm = DataModule(spec, batch_size=64, drop_last=drop_last)
        dm.setup("fit")
        sizes[drop_last] = [len(batch["caption"]) for batch in dm.train_dataloader()]
    assert sizes == {False: [64, 64, 52], True: [64, 64]}
    dm = DataModule(spec, batch_size=256, drop_last=True)
    dm.setup("fit")
    with pytest.raises(ConfigError, match="data.params.drop_last: each process gets 180 examples, fewer than one"):
        dm.train_dataloader()


def test_digits():
    ds = DigitsDataset()
    assert len(ds) == 1797 and len(DigitsDataset(split="test")) == 180
    assert ds[0]["caption"] == "a handwritten digit 0"
    assert ds[0]["pixel_values"].shape == (1, 32, 32)


class CountTextEncoderCalls(__import__("lightning.pytorch", fromlist=["Callback"]).Callback):
    """Count the text encoder's forward calls during the training batches, into `path`."""

    def __init__(self, path: str) -> None:
        from pathlib import Path

        self.path, self.calls = Path(path), 0

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.text_encoder.register_forward_hook(lambda *args: setattr(self, "calls", self.calls + 1))

    def on_train_end(self, trainer, pl_module) -> None:
        self.path.write_text(str(self.calls))


def test_cached_latents_and_text_train_exactly_as_encoding_every_step(tiny_sd, image_folder, tmp_path):
    from tests.helpers import finetune_args, train_once

    def losses(name: str, *extra: str) -> tuple[list[float], int]:
        logdir, rec, calls = tmp_path / name, tmp_path / f"{name}.jsonl", tmp_path / f"{name}.calls"
        train_once(finetune_args(tiny_sd, image_folder, logdir, "lightning.callbacks.image_logger=null",
                                 "data.params.flip=false", "data.params.caption_dropout=0.5",
                                 "lightning.trainer.max_steps=4", "lightning.callbacks.ema=null",
                                 "lightning.callbacks.rec.target=tests.helpers.RecordLosses",
                                 f"lightning.callbacks.rec.params.path={rec}",
                                 "lightning.callbacks.count.target=tests.test_data.CountTextEncoderCalls",
                                 f"lightning.callbacks.count.params.path={calls}", *extra), logdir)  # fmt: skip
        import json

        return [json.loads(line)["loss"] for line in rec.read_text().splitlines()], int(calls.read_text())

    every_step, calls = losses("every_step")
    cached, cached_calls = losses("cached", "data.params.cache_latents=true", "data.params.cache_text=true")
    assert calls == 4 and cached_calls == 0, "the text encoder runs each step, or never once cached"
    torch.testing.assert_close(torch.tensor(cached), torch.tensor(every_step), rtol=1e-5, atol=1e-6)
    # Both drew each step's latent from the VAE posterior; training on its mean instead is another run.
    means, _ = losses("means", "data.params.cache_latents=true", "model.params.sample_latents=false")
    assert not torch.allclose(torch.tensor(means), torch.tensor(every_step), rtol=1e-3, atol=0)


def test_cache_text_refuses_a_training_text_encoder(tiny_sd, image_folder, tmp_path, capsys):
    from main import main
    from tests.helpers import finetune_args

    argv = finetune_args(tiny_sd, image_folder, tmp_path / "logs", "lightning.callbacks.image_logger=null",
                         "data.params.cache_text=true", "model.params.trainable=[unet,text_encoder]")  # fmt: skip
    assert main(argv) == 2
    assert "data.params.cache_text: the text encoder trains" in capsys.readouterr().err
