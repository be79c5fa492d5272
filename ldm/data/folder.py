"""A folder of images with captions: same-stem `.txt` files, or a Hugging Face `metadata.jsonl`."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ldm.config import ExistingPath, TargetSpec
from ldm.data import DataModule

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def find_examples(root: Path, caption_extension: str = ".txt") -> list[tuple[Path, str]]:
    """(image path, caption) pairs under `root`, from `metadata.jsonl` if present, else from `.txt` files."""
    metadata = root / "metadata.jsonl"
    if metadata.is_file():
        examples = []
        for line_no, line in enumerate(metadata.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                examples.append((root / row["file_name"], str(row.get("text", ""))))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f'{metadata}:{line_no}: expected {{"file_name": ..., "text": ...}} ({err})') from None
        return examples
    images = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    missing = [p for p in images if not p.with_suffix(caption_extension).is_file()]
    if missing:
        log.warning(
            "%d of %d images in %s have no %s caption; they train with an empty caption (first: %s)",
            len(missing),
            len(images),
            root,
            caption_extension,
            missing[0],
        )
    return [(p, _read_caption(p.with_suffix(caption_extension))) for p in images]


def _read_caption(path: Path) -> str:
    return path.read_text(encoding="utf-8").strip() if path.is_file() else ""


def load_image(path: Path, size: int, channels: int, random_crop: bool, flip: bool, rng: random.Random) -> torch.Tensor:
    """Read an image, resize its short side to `size`, crop `size` x `size`, maybe flip; to [-1, 1]."""
    with Image.open(path) as image:
        image = image.convert("RGB" if channels == 3 else "L")
    w, h = image.size
    scale = size / min(w, h)
    image = image.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.Resampling.BICUBIC)
    w, h = image.size
    left = rng.randint(0, w - size) if random_crop else (w - size) // 2
    top = rng.randint(0, h - size) if random_crop else (h - size) // 2
    image = image.crop((left, top, left + size, top + size))
    if flip and rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    tensor = torch.from_numpy(array)
    return tensor.permute(2, 0, 1).contiguous() if channels == 3 else tensor.unsqueeze(0)


class FolderDataset(Dataset):
    """Captioned images from a folder, as `{"pixel_values": (C, size, size) in [-1, 1], "caption"}`."""

    def __init__(
        self,
        root: ExistingPath,
        size: int = 512,
        random_crop: bool = False,
        flip: bool = False,
        channels: int = 3,
        caption_extension: str = ".txt",
    ) -> None:
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise ValueError(f"data.params.root: {self.root} is not a folder")
        if channels not in (1, 3):
            raise ValueError(f"data.params.channels must be 1 or 3, got {channels}")
        self.examples = find_examples(self.root, caption_extension)
        if not self.examples:
            raise ValueError(f"data.params.root: no images ({', '.join(IMAGE_EXTENSIONS)}) found in {self.root}")
        self.size, self.random_crop, self.flip, self.channels = size, random_crop, flip, channels

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        return self.get(index, seed=index)

    def get(self, index: int, seed: int) -> dict:
        """The example at `index`, its random crop and flip drawn from `seed`."""
        path, caption = self.examples[index]
        pixels = load_image(path, self.size, self.channels, self.random_crop, self.flip, random.Random(seed))
        return {"pixel_values": pixels, "caption": caption}


class FolderDataModule(DataModule):
    """`DataModule` over a `FolderDataset`: the flat parameters that `configs/finetune/sd-folder.yaml` uses."""

    def __init__(
        self,
        root: ExistingPath,
        size: int = 512,
        random_crop: bool = False,
        flip: bool = False,
        channels: int = 3,
        caption_extension: str = ".txt",
        batch_size: int = 1,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        caption_dropout: float = 0.0,
        cache_latents: bool = False,
    ) -> None:
        dataset: TargetSpec = {
            "target": "ldm.data.folder.FolderDataset",
            "params": {
                "root": str(root),
                "size": size,
                "random_crop": random_crop,
                "flip": flip,
                "channels": channels,
                "caption_extension": caption_extension,
            },
        }
        super().__init__(dataset, batch_size, num_workers, shuffle, seed, caption_dropout, cache_latents)
