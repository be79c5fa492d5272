"""A folder of images with captions: same-stem `.txt` files, or a Hugging Face `metadata.jsonl`."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ldm.config import ExistingPath, TargetSpec
from ldm.data import DataModule
from ldm.data.images import BadImage, decode_image
from ldm.utils.run_folder import current_run_dir

log = logging.getLogger(__name__)

BAD_SAMPLES = "bad_samples.tsv"  # in the run folder: one `path<TAB>reason` line per skipped file
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
    if not path.is_file():
        return ""
    try:
        return path.read_text(encoding="utf-8-sig").strip()
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}: caption is not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8"
        ) from None


def load_image(path: Path, size: int, channels: int, random_crop: bool, flip: bool, rng: random.Random) -> torch.Tensor:
    """Read an image, resize its short side to `size`, crop `size` x `size`, maybe flip; to [-1, 1].

    Raises `BadImage` for a file that cannot be decoded."""
    image = decode_image(path, channels)
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
        on_bad_sample: Literal["skip", "error"] = "skip",
    ) -> None:
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise ValueError(f"root: {self.root} is not a folder")
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {channels}")
        self.examples = find_examples(self.root, caption_extension)
        if not self.examples:
            raise ValueError(f"root: no images ({', '.join(IMAGE_EXTENSIONS)}) found in {self.root}")
        if on_bad_sample not in ("skip", "error"):
            raise ValueError(f"on_bad_sample: got {on_bad_sample!r}; valid: skip, error")
        self.size, self.random_crop, self.flip, self.channels = size, random_crop, flip, channels
        self.on_bad_sample = on_bad_sample
        self.bad: set[int] = set()  # indices found undecodable, in this process
        self.get(0, seed=0)  # a folder with no decodable image fails here, before training

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        return self.get(index, seed=index)

    def get(self, index: int, seed: int) -> dict:
        """The example at `index`, its random crop and flip drawn from `seed`.

        An undecodable image raises (`on_bad_sample: error`) or is replaced by the next decodable one
        (`skip`), so the epoch keeps its length; each skipped file is logged once and listed in the
        run folder's `bad_samples.tsv`."""
        for step in range(len(self.examples)):
            candidate = (index + step) % len(self.examples)
            if candidate in self.bad:
                continue
            path, caption = self.examples[candidate]
            try:
                pixels = load_image(path, self.size, self.channels, self.random_crop, self.flip, random.Random(seed))
            except BadImage as err:
                if self.on_bad_sample == "error":
                    raise BadImage(f"{err}; set data.params.on_bad_sample: skip to train without such files") from None
                self._skip(candidate, str(err))
                continue
            return {"pixel_values": pixels, "caption": caption}
        raise BadImage(f"root: none of the {len(self.examples)} images in {self.root} can be decoded")

    def _skip(self, index: int, reason: str) -> None:
        self.bad.add(index)
        log.warning(
            "data: skipping %s; its batches take the next image instead (%d skipped in this process; "
            "data.params.on_bad_sample: error stops instead)",
            reason,
            len(self.bad),
        )
        run_dir = current_run_dir()
        if run_dir is not None:
            with open(run_dir / BAD_SAMPLES, "a", encoding="utf-8") as listing:
                listing.write(f"{self.examples[index][0]}\t{reason}\n")


class FolderDataModule(DataModule):
    """`DataModule` over a `FolderDataset`: the flat parameters that `configs/finetune/sd-folder.yaml` uses."""

    dataset_key = "data"  # the dataset's parameters are this node's own: data.params.root, ...

    def __init__(
        self,
        root: ExistingPath,
        size: int = 512,
        random_crop: bool = False,
        flip: bool = False,
        channels: int = 3,
        caption_extension: str = ".txt",
        on_bad_sample: Literal["skip", "error"] = "skip",
        batch_size: int = 1,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        caption_dropout: float = 0.0,
        cache_latents: bool = False,
        cache_text: bool = False,
        drop_last: bool = False,
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
                "on_bad_sample": on_bad_sample,
            },
        }
        super().__init__(dataset, batch_size, num_workers, shuffle, seed, caption_dropout, cache_latents, cache_text,
                         drop_last)  # fmt: skip

    def teardown(self, stage: str) -> None:
        """Sum up the skipped files of every process (workers and ranks log each their own) in one line."""
        run_dir = current_run_dir()
        if stage != "fit" or run_dir is None or not (run_dir / BAD_SAMPLES).is_file():
            return
        listing = run_dir / BAD_SAMPLES
        if self.trainer is not None and not self.trainer.is_global_zero:
            return
        files = {line.split("\t", 1)[0] for line in listing.read_text(encoding="utf-8").splitlines() if line}
        log.warning(
            "data: %d undecodable file(s) skipped so far in this run, each replaced by the next image; listed in %s",
            len(files),
            listing,
        )
