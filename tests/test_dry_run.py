"""`main.py --dry-run` checks the config and prints the run's plan, the one the run itself prints, without training."""

import logging

from main import main
from tests.helpers import finetune_args


def plan_block(lines: list[str]) -> list[str]:
    """The plan's lines, from "plan:" on, without the ones only a dry run has."""
    start = lines.index("plan:")
    shared = ("plan:", "  model", "  data", "  run", "  on")
    return [line for line in lines[start : start + 7] if line.startswith(shared)]


def test_a_dry_run_prints_the_plan_the_run_prints_and_writes_nothing(tiny_sd, image_folder, tmp_path, capsys, caplog):
    argv = finetune_args(tiny_sd, image_folder, tmp_path / "logs", "lightning.callbacks.image_logger=null")
    assert main(["--dry-run", *argv[1:]]) == 0  # without -t
    said = capsys.readouterr().out.splitlines()
    assert main(["--dry-run", *argv]) == 0  # with -t: the same
    assert capsys.readouterr().out.splitlines() == said
    assert not (tmp_path / "logs").exists(), "a dry run makes no run folder"
    assert said[0] == f"dry run: would train in {tmp_path / 'logs'}/<time>_tiny"
    # 6 images, batches of 2 on one process: 3 steps per epoch; 3 steps
    assert "  data   6 examples, batches of 2 x 1 process, 3 steps per epoch" in said
    assert "  run    3 steps (within one epoch); a checkpoint every 500 steps and at the end" in said
    (memory,) = [line for line in said if line.startswith("  memory ")]
    assert memory.startswith("  memory one step peaks at ") and "(batch 2, 16 px, no offload;" in memory, memory
    model = next(line for line in said if line.startswith("  model  "))
    assert "unet (UNet2DConditionModel)" in model and "trained" in model and "text_encoder (CLIPTextModel)" in model

    with caplog.at_level(logging.INFO, logger="ldm"):
        assert main(argv) == 0
    ran = [record.getMessage() for record in caplog.records if record.name == "ldm"]
    assert plan_block(said) == plan_block(ran)
    (run_dir,) = (tmp_path / "logs").iterdir()
    files = sorted(run_dir.rglob("*"))
    capsys.readouterr()
    assert main(["--dry-run", "-l", str(tmp_path / "logs"), "-n", "tiny", "-r", "auto"]) == 0
    resumed = capsys.readouterr().out
    assert f"dry run: would train in {run_dir}" in resumed
    assert f"  resume from {run_dir / 'checkpoints' / 'step-000003.ckpt'}" in resumed
    assert sorted(run_dir.rglob("*")) == files, "a dry run of a resume writes nothing into the run"


def test_a_dry_run_reports_config_mistakes_as_a_run_does(tiny_sd, image_folder, tmp_path, capsys):
    argv = finetune_args(tiny_sd, image_folder, tmp_path / "logs", "data.params.batch_size=0")
    assert main(["--dry-run", *argv]) == 2
    assert "data.params.batch_size: got 0; must be at least 1" in capsys.readouterr().err
