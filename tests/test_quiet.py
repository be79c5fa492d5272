"""The command-line tools hide other libraries' listed noise (`ldm.cli.noise`), and `-v` shows it."""

import logging

import pytest

from ldm.cli.noise import LOGGED
from main import main
from tests.helpers import finetune_args

NOISE = ("GPU available", "Seed set to", "litlogger", "`Trainer.fit` stopped")


@pytest.mark.parametrize("verbose", [False, True])
def test_a_run_hides_the_listed_noise_unless_verbose(verbose, tiny_sd, image_folder, tmp_path, caplog, recwarn):
    argv = finetune_args(tiny_sd, image_folder, tmp_path / "logs", "lightning.callbacks.image_logger=null",
                         "lightning.trainer.max_steps=1", *(["-v"] if verbose else []))  # fmt: skip
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0
    said = "\n".join(r.getMessage() for r in caplog.records)
    shown = [noise for noise in NOISE if noise in said]
    assert shown == (list(NOISE) if verbose else []), said
    assert "run folder:" in said, "ldm's own lines are never hidden"


def test_every_hidden_message_says_why():
    assert all(len(entry) == 3 and entry[2] for entry in LOGGED)
