"""Shared fixtures: a tiny SD-shaped pipeline folder and a folder of captioned images, made locally."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
JUDGE_CACHE = "LDM_JUDGE_CACHE"  # examples.digits.judge reads it; not imported here, before the tests' imports
MODULE_SCOPES = ("module", "class", "package")


def pytest_configure(config: pytest.Config) -> None:
    """The digit judge is trained once per session and read back by every test and command that needs it
    (`LDM_JUDGE_CACHE`, a folder the controller makes and its workers inherit). Under pytest-xdist (`make test`
    runs `-n 2`) each worker computes on one thread, and so do the commands its tests start: two workers on two
    cores, instead of each asking for every core."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        if config.getoption("dist", "no") == "loadgroup" and _loadgroup_ignored():
            raise pytest.UsageError(
                f"pytest {pytest.__version__} with pytest-xdist {_xdist_version()} ignores --dist loadgroup's groups "
                "(pytest-xdist#1386): the exclusive tests would run at once; install pytest<9.2 (setup.py's dev extra)"
            )
        os.environ[JUDGE_CACHE] = tempfile.mkdtemp(prefix="ldm-judges-")
    else:
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def _xdist_version() -> str:
    from importlib.metadata import version

    return version("pytest-xdist")


def _loadgroup_ignored() -> bool:
    """pytest 9.2 stopped honouring the test ids pytest-xdist (up to 3.8) rewrites to name a test's group."""
    from packaging.version import Version

    return Version(pytest.__version__) >= Version("9.2") and Version(_xdist_version()) <= Version("3.8.0")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = os.environ.pop(JUDGE_CACHE, None)  # none if configure stopped the run
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


def pytest_itemcollected(item: pytest.Item) -> None:
    """Groups for `--dist loadgroup`, given as each test is collected (xdist reads them when collection ends): the
    tests marked `exclusive` (several ranks, or streaming shards) run one after another on one worker, never two
    such jobs at once; the tests of a module that share a module-scoped fixture run on one worker, which builds it
    once. Every other test goes to whichever worker is free."""
    if item.get_closest_marker("exclusive"):
        item.add_marker(pytest.mark.xdist_group("exclusive"))
        return
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    if any(d.scope in MODULE_SCOPES for fixturedefs in defs for d in fixturedefs):
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory) -> Path:
    from examples.tiny_sd import write_tiny_sd

    return write_tiny_sd(tmp_path_factory.mktemp("tiny-sd"))


@pytest.fixture(scope="session")
def tiny_sdxl(tmp_path_factory) -> Path:
    from examples.tiny_sd import write_tiny_sdxl

    return write_tiny_sdxl(tmp_path_factory.mktemp("tiny-sdxl"))


@pytest.fixture(scope="session")
def tiny_sd35_medium(tmp_path_factory) -> Path:
    from examples.tiny_sd35 import write_tiny_sd35
    from tests.helpers import NO_SD35, has_sd35_layers

    if not has_sd35_layers():
        pytest.skip(NO_SD35)

    return write_tiny_sd35(tmp_path_factory.mktemp("tiny-sd35"), "sd35-medium")


def write_images(root: Path, n: int = 6, size: tuple[int, int] = (24, 20), metadata: bool = False) -> Path:
    """`n` random RGB images with captions, as .txt files or a metadata.jsonl."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(root / f"img{i}.png")
        if metadata:
            rows.append(json.dumps({"file_name": f"img{i}.png", "text": f"metadata caption {i}"}))
        else:
            (root / f"img{i}.txt").write_text(f"a photo of thing {i}\n")
    if metadata:
        (root / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    return root


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("images"))


SHARD_SOURCES = {"a": 28, "b": 12}  # images per source: 40 samples an epoch at proportions 0.7 / 0.3


@pytest.fixture(scope="session")
def shards(tiny_sd, tmp_path_factory) -> dict[str, Path]:
    """Two sources of shards precomputed from image folders with the tiny SD's VAE and text encoder."""
    from ldm.cli.precompute import main as precompute
    from tests.helpers import SD_FOLDER

    tmp = tmp_path_factory.mktemp("shards")
    for name, count in SHARD_SOURCES.items():
        write_images(tmp / f"images-{name}", n=count, size=(40, 32))
        code = precompute(["-b", str(SD_FOLDER), "--out", str(tmp / name), "--chunk-size", "10",
                           f"model.params.pretrained={tiny_sd}", f"data.params.root={tmp / f'images-{name}'}",
                           "data.params.size=16", "data.params.num_workers=0"])  # fmt: skip
        assert code == 0
    return {name: tmp / name for name in SHARD_SOURCES}


@pytest.fixture(scope="session")
def shards_512(tiny_sd, tmp_path_factory):
    """The CPU twins' "512 px" shards: 32 px images, 16x16 latents, precomputed with the tiny SD."""
    from ldm.cli.precompute import main as precompute
    from tests.helpers import SD_FOLDER

    tmp = tmp_path_factory.mktemp("shards512")
    write_images(tmp / "images", n=12, size=(40, 36))
    assert precompute(["-b", str(SD_FOLDER), "--out", str(tmp / "a"), "--chunk-size", "6",
                       f"model.params.pretrained={tiny_sd}", f"data.params.root={tmp / 'images'}",
                       "data.params.size=32", "data.params.num_workers=0"]) == 0  # fmt: skip
    return tmp / "a"
