"""Shared fixtures: a tiny SD-shaped pipeline folder and a folder of captioned images, made locally."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory) -> Path:
    from examples.tiny_sd import write_tiny_sd

    return write_tiny_sd(tmp_path_factory.mktemp("tiny-sd"))


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
