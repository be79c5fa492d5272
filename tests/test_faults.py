"""Faults lose nothing: atomic checksummed checkpoints, -r auto past damaged ones, a full disk,
stop signals on every rank, kill -9 with loss-exact resume, and the non-finite loss guard."""

import json
import logging
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from ldm.utils.atomic import verify
from ldm.weights.checkpoint import load_checkpoint
from main import main
from tests.helpers import finetune_args, run_main

REPO = Path(__file__).resolve().parents[1]
EVERY_2 = ("lightning.modelcheckpoint.params.every_n_train_steps=2", "lightning.callbacks.image_logger=null")


def args(tiny_sd, images, logdir, *extra):
    return finetune_args(tiny_sd, images, logdir, *EVERY_2, *extra)


def record(path: Path, callback: str = "RecordLosses", **params) -> list[str]:
    """Overrides that add a test callback from tests.helpers."""
    params = {"path": str(path), **params} if callback == "RecordLosses" else params
    key = f"lightning.callbacks.{callback.lower()}"
    return [f"{key}.target=tests.helpers.{callback}"] + [f"{key}.params.{k}={v}" for k, v in params.items()]


def losses(path: Path) -> dict[int, float]:
    """Step -> loss; a step recorded again (after a resume) keeps its last value."""
    return {row["step"]: row["loss"] for row in map(json.loads, path.read_text().splitlines())}


def steps_on_disk(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def unbroken(tiny_sd, image_folder, tmp_path_factory):
    """Losses of an uninterrupted 8-step run, the reference for every resumed one."""
    tmp = tmp_path_factory.mktemp("unbroken")
    assert main(args(tiny_sd, image_folder, tmp / "logs", "lightning.trainer.max_steps=8", *record(tmp / "l"))) == 0
    (run_dir,) = (tmp / "logs").iterdir()
    return run_dir, losses(tmp / "l")


def test_checkpoints_are_published_whole_with_checksums_and_the_newest_kept(unbroken):
    run_dir, _ = unbroken
    assert steps_on_disk(run_dir) == [
        "last.ckpt", "step-000006.ckpt", "step-000006.ckpt.sha256", "step-000008.ckpt", "step-000008.ckpt.sha256",
    ]  # fmt: skip
    last = run_dir / "checkpoints" / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "step-000008.ckpt"
    assert load_checkpoint(last)["global_step"] == 8
    checked = subprocess.run(["sha256sum", "-c", "step-000008.ckpt.sha256"], cwd=last.parent, capture_output=True)
    assert checked.returncode == 0 and checked.stdout == b"step-000008.ckpt: OK\n"
    assert "rng_states" in load_checkpoint(last)


def test_keep_sets_how_many_checkpoints_stay(tiny_sd, image_folder, tmp_path):
    keep = "lightning.modelcheckpoint.params.keep=1"
    assert main(args(tiny_sd, image_folder, tmp_path, "lightning.trainer.max_steps=4", keep)) == 0
    (run_dir,) = tmp_path.iterdir()
    assert steps_on_disk(run_dir) == ["last.ckpt", "step-000004.ckpt", "step-000004.ckpt.sha256"]


def copy_run(run_dir: Path, logdir: Path) -> Path:
    import shutil

    copy = logdir / run_dir.name
    shutil.copytree(run_dir, copy, symlinks=True)
    return copy


def test_resume_auto_skips_damaged_checkpoints_and_says_which_it_took(
    unbroken, tiny_sd, image_folder, tmp_path, caplog
):
    run_dir, reference = unbroken
    copy = copy_run(run_dir, tmp_path / "logs")
    newest = copy / "checkpoints" / "step-000008.ckpt"
    with open(newest, "r+b") as f:  # a truncated copy, as a full disk or an interrupted rsync leaves
        f.truncate(newest.stat().st_size // 2)
    assert "does not match its checksum" in verify(newest)
    assert "does not match" in verify(copy / "checkpoints" / "last.ckpt"), "the link is checked too"
    rec = tmp_path / "l"
    with caplog.at_level(logging.INFO, logger="ldm"):
        code = main(args(tiny_sd, image_folder, tmp_path / "logs", "lightning.trainer.max_steps=8", "-r", "auto",
                         *record(rec)))  # fmt: skip
    assert code == 0
    assert f"-r auto: skipping {newest}: step-000008.ckpt does not match its checksum" in caplog.text
    assert f"-r auto: resuming {copy / 'checkpoints' / 'step-000006.ckpt'}" in caplog.text
    assert losses(rec) == {7: reference[7], 8: reference[8]}, "resumed from step 6: steps 7 and 8 again, same losses"
    assert verify(newest) is None, "step 8 was written again, whole"


def test_a_flipped_byte_is_caught_and_an_explicit_resume_refused(unbroken, tiny_sd, image_folder, tmp_path):
    run_dir, _ = unbroken
    copy = copy_run(run_dir, tmp_path / "logs")
    newest = copy / "checkpoints" / "step-000008.ckpt"
    with open(newest, "r+b") as f:
        f.seek(newest.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert "does not match its checksum" in verify(newest)
    code = main(args(tiny_sd, image_folder, tmp_path / "logs", "-r", str(newest)))
    assert code == 2, "a one-line config error, before anything is built"


def test_resume_auto_starts_a_new_run_when_no_checkpoint_is_intact(unbroken, tiny_sd, image_folder, tmp_path, caplog):
    run_dir, _ = unbroken
    copy = copy_run(run_dir, tmp_path / "logs")
    for ckpt in (copy / "checkpoints").glob("step-*.ckpt"):
        ckpt.write_bytes(b"")
    with caplog.at_level(logging.INFO, logger="ldm"):
        assert main(args(tiny_sd, image_folder, tmp_path / "logs", "lightning.trainer.max_steps=2", "-r", "auto")) == 0
    assert "no run named 'tiny' with an intact checkpoint" in caplog.text and "starting a new run" in caplog.text
    assert len(list((tmp_path / "logs").iterdir())) == 2


def test_a_full_disk_stops_the_run_and_keeps_the_last_good_checkpoint(tiny_sd, image_folder, tmp_path, capsys):
    """The step-4 save goes to /dev/full, where every write fails with ENOSPC, as on a full disk."""
    logdir = tmp_path / "logs"
    assert main(args(tiny_sd, image_folder, logdir, "lightning.trainer.max_steps=2")) == 0
    (run_dir,) = logdir.iterdir()
    folder = run_dir / "checkpoints"
    (folder / "step-000004.ckpt.partial").symlink_to("/dev/full")
    code = main(args(tiny_sd, image_folder, logdir, "lightning.trainer.max_steps=6", "-r", "auto"))
    err = capsys.readouterr().err
    assert code == 1
    assert "checkpoint error: could not write the step 4 checkpoint in" in err
    assert "No space left on device" in err and "the last good checkpoint, step-000002.ckpt, is intact" in err
    assert steps_on_disk(run_dir) == ["last.ckpt", "step-000002.ckpt", "step-000002.ckpt.sha256"]
    assert verify(folder / "last.ckpt") is None
    assert main(args(tiny_sd, image_folder, logdir, "lightning.trainer.max_steps=6", "-r", "auto")) == 0
    assert load_checkpoint(folder / "last.ckpt")["global_step"] == 6


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT", "SIGUSR1"])
def test_a_stop_signal_saves_exits_and_resumes_loss_exact(name, unbroken, tiny_sd, image_folder, tmp_path, capsys):
    _, reference = unbroken
    logdir, rec = tmp_path / "logs", tmp_path / "l"
    signalled = record(rec) + record(rec, "SendSignal", step=3, signal=name)
    code = main(args(tiny_sd, image_folder, logdir, "lightning.trainer.max_steps=8", *signalled))
    assert code == 128 + getattr(signal, name)
    assert f"stopped by {name}; saved" in capsys.readouterr().err
    (run_dir,) = logdir.iterdir()
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 3, "saved at the step it got it"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the handlers are put back after the run"
    assert main(args(tiny_sd, image_folder, logdir, "lightning.trainer.max_steps=8", "-r", "auto", *record(rec))) == 0
    assert losses(rec) == reference


def test_kill_9_while_saving_then_resume_matches_an_unbroken_run(unbroken, tiny_sd, image_folder, tmp_path):
    _, reference = unbroken
    logdir, rec = tmp_path / "logs", tmp_path / "l"
    killed = args(tiny_sd, image_folder, logdir, "lightning.trainer.max_steps=8", *record(rec),
                  *record(rec, "KillDuringSave", step=6))  # fmt: skip
    done = run_main(*killed)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    (run_dir,) = logdir.iterdir()
    assert "step-000006.ckpt.partial" in steps_on_disk(run_dir), "killed in the middle of writing step 6"
    assert os.readlink(run_dir / "checkpoints" / "last.ckpt") == "step-000004.ckpt"
    assert sorted(losses(rec)) == [1, 2, 3, 4, 5, 6]
    assert main(args(tiny_sd, image_folder, logdir, "lightning.trainer.max_steps=8", "-r", "auto", *record(rec))) == 0
    assert losses(rec) == reference, "steps 5-8 after the resume are the unbroken run's, to the bit"
    assert "step-000006.ckpt.partial" not in steps_on_disk(run_dir), "leftovers are cleaned at the next save"


@pytest.mark.exclusive
def test_two_ranks_both_save_and_exit_when_only_rank_0_is_signalled(tiny_sd, image_folder, tmp_path):
    """DDP over 2 CPU processes (gloo): SIGTERM to rank 0 only; the ranks agree, save together, and exit."""
    logdir, done_dir = tmp_path / "logs", tmp_path / "done"
    done_dir.mkdir()
    argv = args(tiny_sd, image_folder, logdir, "lightning.trainer.max_steps=20", "lightning.trainer.strategy=ddp",
                "lightning.trainer.accelerator=cpu", "lightning.trainer.devices=2", "lightning.callbacks.ema=null",
                *record(tmp_path, "SendSignal", step=3, signal="SIGTERM", rank=0, done_dir=done_dir))  # fmt: skip
    done = run_main(*argv)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert done.stderr.count("stopped by SIGTERM; saved") == 2, "rank 1 was not signalled, but stops and says why"
    assert sorted(p.name for p in done_dir.iterdir()) == ["0.done", "1.done"]
    assert {p.read_text() for p in done_dir.iterdir()} == {"3"}, "both ranks stopped at the step rank 0 got it"
    (run_dir,) = logdir.iterdir()
    assert verify(run_dir / "checkpoints" / "last.ckpt") is None
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 3


def test_a_non_finite_loss_is_skipped_without_touching_the_weights(tiny_sd, image_folder, tmp_path, caplog):
    rec = tmp_path / "l"
    with caplog.at_level(logging.WARNING, logger="ldm"):
        code = main(args(tiny_sd, image_folder, tmp_path / "logs", "lightning.trainer.max_steps=4",
                         *record(rec), *record(rec, "PoisonBatch", steps=[2])))  # fmt: skip
    assert code == 0
    seen = losses(rec)
    assert seen[2] is None and all(seen[s] is not None for s in (1, 3, 4))
    assert "step 2: loss is nan; skipped this step's update (model.params.nonfinite_loss: skip; 1 skipped so far)" in (
        caplog.text
    )
    (run_dir,) = (tmp_path / "logs").iterdir()
    state = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    assert all(torch.isfinite(t).all() for t in state.values())


def test_a_non_finite_loss_stops_the_run_with_the_last_finite_weights(tiny_sd, image_folder, tmp_path, capsys):
    logdir, rec = tmp_path / "logs", tmp_path / "l"
    code = main(args(tiny_sd, image_folder, logdir, "lightning.trainer.max_steps=6", "model.params.nonfinite_loss=stop",
                     *record(rec), *record(rec, "PoisonBatch", steps=[3])))  # fmt: skip
    assert code == 1
    assert (
        "stopped: non-finite loss (nan) at step 3 (model.params.nonfinite_loss: stop); saved" in capsys.readouterr().err
    )
    (run_dir,) = logdir.iterdir()
    at_2 = load_checkpoint(run_dir / "checkpoints" / "step-000002.ckpt")["state_dict"]
    at_stop = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert at_stop["global_step"] == 3 and sorted(losses(rec)) == [1, 2, 3]
    assert all(torch.equal(at_2[k], v) for k, v in at_stop["state_dict"].items()), "step 3's update was not applied"


def test_a_resume_under_another_seed_says_so_in_one_line(tiny_sd, image_folder, tmp_path, caplog):
    logs = tmp_path / "logs"
    assert main(finetune_args(tiny_sd, image_folder, logs, "lightning.trainer.max_steps=2")) == 0
    with caplog.at_level("WARNING", logger="ldm"):
        assert main([*finetune_args(tiny_sd, image_folder, logs, "-r", "auto", "-s", "2")]) == 0
        assert main([*finetune_args(tiny_sd, image_folder, logs, "-r", "auto", "-s", "2",
                                    "lightning.trainer.max_steps=4")]) == 0  # fmt: skip
    said = [r.getMessage() for r in caplog.records if "resume is not exact" in r.getMessage()]
    assert said == ["resume is not exact: -s 1 -> 2 (the seed keys each sample's noise and timestep); going on with "
                    "-s 2"], "once, for the resume under another seed; none for the next, under the same"  # fmt: skip
