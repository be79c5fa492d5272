"""Aspect-ratio buckets: the shapes at a target area, each image in the bucket nearest its aspect, small buckets
merged into their neighbour, and batches of one bucket each that resume exactly mid-epoch; a folder of images of
three shapes trains that way through main.py."""

import json
import logging
import math

import numpy as np
import pytest
from PIL import Image

from ldm.config import ConfigError
from ldm.data import ResumableSampler
from ldm.data.buckets import BucketBatchSampler, assign_buckets, bucket_shapes, nearest_shape, shapes_from
from ldm.data.folder import FolderDataset
from main import main
from tests.helpers import finetune_args


def test_shapes_at_an_area_are_multiples_of_the_step_within_the_aspect_limit():
    shapes = bucket_shapes(512 * 512)
    assert (512, 512) in shapes and (256, 1024) in shapes and (1024, 256) in shapes
    assert all(h % 64 == 0 and w % 64 == 0 and h * w <= 512 * 512 for h, w in shapes)
    assert all(max(h / w, w / h) <= 4 for h, w in shapes)
    assert all(h * w > 512 * 512 - 64 * max(h, w) for h, w in shapes), "each as large as the step allows"
    assert shapes == sorted(shapes, key=lambda s: s[1] / s[0]) and len(set(shapes)) == len(shapes)
    assert {(w, h) for h, w in shapes} == set(shapes), "every shape comes in both orientations"
    assert bucket_shapes(512 * 512, max_aspect=1.0) == [(512, 512)]


def test_an_image_goes_to_the_shape_of_the_nearest_aspect():
    shapes = bucket_shapes(512 * 512)
    for height, width in [(600, 400), (400, 600), (1000, 1000), (100, 2000), (3000, 2000)]:
        chosen = shapes[nearest_shape(height, width, shapes)]
        gap = [abs(math.log(w / h) - math.log(width / height)) for h, w in shapes]
        assert abs(math.log(chosen[1] / chosen[0]) - math.log(width / height)) == min(gap)
    assert shapes[nearest_shape(100, 2000, shapes)] == (256, 1024), "beyond 1:4, the widest bucket"


def test_a_bucket_of_less_than_a_batch_is_merged_into_its_neighbour(caplog):
    shapes = [(32, 8), (16, 16), (8, 24), (8, 32)]
    sizes = [(24, 48)] * 5 + [(32, 32)] * 4 + [(16, 64)] * 2  # wide, square, widest
    with caplog.at_level(logging.INFO, logger="ldm.data.buckets"):
        buckets = assign_buckets(sizes, shapes, min_count=4)
    assert buckets == [2] * 5 + [1] * 4 + [2] * 2, "the two widest join the wide bucket, their neighbour"
    assert "buckets: 2 image(s) of 8x32 merged into 8x24 (5): fewer than a global batch of 4" in caplog.text
    assert set(assign_buckets(sizes, shapes, min_count=100)) == {2}, "too few images for any batch: one bucket"


def test_bucket_settings_are_checked():
    assert shapes_from({"shapes": [[64, 32], [32, 64]]}, 512) == [(64, 32), (32, 64)]
    assert (16, 16) in shapes_from({"step": 8}, 16)
    for buckets, message in [({"step": 12}, r"buckets\.step: got 12"), ({"max_aspect": 0.5}, r"max_aspect: got 0\.5"),
                             ({"shapes": [[60, 64]]}, r"buckets\.shapes: \[60, 64\]"),
                             ({"aera": 4}, r"buckets\.aera: unknown"), ({"area": 100}, "no shape")]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            shapes_from(buckets, 512)


def deal(buckets, batch_size, world, epoch=0, resume=None):
    """Every rank's batches of `epoch` (indices only), the sampler resumed at `resume` batches if given."""
    ranks = []
    for rank in range(world):
        sampler = ResumableSampler(len(buckets), batch_size, True, 7, 0.5, rank, world)
        sampler.set_epoch(epoch)
        if resume is not None:
            sampler.resume(epoch, resume)
        ranks.append([[i for i, _, _ in batch] for batch in BucketBatchSampler(sampler, buckets, batch_size)])
    return ranks


def test_batches_hold_one_bucket_each_in_an_order_set_by_the_seed_and_resume_mid_epoch():
    buckets = [0] * 10 + [1] * 9 + [2] * 4
    (one,) = deal(buckets, 4, 1)
    assert len(one) == 2 + 2 + 1 == len(BucketBatchSampler(ResumableSampler(23, 4, True, 7, 0.5, 0, 1), buckets, 4))
    assert all(len({buckets[i] for i in batch}) == 1 for batch in one)
    assert [buckets[b[0]] for b in one] != [0, 0, 1, 1, 2], "the batches are shuffled across buckets"
    assert deal(buckets, 4, 1) == [one] and deal(buckets, 4, 1, epoch=1) != [one]
    two = deal(buckets, 2, 2)
    assert [sorted(a + b) for a, b in zip(*two)] == [sorted(b) for b in one], "2 processes split each global batch"
    assert deal(buckets, 4, 1, resume=3) == [one[3:]]
    sampler = ResumableSampler(23, 4, True, 7, 0.5, 0, 1)
    drawn = [item for batch in BucketBatchSampler(sampler, buckets, 4) for item in batch]
    _, drop, seeds = sampler.draws()
    assert all(d == bool(drop[i]) and s == int(seeds[i]) for i, d, s in drawn), "caption dropout as without buckets"
    with pytest.raises(ConfigError, match="no bucket holds a global batch of 16"):
        BucketBatchSampler(ResumableSampler(23, 8, True, 7, 0.0, 0, 2), buckets, 8)


SHAPES = {"wide": ((48, 24), 8), "tall": ((24, 48), 8), "square": ((32, 32), 8), "widest": ((64, 16), 2)}


@pytest.fixture(scope="module")
def three_shapes(tmp_path_factory):
    """Images of three aspects (and two of a fourth, too few for a bucket of their own), uniquely captioned."""
    root = tmp_path_factory.mktemp("shapes")
    rng = np.random.default_rng(0)
    for name, ((width, height), count) in SHAPES.items():
        for i in range(count):
            Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(root / f"{name}{i}.png")
            (root / f"{name}{i}.txt").write_text(f"{name} {i}")
    return root


def test_a_folder_serves_each_image_at_its_buckets_shape_with_the_crop_recorded(three_shapes):
    dataset = FolderDataset(three_shapes, size=16, buckets={"step": 8})
    assert dataset.shapes == [(32, 8), (24, 8), (16, 16), (8, 24), (8, 32)]
    buckets = dataset.assign_buckets(min_count=4)
    names = [path.stem.rstrip("0123456789") for path, _ in dataset.examples]
    served = {name: {dataset.shapes[b] for b, n in zip(buckets, names) if n == name} for name in SHAPES}
    assert served == {"wide": {(8, 24)}, "tall": {(24, 8)}, "square": {(16, 16)}, "widest": {(8, 24)}}
    wide = dataset.get(names.index("wide"), seed=0)
    assert wide["pixel_values"].shape == (3, 8, 24)
    assert wide["original_size"] == (24, 48) and wide["crop_top_left"] == (2, 0), "48x24 resized to 24x12, centre"


def test_a_bucketed_folder_trains_on_one_shape_per_batch_and_resumes_exactly_mid_epoch(
    tiny_sd, three_shapes, tmp_path, caplog
):
    def run(name: str, *extra: str) -> tuple[int, list[dict]]:
        logdir, rec, loss = tmp_path / name, tmp_path / f"{name}.jsonl", tmp_path / f"{name}-loss.jsonl"
        argv = finetune_args(tiny_sd, three_shapes, logdir, "data.params.buckets={step: 8}", "data.params.batch_size=4",
                             "lightning.trainer.max_steps=9", "lightning.callbacks.image_logger=null",
                             "lightning.modelcheckpoint.params.every_n_train_steps=1",
                             "lightning.callbacks.rec.target=tests.helpers.RecordBatches",
                             f"lightning.callbacks.rec.params.path={rec}",
                             "lightning.callbacks.loss.target=tests.helpers.RecordLosses",
                             f"lightning.callbacks.loss.params.path={loss}", *extra)  # fmt: skip
        code = main(argv)
        batches = [json.loads(line) for line in rec.read_text().splitlines()]
        losses = [json.loads(line)["loss"] for line in loss.read_text().splitlines()]
        return code, [{**batch, "loss": value} for batch, value in zip(batches, losses)]

    with caplog.at_level(logging.INFO):
        code, unbroken = run("unbroken")
    assert code == 0 and [b["step"] for b in unbroken] == list(range(1, 10))
    assert "2 image(s) of 8x32 merged into 8x24" in caplog.text
    assert "26 examples in 3 bucket(s) (24x8: 8, 16x16: 8, 8x24: 10); each epoch, 2 wait" in caplog.text
    assert {tuple(b["shape"][2:]) for b in unbroken} == {(24, 8), (16, 16), (8, 24)}
    for b in unbroken:  # one shape per batch, and the captions say which images: those of that shape
        kinds = {c.split()[0] if c else None for c in b["captions"]} - {None}  # a dropped caption is empty
        expected = {(24, 8): {"tall"}, (16, 16): {"square"}, (8, 24): {"wide", "widest"}}[tuple(b["shape"][2:])]
        assert kinds <= expected, b
    signal = ["lightning.callbacks.stop.target=tests.helpers.SendSignal",
              "lightning.callbacks.stop.params={step: 4, signal: SIGTERM}"]  # fmt: skip
    code, before = run("broken", *signal)
    assert code == 128 + 15 and before == unbroken[:4], "stopped at step 4, two batches into epoch 1"
    code, both = run("broken", "-r", "auto")  # the records go on in the same files
    assert code == 0 and both[4:] == unbroken[4:], "steps 5-9 after the resume are the unbroken run's, to the bit"


@pytest.fixture(scope="module")
def bucketed_shards(tiny_sd, three_shapes, tmp_path_factory):
    from ldm.cli.precompute import main as precompute
    from tests.helpers import SD_FOLDER

    shards = tmp_path_factory.mktemp("bucketed") / "shards"
    assert precompute(["-b", str(SD_FOLDER), "--out", str(shards), "--chunk-size", "5", "--min-bucket", "4",
                       f"model.params.pretrained={tiny_sd}", f"data.params.root={three_shapes}",
                       "data.params.size=16", "data.params.buckets={step: 8}",
                       "data.params.num_workers=0"]) == 0  # fmt: skip
    return shards


def shard_args(tiny_sd, shards, logdir, *extra) -> list[str]:
    from tests.test_shards import TINY

    return ["-t", "-b", str(TINY), "-l", str(logdir), "-n", "pre", "-s", "5", f"model.params.pretrained={tiny_sd}",
            f"data.params.sources=[{{path: {shards}}}]", *extra]  # fmt: skip


@pytest.mark.exclusive
@pytest.mark.parametrize("batch, stop", [(4, 4), (3, 7)])  # (3, 7): at the end of an epoch of 2 + 2 + 3 batches
def test_bucketed_shards_train_on_one_shape_per_batch_and_resume_exactly(
    tiny_sd, bucketed_shards, tmp_path, caplog, batch, stop
):
    """The precompute writes one shard folder per bucket (latents at its shape, the widest merged into their
    neighbour at --min-bucket 4); training deals batches of one bucket each and resumes on the same ones."""
    shards = bucketed_shards
    manifest = json.loads((shards / "ldm_shards.json").read_text())
    listed = {b["folder"]: (b["latent_shape"], b["count"]) for b in manifest["buckets"]}
    assert listed == {"24x8": ([4, 12, 4], 8), "16x16": ([4, 8, 8], 8), "8x24": ([4, 4, 12], 10)}
    assert manifest["count"] == 26 and all((shards / folder / "index.json").is_file() for folder in listed)

    def run(name: str, *extra: str) -> tuple[int, list[dict]]:
        logdir, rec = tmp_path / name, tmp_path / f"{name}.jsonl"
        argv = shard_args(tiny_sd, shards, logdir, f"data.params.batch_size={batch}", "lightning.trainer.max_steps=9",
                          "lightning.modelcheckpoint.params.every_n_train_steps=1",
                          "lightning.callbacks.rec.target=tests.helpers.RecordBatches",
                          f"lightning.callbacks.rec.params.path={rec}", *extra)  # fmt: skip
        code = main(argv)
        return code, [json.loads(line) for line in rec.read_text().splitlines()]

    with caplog.at_level(logging.INFO):
        code, unbroken = run("unbroken")
    assert code == 0 and [b["step"] for b in unbroken] == list(range(1, 10))
    assert "buckets: source shards: 24x8: 8, 16x16: 8, 8x24: 10" in caplog.text
    for b in unbroken:
        kinds = {c.split()[0] for c in b["captions"] if c}
        expected = {(12, 4): {"tall"}, (8, 8): {"square"}, (4, 12): {"wide", "widest"}}[tuple(b["shape"][2:])]
        assert kinds <= expected, b
    assert {tuple(b["shape"][2:]) for b in unbroken} == {(12, 4), (8, 8), (4, 12)}
    signal = ["lightning.callbacks.stop.target=tests.helpers.SendSignal",
              f"lightning.callbacks.stop.params={{step: {stop}, signal: SIGTERM}}"]  # fmt: skip
    code, before = run("broken", *signal)
    assert code == 128 + 15 and before == unbroken[:stop]
    code, both = run("broken", "-r", "auto")
    assert code == 0 and both[stop:] == unbroken[stop:], "the steps after the resume are the unbroken run's"


@pytest.mark.exclusive
def test_bucketed_shards_give_two_processes_the_global_batches_of_one(tiny_sd, bucketed_shards, tmp_path, caplog):
    """1 process at batch 4 and 2 at batch 2 train on the same samples at every step; a bucket that cannot fill a
    global batch is named in the log."""
    from tests.helpers import run_main
    from tests.test_shards import recorded

    steps = {}
    for world in (1, 2):
        rec = tmp_path / f"rec{world}"
        rec.mkdir()
        argv = shard_args(tiny_sd, bucketed_shards, tmp_path / f"logs{world}", f"data.params.batch_size={4 // world}",
                          "lightning.trainer.max_steps=5",
                          "lightning.callbacks.samples.target=tests.helpers.RecordSamples",
                          f"lightning.callbacks.samples.params.folder={rec}")  # fmt: skip
        if world == 1:
            assert main(argv) == 0
        else:
            done = run_main(*argv, "lightning.trainer.devices=2", "lightning.trainer.strategy=ddp")
            assert done.returncode == 0, done.stderr[-3000:]
        per_rank = [recorded(rec, rank) for rank in range(world)]
        steps[world] = {step: sorted(k for rows in per_rank for k in rows[step]["keys"]) for step in per_rank[0]}
    assert steps[2] == steps[1] and len(steps[1]) == 5
    with caplog.at_level(logging.INFO):
        assert main(shard_args(tiny_sd, bucketed_shards, tmp_path / "big", "data.params.batch_size=9",
                               "lightning.trainer.max_steps=1")) == 0  # fmt: skip
    assert "bucket 24x8 holds 8 samples, fewer than a global batch of 9: they are not trained on" in caplog.text
