"""What `ldm-ui` does behind its tabs (`ldm.ui.runs`): paths kept inside the chosen folders, main.py's arguments
built from the fields and refused when they would be anything else, the child's output followed."""

import subprocess
import sys

import pytest

from ldm.ui.runs import CONFIGS, Job, Roots, list_runs, presets, train_args


def test_paths_outside_the_chosen_folders_are_refused_links_included(tmp_path):
    inside, outside = tmp_path / "mine", tmp_path / "other"
    (inside / "images").mkdir(parents=True)
    outside.mkdir()
    (inside / "escape").symlink_to(outside)
    roots = Roots([inside])
    assert roots.check(f"  {inside / 'images'} ", "image folder") == inside / "images"
    assert roots.check(str(inside / "new"), "to", must_exist=False) == inside / "new"
    for path, message in (
        (str(outside), f"image folder: {outside} is outside the folders this app may use ({inside})"),
        (str(inside / "escape"), f"image folder: {outside} is outside the folders"),
        (str(inside / ".." / "other"), f"image folder: {outside} is outside the folders"),
        (str(inside / "missing"), f"image folder: {inside / 'missing'} does not exist"),
        ("", "image folder: give a path"),
    ):
        with pytest.raises(ValueError) as err:
            roots.check(path, "image folder")
        assert str(err.value).startswith(message), err.value


def test_the_train_fields_become_main_py_arguments_and_nothing_else(tmp_path):
    overrides = "data.params.size=256\n\n lightning.trainer.precision=bf16-mixed "
    logs = tmp_path / "logs"
    args = train_args("finetune/sd-folder.yaml", tmp_path / "sd", tmp_path / "images", "my-run", 40, overrides, logs)
    assert args == [
        "-t", "-b", str(CONFIGS / "finetune" / "sd-folder.yaml"), "-l", str(tmp_path / "logs"), "-n", "my-run",
        f"model.params.pretrained={tmp_path / 'sd'}", f"data.params.root={tmp_path / 'images'}",
        "lightning.trainer.max_steps=40", "data.params.size=256", "lightning.trainer.precision=bf16-mixed",
    ]  # fmt: skip
    preset = "finetune/sd-folder.yaml"
    for fields, message in (
        (("../../x.yaml", None, None, "run", None, ""), "preset: '../../x.yaml' is not one of"),
        (("sd-folder.yaml", None, None, "run", None, ""), "preset: 'sd-folder.yaml' is not one of"),
        ((preset, None, None, "../up", None, ""), "run name: '../up'; use letters"),
        ((preset, None, None, "run", None, "-r /elsewhere"), "overrides: '-r /elsewhere' is not key.path"),
        ((preset, None, None, "run", None, "--logdir=/tmp"), "overrides: '--logdir=/tmp' is not key.path"),
    ):
        with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(".", r"\.")):
            train_args(*fields, tmp_path / "logs")


def test_the_train_tab_offers_the_quickstart_and_pretraining_configs_too(tmp_path):
    offered = presets()
    assert offered[0].startswith("finetune/") and "finetune/sdxl-lora-8gb.yaml" in offered
    assert {"quickstart/digits-ldm.yaml", "pretrain/tiny-shards.yaml", "pretrain/microdit-2-256.yaml"} <= set(offered)
    assert all((CONFIGS / preset).is_file() for preset in offered)
    args = train_args("quickstart/digits-ldm.yaml", None, None, "digits", 800, "model.params.vae.pretrained=v",
                      tmp_path)  # fmt: skip
    assert args[:3] == ["-t", "-b", str(CONFIGS / "quickstart" / "digits-ldm.yaml")] and args[-1].endswith("=v")


def test_a_job_reports_its_run_folder_newest_progress_and_ending(tmp_path):
    said = ["run folder: /runs/a", "plan:", "step 1/2 (50 %): loss 1.2", "step 2/2 (100 %): loss 1.1",
            "done: step 2 of 2, 2 steps in 1 s; last loss 1.1"]  # fmt: skip
    output = tmp_path / "out.log"
    with open(output, "w") as sink:
        process = subprocess.Popen([sys.executable, "-c", f"print({chr(10).join(said)!r})"], stdout=sink)
    job = Job(process, output)
    process.wait(timeout=60)
    assert job.run_dir() is not None and str(job.run_dir()) == "/runs/a"
    assert job.status() == "step 2/2 (100 %): loss 1.1\ndone: step 2 of 2, 2 steps in 1 s; last loss 1.1\n" \
                           "exited with status 0"  # fmt: skip


def test_runs_are_listed_newest_first(tmp_path):
    for name in ("2026-01-02T00-00-00_b", "2026-01-01T00-00-00_a", "not-a-run"):
        (tmp_path / name / ("configs" if name != "not-a-run" else "other")).mkdir(parents=True)
        (tmp_path / name / "configs" / "project.yaml").touch() if name != "not-a-run" else None
    assert [run.name for run in list_runs(tmp_path)] == ["2026-01-02T00-00-00_b", "2026-01-01T00-00-00_a"]
    assert list_runs(tmp_path / "missing") == []
