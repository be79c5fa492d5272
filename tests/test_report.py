"""Every run writes RUN/report.html, one self-contained page; `scripts/report.py RUN` writes it again."""

import base64
import re

import pytest

from ldm.cli.report import main as report_main
from ldm.training.report import read_metrics, smoothed, write_report
from tests.helpers import finetune_args, train_once

PROMPTS = ["a red square", "a blue circle"]


@pytest.fixture(scope="module")
def run_dir(tiny_sd, image_folder, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("logs")
    prompts = "[" + ",".join(f'"{p}"' for p in PROMPTS) + "]"
    argv = finetune_args(tiny_sd, image_folder, logdir, f"lightning.callbacks.image_logger.params.prompts={prompts}",
                         "lightning.modelcheckpoint.params.every_n_train_steps=2")  # fmt: skip
    return train_once(argv, logdir)


def test_a_run_writes_a_self_contained_report(run_dir):
    page = (run_dir / "report.html").read_text()
    # the plan and the summary the run printed
    assert "plan:" in page and "done: step 3 of 3, 3 steps in" in page
    # loss, learning rate and images/s as inline SVG plots
    titles = re.findall(r'<text x="\d+" y="15" class="title">([^<]+)</text>', page)
    assert titles == ["loss", "learning rate", "images/s"], titles
    # the grid of step 2, inlined byte for byte, with its prompts
    grid = (run_dir / "images" / "step_000002.png").read_bytes()
    assert f"data:image/png;base64,{base64.b64encode(grid).decode()}" in page
    assert "a red square; a blue circle" in page
    # the checkpoints and the commands to go on from them
    newest = run_dir / "checkpoints" / "step-000003.ckpt"
    assert str(run_dir / "checkpoints" / "step-000002.ckpt") in page and str(newest) in page
    assert f"python main.py -t -r {run_dir}" in page
    assert f"python scripts/export_diffusers.py --ckpt {newest} --out {run_dir / 'pipeline'}" in page
    # the config, and nothing fetched from elsewhere
    assert "every_n_train_steps: 2" in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page) and "<script" not in page


def test_the_report_lists_skipped_files_and_is_written_again_the_same(run_dir, capsys):
    first = (run_dir / "report.html").read_text()
    (run_dir / "report.html").unlink()
    assert report_main([str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(run_dir / "report.html")
    assert (run_dir / "report.html").read_text() == first, "the page is the run folder's, rebuilt alike"
    (run_dir / "bad_samples.tsv").write_text("/data/broken.png\tcannot identify image file\n")
    try:
        page = write_report(run_dir).read_text()
    finally:
        (run_dir / "bad_samples.tsv").unlink()
    assert "1 file(s), each replaced by the next image" in page
    assert "<td>/data/broken.png</td><td>cannot identify image file</td>" in page


def test_the_report_tool_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert report_main([str(tmp_path)]) == 2
    assert f"report: {tmp_path} is not a run folder (no configs/project.yaml)" in capsys.readouterr().err


def test_metrics_join_the_launches_of_a_run_the_later_winning(tmp_path):
    for launch, rows in (("2026-01-01T00-00-00", "1,0.5\n2,0.4\n3,0.9\n"), ("2026-01-01T01-00-00", "3,0.3\n4,0.2\n")):
        (tmp_path / "csv" / launch).mkdir(parents=True)
        (tmp_path / "csv" / launch / "metrics.csv").write_text("step,train/loss\n" + rows)
    assert read_metrics(tmp_path)["train/loss"] == [(1, 0.5), (2, 0.4), (3, 0.3), (4, 0.2)]


def test_smoothing_starts_at_the_first_value_and_keeps_a_constant():
    assert [v for _, v in smoothed([(1, 2.0), (2, 2.0), (3, 2.0)])] == pytest.approx([2.0, 2.0, 2.0])
    assert smoothed([(1, 1.0), (2, 0.0)])[1][1] == pytest.approx(0.9 * 0.1 / (1 - 0.81))
