"""scripts/precompute.py: a folder's images encoded once into MDS shards, as the model encodes them; bad files
skipped and listed; a stopped run continues where it stopped; two processes write what one writes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import streaming
import torch

from ldm.cli.precompute import main
from ldm.config import instantiate
from ldm.data.folder import BAD_SAMPLES, FolderDataset
from ldm.data.shard_format import MANIFEST, read_unconditional
from ldm.training.run import prepare_config
from tests.conftest import REPO, write_images
from tests.helpers import SD_FOLDER, run_together


def overrides(tiny_sd, images) -> list[str]:
    return [f"model.params.pretrained={tiny_sd}", f"data.params.root={images}", "data.params.size=16",
            "data.params.num_workers=0"]  # fmt: skip


def precompute(tiny_sd, images, out, *flags) -> int:
    return main(["-b", str(SD_FOLDER), "--out", str(out), "--source", "photos", *flags, *overrides(tiny_sd, images)])


def read(out) -> dict[str, dict]:
    """Every sample of a shard folder, by key, as the streaming library reads it."""
    dataset = streaming.StreamingDataset(local=str(out), batch_size=1, shuffle=False)
    try:
        return {sample["key"]: sample for sample in (dataset[i] for i in range(len(dataset)))}
    finally:  # the library leaves its lock files in the temporary folder
        for lock in (dataset._shared_barrier.filelock_path, dataset._cache_filelock_path):
            Path(lock).unlink(missing_ok=True)


def assert_same_samples(a: dict[str, dict], b: dict[str, dict]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].keys() == b[key].keys()
        for column, value in a[key].items():
            if isinstance(value, np.ndarray):
                np.testing.assert_allclose(value, b[key][column], atol=2e-3, err_msg=f"{key} {column}")
            else:
                assert value == b[key][column], (key, column)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Five 24 x 20 images (wider than high) and a file that is not an image."""
    root = write_images(tmp_path_factory.mktemp("photos"), n=5, size=(24, 20))
    (root / "broken.png").write_bytes(b"not an image")
    return root


@pytest.fixture(scope="module")
def shards(tiny_sd, images, tmp_path_factory):
    """The images precomputed by one process, in chunks of 2."""
    out = tmp_path_factory.mktemp("shards") / "photos"
    assert precompute(tiny_sd, images, out, "--chunk-size", "2") == 0
    return out


def test_each_image_once_as_the_model_encodes_it(tiny_sd, images, shards):
    cfg, _ = prepare_config([str(SD_FOLDER)], overrides(tiny_sd, images), None)
    model = instantiate(cfg.model, "model")
    model.configure_model()
    model.eval()
    samples = read(shards)
    assert sorted(samples) == [f"img{i}.png" for i in range(5)]
    folder = FolderDataset(images, size=16)
    for index, (path, caption) in enumerate(folder.examples):
        if path.name == "broken.png":
            continue
        sample = samples[path.name]
        with torch.no_grad():
            mean, std = model.encode_posterior(folder.load(index, seed=0)["pixel_values"][None])
            cond = model.encode_text([caption])["encoder_hidden_states"][0]
        np.testing.assert_allclose(sample["latent_mean"], mean[0].numpy(), atol=2e-3, rtol=2e-3)
        np.testing.assert_allclose(sample["latent_std"], std[0].numpy(), atol=2e-3, rtol=2e-3)
        np.testing.assert_allclose(sample["cond_encoder_hidden_states"], cond.numpy(), atol=2e-3, rtol=2e-3)
        assert sample["caption"] == caption and sample["source"] == "photos"
        # 24 x 20 resized to 19 x 16, its centre 16 x 16 one pixel in from the left
        assert sample["original_size"].tolist() == [20, 24] and sample["crop_top_left"].tolist() == [0, 1]
    manifest = json.loads((shards / MANIFEST).read_text())
    assert (manifest["source"], manifest["count"], manifest["skipped"]) == ("photos", 5, 1)
    assert manifest["cond_shapes"] == {"encoder_hidden_states": [77, 32]} and manifest["latent_shape"] == [4, 8, 8]
    assert manifest["scaling_factor"] == model.latent_scale and manifest["resolution"] == [16, 16]
    assert "_name_or_path" not in manifest["encoders"]["vae"]["config"], "where the VAE was loaded from is no part"
    with torch.no_grad():
        empty = model.encode_text([""])["encoder_hidden_states"][0]
    torch.testing.assert_close(read_unconditional(shards)["encoder_hidden_states"], empty)


def test_bad_files_are_skipped_and_listed(images, shards):
    (line,) = (shards / BAD_SAMPLES).read_text().splitlines()
    path, reason = line.split("\t")
    assert path == str(images / "broken.png") and "not a usable image" in reason


def test_a_kohya_folders_repeats_are_encoded_once(tiny_sd, tmp_path):
    concept = write_images(tmp_path / "images" / "3_sks dog", n=2)
    for caption in concept.glob("*.txt"):
        caption.unlink()
    assert precompute(tiny_sd, tmp_path / "images", tmp_path / "photos") == 0
    samples = read(tmp_path / "photos")
    assert sorted(samples) == ["3_sks dog/img0.png", "3_sks dog/img1.png"]
    assert {sample["caption"] for sample in samples.values()} == {"sks dog"}


def test_a_stopped_precompute_continues_where_it_stopped(tiny_sd, images, shards, tmp_path, monkeypatch, capsys):
    import ldm.data.precompute as module

    out, rows, to_row = tmp_path / "photos", [], module.to_row

    def stop_in_the_second_chunk(*args):
        rows.append(args)
        if len(rows) == 3:
            raise KeyboardInterrupt
        return to_row(*args)

    monkeypatch.setattr(module, "to_row", stop_in_the_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        precompute(tiny_sd, images, out, "--chunk-size", "2")
    monkeypatch.undo()
    assert (out / "chunk-00000" / "index.json").is_file() and not (out / "chunk-00001").exists()
    shutil.copytree(out / "chunk-00000", out / "chunk-00002")  # as a kill -9 leaves a chunk: without its index
    (out / "chunk-00002" / "index.json").unlink()
    capsys.readouterr()
    assert precompute(tiny_sd, images, out, "--chunk-size", "2") == 0
    assert_same_samples(read(out), read(shards))
    assert "precompute: 4 examples encoded, 0 skipped" in capsys.readouterr().out, (
        "chunk 0 (and its bad file) not redone"
    )
    assert precompute(tiny_sd, images, out, "--chunk-size", "2") == 0
    assert "precompute: 0 examples encoded" in capsys.readouterr().out, "a finished folder is only re-indexed"
    assert json.loads((out / MANIFEST).read_text())["count"] == 5


@pytest.mark.exclusive
def test_two_processes_write_what_one_writes(tiny_sd, images, shards, tmp_path):
    out = tmp_path / "photos"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, str(REPO / "scripts" / "precompute.py"), "-b", str(SD_FOLDER), "--out", str(out),
               "--chunk-size", "2", *overrides(tiny_sd, images)]  # fmt: skip
    world = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(REPO),
                 CUDA_VISIBLE_DEVICES="")  # fmt: skip
    envs = [{**world, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(2)]
    for done in run_together([command] * 2, envs, timeout=120):
        assert done.returncode == 0, done.stderr
    assert_same_samples(read(out), read(shards))
    assert (out / BAD_SAMPLES).read_text() == (shards / BAD_SAMPLES).read_text()


def test_refuses_other_folders_and_sources(tiny_sd, images, shards, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["-b", str(SD_FOLDER), "--out", str(tmp_path), *overrides(tiny_sd, images)]) == 2
    assert "is not empty and holds no precompute output" in capsys.readouterr().err
    assert main(["-b", str(SD_FOLDER), "--out", str(shards), "--source", "x", *overrides(tiny_sd, images)]) == 2
    assert f"--out: {shards} holds shards of another source 'photos'; pass --source photos" in capsys.readouterr().err
    user_data = tmp_path / "user-data.yaml"
    user_data.write_text(
        f"model: {{target: ldm.models.diffusion.ddpm.LatentDiffusion, params: {{pretrained: {tiny_sd}}}}}\n"
        "data: {target: tests.helpers.UserDataModule, params: {size: 16}}\n"
    )
    assert main(["-b", str(user_data), "--out", str(tmp_path / "new")]) == 2
    assert "data.target: tests.helpers.UserDataModule is not an ldm.data.DataModule" in capsys.readouterr().err


def test_the_rate_counts_the_time_spent_encoding(tiny_sd, images, tmp_path, monkeypatch):
    from ldm.systems.latent_diffusion import LatentDiffusion

    encode = LatentDiffusion.encode_posterior

    def slow(self, pixels):
        time.sleep(0.2)
        return encode(self, pixels)

    monkeypatch.setattr(LatentDiffusion, "encode_posterior", slow)
    assert precompute(tiny_sd, images, tmp_path / "photos", "--chunk-size", "2", "--batch-size", "2") == 0
    manifest = json.loads((tmp_path / "photos" / MANIFEST).read_text())
    assert manifest["seconds"] >= 3 * 0.2, "three batches, each encoded in 0.2 s or more"
    assert manifest["images_per_second"] == pytest.approx(5 / manifest["seconds"])
