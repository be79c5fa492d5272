"""Training from precomputed shards: two sources mixed by proportion, kill -9 mid-epoch and an exact resume,
a local folder read as a remote into a cache, clear errors for wrong sources, and an export that samples."""

import json
import signal
import tempfile
from pathlib import Path

import pytest
from diffusers import StableDiffusionPipeline

from main import main
from tests.conftest import REPO
from tests.helpers import run_main, run_script

TINY = REPO / "configs" / "pretrain" / "tiny-shards.yaml"
pytestmark = pytest.mark.exclusive  # every test streams shards, or checks what streaming leaves


def lock_files() -> set[Path]:
    """The streaming library's lock files in the temporary folder."""
    return set(Path(tempfile.gettempdir()).glob("*_filelock"))


def leftovers() -> set[Path]:
    """The streaming library's lock files, and its shared memory blocks (freed when a process exits)."""
    return lock_files() | set(Path("/dev/shm").glob("0*_*"))


@pytest.fixture(scope="module", autouse=True)
def clean_up_after_killed_runs():
    """A run killed with kill -9 cannot remove what it made: remove it for it."""
    before = leftovers()
    yield
    for path in leftovers() - before:
        path.unlink(missing_ok=True)


def args(tiny_sd, shards, logdir, record_dir, *extra) -> list[str]:
    sources = f"[{{path: {shards['a']}, proportion: 0.7}}, {{path: {shards['b']}, proportion: 0.3}}]"
    return [
        "-t", "-b", str(TINY), "-l", str(logdir), "-n", "pre", "-s", "5",
        f"model.params.pretrained={tiny_sd}", f"data.params.sources={sources}", "data.params.caption_dropout=0.25",
        "lightning.callbacks.samples.target=tests.helpers.RecordSamples",
        f"lightning.callbacks.samples.params.folder={record_dir}", *extra,
    ]  # fmt: skip


def recorded(folder: Path, rank: int = 0) -> dict[int, dict]:
    """step -> the batch `rank` trained on at that step (a step seen again after a resume: the last time)."""
    rows = (folder / f"samples-{rank}.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, rows)}


@pytest.fixture(scope="module")
def unbroken(tiny_sd, shards, tmp_path_factory):
    """An unbroken 8-step run (an epoch of 5 batches of 8, then 3 of the next): the reference."""
    tmp = tmp_path_factory.mktemp("unbroken")
    (tmp / "rec").mkdir()
    before = lock_files()
    assert main(args(tiny_sd, shards, tmp / "logs", tmp / "rec")) == 0
    assert lock_files() <= before, "a finished run leaves no lock files behind"
    (run_dir,) = (tmp / "logs").iterdir()
    return run_dir, recorded(tmp / "rec")


def test_sources_are_mixed_by_proportion_and_the_encoders_do_not_run(unbroken):
    run_dir, steps = unbroken
    assert sorted(steps) == list(range(1, 9))
    epoch = [key for step in range(1, 6) for key in steps[step]["keys"]]
    assert len(epoch) == len(set(epoch)) == 40, "an epoch holds every sample once at these proportions"
    share = sum(key.startswith("a/") for key in epoch) / len(epoch)
    assert abs(share - 0.7) <= 0.05, share
    assert epoch[:24] != [key for step in range(6, 9) for key in steps[step]["keys"]], "each epoch is shuffled anew"
    dropped = sum(d for step in steps.values() for d in step["dropped"]) / 64
    assert 0.1 < dropped < 0.4, dropped  # caption_dropout 0.25
    log = (run_dir / "train.log").read_text()
    assert "data: 40 samples per epoch from 2 source(s) (a 28, b 12)" in log
    assert "the VAE encoder and the text encoder do not run in training" in log


def test_encoders_are_never_called_in_training(tiny_sd, shards, tmp_path, monkeypatch):
    from ldm.systems.latent_diffusion import LatentDiffusion

    def refuse(*args, **kwargs):
        raise AssertionError("an encoder ran in training")

    monkeypatch.setattr(LatentDiffusion, "encode_posterior", refuse)
    monkeypatch.setattr(LatentDiffusion, "encode_text", refuse)
    (tmp_path / "rec").mkdir()
    assert main(args(tiny_sd, shards, tmp_path / "logs", tmp_path / "rec", "lightning.trainer.max_steps=2")) == 0


def test_killed_with_kill_9_mid_epoch_resumes_with_the_unbroken_samples_and_losses(tiny_sd, shards, unbroken, tmp_path):
    _, reference = unbroken
    rec = tmp_path / "rec"
    rec.mkdir()
    base = args(tiny_sd, shards, tmp_path / "logs", rec)
    killed = ["lightning.callbacks.kill.target=tests.helpers.SendSignal", "lightning.callbacks.kill.params.step=7",
              "lightning.callbacks.kill.params.signal=SIGKILL"]  # fmt: skip
    done = run_main(*base, *killed)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert sorted(recorded(rec)) == list(range(1, 8))
    assert main([*base, "-r", "auto"]) == 0  # from step 6's checkpoint: one batch into the second epoch
    assert recorded(rec) == reference, "steps 7 and 8 again: the unbroken run's samples, dropped captions and losses"


def test_a_local_folder_read_as_a_remote_by_two_workers_is_copied_to_its_cache_and_gives_the_same_samples(
    tiny_sd, shards, unbroken, tmp_path
):
    _, reference = unbroken
    rec, cache = tmp_path / "rec", tmp_path / "cache"
    rec.mkdir()
    sources = (
        f"[{{path: {shards['a']}, proportion: 0.7, cache: {cache / 'a'}}}, "
        f"{{path: {shards['b']}, proportion: 0.3, cache: {cache / 'b'}}}]"
    )
    argv = args(tiny_sd, shards, tmp_path / "logs", rec, "lightning.trainer.max_steps=2", "data.params.num_workers=2")
    assert main([*argv, f"data.params.sources={sources}"]) == 0
    assert (cache / "a" / "index.json").is_file() and list((cache / "a").glob("**/*.mds"))
    assert recorded(rec) == {step: reference[step] for step in (1, 2)}


def test_a_job_killed_whole_leaves_shared_memory_that_the_resume_frees(tiny_sd, shards, tmp_path, monkeypatch,
                                                                        capsys, caplog):  # fmt: skip
    """kill -9 to the job's process group (a cancelled job: the resource tracker that would free the blocks
    dies too) leaves the library's blocks naming the cache; a resume under a new temporary folder (a new job's)
    is refused by the library unless they are freed, and they are."""
    from ldm.data.leftovers import SHARED_MEMORY, registered_folders

    rec, cache = tmp_path / "rec", tmp_path / "cache"
    rec.mkdir()
    sources = f"[{{path: {shards['a']}, cache: {cache / 'a'}}}]"
    base = args(tiny_sd, shards, tmp_path / "logs", rec, f"data.params.sources={sources}",
                "lightning.trainer.max_steps=4")  # fmt: skip
    killed = ["lightning.callbacks.kill.target=tests.helpers.SendSignal",
              "lightning.callbacks.kill.params={step: 3, signal: SIGKILL, group: true}"]  # fmt: skip
    done = run_main(*base, *killed)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    left = [p for p in SHARED_MEMORY.glob("*_locals") if str(cache / "a") in registered_folders(p)]
    assert len(left) == 1, "the killed job's blocks are still there"
    prefix = int(left[0].name.split("_")[0])

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the new job's temporary folder: no lock files
    assert main([*base, "-r", "auto", "data.params.free_stale_shared_memory=false"]) == 2
    assert "Reused local directory" in capsys.readouterr().err
    with caplog.at_level("INFO", logger="ldm.data.shards"):
        assert main([*base, "-r", "auto"]) == 0
    assert f"freed what 1 killed run(s) left in /dev/shm and {tmp_path} (the library's prefixes {prefix})" in (
        caplog.text
    )
    assert sorted(recorded(rec)) == [1, 2, 3, 4]


def test_only_blocks_of_our_folders_that_no_process_maps_are_freed(tmp_path, monkeypatch):
    """Stale blocks naming our folder go, with their lock files; blocks a live process maps stay, and so do
    stale blocks of other folders; lock files whose blocks are gone go too."""
    import mmap

    import numpy as np
    from streaming import Stream

    from ldm.data.leftovers import SHARED_MEMORY, free_stale_shared_memory

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(), theirs.mkdir()

    def make(prefix: int, folder: Path) -> list[Path]:
        text = f"{folder}\0{prefix}".encode()
        locals_ = SHARED_MEMORY / f"{prefix:06}_locals"
        locals_.write_bytes(np.int32(4 + len(text)).tobytes() + text)
        barrier = SHARED_MEMORY / f"{prefix:06}_barrier"
        barrier.write_bytes(bytes(4096))
        lock = tmp_path / f"{prefix:06}_barrier_filelock"
        lock.touch()
        return [locals_, barrier, lock]

    stale, live, other = make(990001, ours), make(990002, ours), make(990003, theirs)
    orphan_lock = tmp_path / "990004_cache_filelock"
    orphan_lock.touch()
    made = [*stale, *live, *other]
    try:
        with live[1].open("r+b") as f, mmap.mmap(f.fileno(), 4096):  # a live run maps its blocks
            assert set(free_stale_shared_memory([Stream(local=str(ours))])) == {990001, 990004}
        assert [p.exists() for p in made] == [False] * 3 + [True] * 6
        assert not orphan_lock.exists()
    finally:
        for path in made:
            path.unlink(missing_ok=True)


def test_a_run_from_shards_exports_a_pipeline_that_samples(unbroken, tmp_path):
    run_dir, _ = unbroken
    run_script("export_diffusers.py", "--ckpt", run_dir / "checkpoints" / "last.ckpt", "--out", tmp_path / "pipe")
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path / "pipe")
    image = pipe("a photo", num_inference_steps=2, height=16, width=16, output_type="np").images[0]
    assert image.shape == (16, 16, 3)


@pytest.mark.parametrize(
    "sources, extra, message",
    [
        ("[]", [], "data.params.sources: empty"),
        ("[{path: /nonexistent/shards}]", [], "data.params.sources[0].path: /nonexistent/shards is not a folder"),
        ("[{path: @EMPTY}]", [], "data.params.sources[0].path: @EMPTY has no ldm_shards.json"),
        ("[{path: @EMPTY, cache: @EMPTY/cache}]", [],
         "data.params.sources[0].path: cannot fetch @EMPTY/ldm_shards.json"),
        ("[{path: @A, proportion: 0.5, repeat: 2}]", [], "data.params.sources[0]: give one of proportion, repeat"),
        ("[{path: @A, proportion: 0.7}, {path: @B, proportion: 0.2}]", [],
         "data.params.sources: the proportions add up to 0.9 (0.7 + 0.2), not 1"),
        ("[{path: @A, proportion: 0.7}, {path: @B}]", [], "data.params.sources[1]: no proportion"),
        ("[{path: @A}, {path: @A}]", [], "data.params.sources: two sources have the same name"),
        ("[{path: @A}]", ["model.params.unet.config.cross_attention_dim=64"],
         "data.params.sources[0].path (@A): the shards hold text states 32 wide, but model.params' unet attends to 64"),
        ("[{path: @A}]", ["model.params.unet.config.in_channels=8"],
         "data.params.sources[0].path (@A): the shards hold 4-channel latents, but model.params' unet takes 8"),
    ],
)  # fmt: skip
def test_bad_sources_are_one_line_errors_naming_the_key(tiny_sd, shards, tmp_path, capsys, sources, extra, message):
    empty = tmp_path / "empty"
    empty.mkdir()
    fill = {"@A": str(shards["a"]), "@B": str(shards["b"]), "@EMPTY": str(empty)}
    for name, path in fill.items():
        sources, message = sources.replace(name, path), message.replace(name, path)
    argv = args(tiny_sd, shards, tmp_path / "logs", tmp_path, f"data.params.sources={sources}", *extra)
    assert main(argv) == 2
    assert message in capsys.readouterr().err
