"""A folder of images with captions: same-stem `.txt` / `.caption` files, a Hugging Face `metadata.jsonl`,
or kohya-ss/sd-scripts concept folders (`10_sks dog/`: its images served 10 times an epoch, captioned
`sks dog` where they have no caption file of their own)."""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ldm.config import ExistingPath, TargetSpec
from ldm.data import DataModule
from ldm.data.buckets import Buckets, Shape, assign_buckets, shapes_from
from ldm.data.images import BadImage, decode_image, header_size
from ldm.utils.run_folder import current_run_dir

log = logging.getLogger(__name__)

BAD_SAMPLES = "bad_samples.tsv"  # in the run folder: one `path<TAB>reason` line per skipped file
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
CAPTION_EXTENSIONS = (".txt", ".caption")  # .caption is sd-scripts' default, .txt its taggers' and ours
CONCEPT_FOLDER = re.compile(r"([0-9]+)_(.*)", re.DOTALL)  # sd-scripts' `<repeats>_<class token>`, whole name
Layout = Literal["auto", "kohya", "plain"]
Examples = list[tuple[Path, str]]


def find_examples(root: Path, caption_extension: str = ".txt", layout: Layout = "auto") -> tuple[Examples, list[int]]:
    """The distinct (image path, caption) pairs under `root` and how many times an epoch each is served.

    `metadata.jsonl`, if present, lists them (once each). Otherwise, when an immediate subfolder of `root`
    is named `<N>_<name>` (`layout: auto`; `kohya` requires one, `plain` ignores them), every image must
    sit in such a concept folder (at any depth below it): it is served N times, and captioned `<name>` if
    it has no caption file. Else every image under `root` is served once. A caption file has the image's
    stem and `caption_extension`, or else the other of `.txt` / `.caption`."""
    if layout not in ("auto", "kohya", "plain"):
        raise ValueError(f"layout: got {layout!r}; valid: auto, kohya, plain")
    extensions = (caption_extension, *(e for e in CAPTION_EXTENSIONS if e != caption_extension))
    metadata = root / "metadata.jsonl"
    if metadata.is_file():
        examples = _from_metadata(root, metadata, layout)
        return examples, [1] * len(examples)
    concepts = _concept_folders(root) if layout != "plain" else []
    if not concepts:
        if layout == "kohya":
            raise ValueError(
                f"root: no immediate subfolder of {root} is named `<repeats>_<name>` (as `10_sks dog`), which "
                "data.params.layout: kohya needs; rename the concept folders or set data.params.layout: auto"
            )
        images = _images(root)
        if layout == "auto":
            _hint_nested_concepts(root, images)
        return _captioned(root, images, extensions, ""), [1] * len(images)
    _refuse_images_outside(root, concepts)
    for folder, times, token in concepts:
        if times < 1:
            raise ValueError(
                f"root: concept folder {folder} serves its images {times} times an epoch; name it `1_{token}` "
                f"or more to train on it, or move it out of {root}"
            )
    examples, repeats, summary = [], [], []
    for folder, times, token in concepts:
        images = _images(folder)
        if not images:
            log.warning(
                "data: concept folder %s holds no images (%s); it adds nothing", folder, ", ".join(IMAGE_EXTENSIONS)
            )
        named = sum(_caption_file(image, extensions) is None for image in images)
        examples += _captioned(folder, images, extensions, token)
        repeats += [times] * len(images)
        by_name = f", {named} captioned {token!r} by the folder name" if named and token else ""
        summary.append(f"{folder.name}: {len(images)} images x {times}{by_name}")
    log.info(
        "data: %d concept folder(s) (%s), %d examples per epoch; data.params.layout: plain serves each image once",
        len(concepts),
        "; ".join(summary),
        sum(repeats),
    )
    return examples, repeats


def _from_metadata(root: Path, metadata: Path, layout: Layout) -> Examples:
    if layout == "kohya":
        raise ValueError(
            f"root: {metadata} lists the examples, so the concept folders of data.params.layout: kohya do not "
            "apply; set data.params.layout: auto to train on metadata.jsonl, or move it away to use their repeats"
        )
    concepts = _concept_folders(root) if layout == "auto" else []
    if concepts:
        log.warning(
            "data: %s lists the examples, once each; the repeat counts of its concept folders (%s) do not apply",
            metadata,
            ", ".join(folder.name for folder, _, _ in concepts),
        )
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


def _concept_folders(root: Path) -> list[tuple[Path, int, str]]:
    """(folder, repeats, class token) for each immediate subfolder of `root` named `<N>_<name>`."""
    concepts = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        match = CONCEPT_FOLDER.fullmatch(folder.name)
        if match is not None:
            concepts.append((folder, int(match[1]), match[2]))
    return concepts


def _iter_images(folder: Path, recursive: bool = True) -> Iterator[Path]:
    for path in folder.rglob("*") if recursive else folder.iterdir():
        if path.suffix.lower() in IMAGE_EXTENSIONS and path.is_file():
            yield path


def _images(folder: Path) -> list[Path]:
    return sorted(_iter_images(folder))


def _refuse_images_outside(root: Path, concepts: list[tuple[Path, int, str]]) -> None:
    """In a kohya folder every image belongs to a concept folder: one outside would have no repeat count."""
    inside = {folder for folder, _, _ in concepts}
    outside = list(_iter_images(root, recursive=False))[:3]
    outside += [p for p in sorted(root.iterdir()) if p.is_dir() and p not in inside and next(_iter_images(p), None)]
    if outside:
        raise ValueError(
            f"root: {root} has kohya concept folders (`<repeats>_<name>`, as {concepts[0][0].name!r}) and images "
            f"outside them ({', '.join(str(p) for p in outside[:3])}), which would have no repeat count; move "
            "those into a concept folder (`1_<name>` serves them once an epoch) or out of root, or set "
            "data.params.layout: plain to serve every image under root once"
        )


def _hint_nested_concepts(root: Path, images: list[Path]) -> None:
    """Say so when a plain folder holds what look like concept folders one level too deep."""
    nested = sorted({p.parent for p in images if p.parent != root and CONCEPT_FOLDER.fullmatch(p.parent.name)})
    if nested:
        log.warning(
            "data: %s looks like a kohya concept folder, but only immediate subfolders of data.params.root count; "
            "its images are served once each (set data.params.root: %s to use its repeat count)",
            nested[0],
            nested[0].parent,
        )


def _caption_file(image: Path, extensions: tuple[str, ...]) -> Path | None:
    return next((c for c in map(image.with_suffix, extensions) if c.is_file()), None)


def _captioned(folder: Path, images: list[Path], extensions: tuple[str, ...], fallback: str) -> Examples:
    """Each image with its caption file's text, or `fallback` where it has none; say what is missing or doubled."""
    files = [_caption_file(image, extensions) for image in images]
    doubled = [image for image in images if sum(image.with_suffix(e).is_file() for e in extensions) > 1]
    if doubled:
        log.info(
            "data: %d image(s) in %s have more than one caption file (first: %s); each reads its %s file "
            "(data.params.caption_extension picks which)",
            len(doubled),
            folder,
            doubled[0],
            extensions[0],
        )
    missing = [image for image, file in zip(images, files) if file is None]
    if missing and not fallback:
        log.warning(
            "%d of %d images in %s have no %s caption; they train with an empty caption (no %s file either; first: %s)",
            len(missing),
            len(images),
            folder,
            extensions[0],
            " or ".join(extensions[1:]),
            missing[0],
        )
    return [(image, fallback if file is None else _read_caption(file)) for image, file in zip(images, files)]


def _read_caption(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig").strip()
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}: caption is not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8"
        ) from None


def load_image(
    path: Path, size: int | Shape, channels: int, random_crop: bool, flip: bool, rng: random.Random
) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
    """Read an image, resize it to just cover `size` (a square's side, or a bucket's (height, width)), crop that
    shape, maybe flip; to [-1, 1].

    Returns the pixels, the image's (height, width) before resizing and the crop's (top, left) in the resized
    image as served (measured from the left edge of the flipped image when flipped). Raises `BadImage` for a
    file that cannot be decoded."""
    image = decode_image(path, channels)
    original_size = (image.height, image.width)
    height, width = (size, size) if isinstance(size, int) else size
    w, h = image.size
    scale = max(height / h, width / w)
    image = image.resize((max(width, round(w * scale)), max(height, round(h * scale))), Image.Resampling.BICUBIC)
    w, h = image.size
    left = rng.randint(0, w - width) if random_crop else (w - width) // 2
    top = rng.randint(0, h - height) if random_crop else (h - height) // 2
    image = image.crop((left, top, left + width, top + height))
    if flip and rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        left = w - width - left
    array = np.asarray(image, dtype=np.float32) / 127.5 - 1.0
    tensor = torch.from_numpy(array)
    pixels = tensor.permute(2, 0, 1).contiguous() if channels == 3 else tensor.unsqueeze(0)
    return pixels, original_size, (top, left)


class FolderDataset(Dataset):
    """Captioned images from a folder, as `{"pixel_values": (C, size, size) in [-1, 1], "caption"}`, with each
    image's `original_size` (height, width) and `crop_top_left` (top, left; see `load_image`).

    `examples` holds each image once; `example_index[i]` is the one served at index `i`, so an image of a
    kohya concept folder `10_name` fills 10 indices and `len()` is the epoch's length (see `find_examples`).

    With `buckets` (`ldm.data.buckets`), `assign_buckets` puts each image in the bucket of its aspect and it is
    served at that bucket's shape instead of a `size` square."""

    def __init__(
        self,
        root: ExistingPath,
        size: int = 512,
        random_crop: bool = False,
        flip: bool = False,
        channels: int = 3,
        caption_extension: str = ".txt",
        on_bad_sample: Literal["skip", "error"] = "skip",
        layout: Layout = "auto",
        buckets: Buckets | None = None,
    ) -> None:
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise ValueError(f"root: {self.root} is not a folder")
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {channels}")
        self.examples, repeats = find_examples(self.root, caption_extension, layout)
        self.example_index = [example for example, times in enumerate(repeats) for _ in range(times)]
        if not self.examples:
            raise ValueError(f"root: no images ({', '.join(IMAGE_EXTENSIONS)}) found in {self.root}")
        if on_bad_sample not in ("skip", "error"):
            raise ValueError(f"on_bad_sample: got {on_bad_sample!r}; valid: skip, error")
        self.size, self.random_crop, self.flip, self.channels = size, random_crop, flip, channels
        self.on_bad_sample = on_bad_sample
        self.bad: set[int] = set()  # indices into `examples` found undecodable, in this process
        self.shapes = shapes_from(buckets, size) if buckets is not None else None
        self.bucket: list[int] | None = None  # per index, into `shapes`; set by `assign_buckets`
        self.get(0, seed=0)  # a folder with no decodable image fails here, before training

    def __len__(self) -> int:
        return len(self.example_index)

    def __getitem__(self, index: int) -> dict:
        return self.get(index, seed=index)

    def assign_buckets(self, min_count: int) -> list[int]:
        """Put each index in the bucket of its image's aspect, read from the file's header (an unreadable one: a
        square), merging buckets of fewer than `min_count` indices (a global batch); return each index's bucket.
        Needs `buckets`."""
        if self.shapes is None:
            raise ValueError("assign_buckets: this dataset has no buckets (data.params.buckets)")
        sizes = [header_size(path) or (self.size, self.size) for path, _ in self.examples]
        self.bucket = assign_buckets([sizes[example] for example in self.example_index], self.shapes, min_count)
        return self.bucket

    def shape(self, index: int) -> Shape:
        """The (height, width) index `index` is served at."""
        return (self.size, self.size) if self.bucket is None else self.shapes[self.bucket[index]]

    def get(self, index: int, seed: int) -> dict:
        """The example at `index`, its random crop and flip drawn from `seed`.

        An undecodable image raises (`on_bad_sample: error`) or is replaced by the next decodable one
        (`skip`), so the epoch keeps its length; each skipped file is logged once (however often it
        repeats) and listed in the run folder's `bad_samples.tsv`."""
        first = self.example_index[index]
        for step in range(len(self.examples)):
            candidate = (first + step) % len(self.examples)
            if candidate in self.bad:
                continue
            try:
                return self._load(candidate, seed, self.shape(index))  # a stand-in takes the bucket's shape too
            except BadImage as err:
                if self.on_bad_sample == "error":
                    raise BadImage(f"{err}; set data.params.on_bad_sample: skip to train without such files") from None
                self._skip(candidate, str(err))
        raise BadImage(f"root: none of the {len(self.examples)} images in {self.root} can be decoded")

    def load(self, index: int, seed: int) -> dict:
        """The example at `index` itself, its random crop and flip drawn from `seed`; raises `BadImage` for
        an undecodable file (where `get` serves the next image instead)."""
        return self._load(self.example_index[index], seed, self.shape(index))

    def _load(self, example: int, seed: int, shape: Shape) -> dict:
        path, caption = self.examples[example]
        pixels, size, crop = load_image(path, shape, self.channels, self.random_crop, self.flip, random.Random(seed))
        return {"pixel_values": pixels, "caption": caption, "original_size": size, "crop_top_left": crop}

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
        layout: Layout = "auto",
        buckets: Buckets | None = None,
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
                "layout": layout,
                "buckets": None if buckets is None else dict(buckets),
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
