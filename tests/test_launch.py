"""Every rank of a run started by torchrun or SLURM agrees on the first rank's run folder, with no variable set."""

import os
import shutil
import socket
import sys
from pathlib import Path

import pytest
from lightning.fabric.plugins.environments import TorchElasticEnvironment

from ldm.training.launch import agree_on_run_dir
from ldm.utils.run_folder import RUN_DIR_ENV
from tests.helpers import run_together

REPO = Path(__file__).resolve().parents[1]
RANK_SCRIPT = """
import os, sys
from pathlib import Path
from ldm.training.launch import agree_on_run_dir, cluster_environment

rank = int(os.environ["RANK"])
assert type(cluster_environment()).__name__ == sys.argv[1], cluster_environment()

def propose():
    assert rank == 0, "only the first rank names the folder"
    return Path("logs") / "from-rank-0"

print(agree_on_run_dir(propose))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, extra_env: dict) -> list[str]:
    port = free_port()
    envs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if k != RUN_DIR_ENV}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port - 1), RANK=str(rank), WORLD_SIZE=str(world))
        env.update({k: v.format(rank=rank) for k, v in extra_env.items()}, PYTHONPATH=str(REPO))
        envs.append(env)
    command = [sys.executable, "-c", RANK_SCRIPT, *extra_env["_env"].split()]
    outputs = []
    for done in run_together([command] * world, envs, timeout=120):
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout.strip())
    return outputs


@pytest.mark.exclusive
def test_torchrun_ranks_receive_the_first_ranks_folder():
    torchrun = {
        "_env": "TorchElasticEnvironment",
        "TORCHELASTIC_RUN_ID": "job",
        "GROUP_RANK": "0",
        "LOCAL_RANK": "{rank}",
        "LOCAL_WORLD_SIZE": "3",
    }
    assert launch(3, torchrun) == [str(Path("logs") / "from-rank-0")] * 3


@pytest.mark.exclusive
def test_slurm_ranks_receive_the_first_ranks_folder():
    slurm = {
        "_env": "SLURMEnvironment",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_PROCID": "{rank}",
        "SLURM_LOCALID": "{rank}",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NAME": "train",
        "SLURM_NODELIST": "127.0.0.1",
        "SLURM_JOB_ID": "1",
    }
    assert launch(2, slurm) == [str(Path("logs") / "from-rank-0")] * 2


def test_a_single_process_or_the_variable_needs_no_store(monkeypatch, tmp_path):
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    assert agree_on_run_dir(lambda: tmp_path / "mine") == tmp_path / "mine"
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "given"))
    assert agree_on_run_dir(lambda: tmp_path / "mine", TorchElasticEnvironment()) == tmp_path / "given"


def test_runs_of_one_name_started_in_the_same_second_get_folders_of_their_own_newest_last(tiny_sd, monkeypatch,
                                                                                         tmp_path):  # fmt: skip
    from types import SimpleNamespace

    from ldm.training.run import find_resume
    from ldm.utils import run_folder
    from main import main
    from tests.conftest import write_images
    from tests.helpers import finetune_args

    monkeypatch.setattr(run_folder, "time", SimpleNamespace(strftime=lambda fmt: "2026-12-07T10-00-00"))
    made = [run_folder.make_run_dir(tmp_path / "made", "tiny") for _ in range(10)]
    assert [path.name for path in made[:3]] == ["2026-12-07T10-00-00_tiny", "2026-12-07T10-00-00.2_tiny",
                                                "2026-12-07T10-00-00.3_tiny"]  # fmt: skip
    older = tmp_path / "made" / "2026-12-07T09-59-59.7_tiny"
    older.mkdir()
    assert sorted((tmp_path / "made").glob("*_tiny"), key=run_folder.started_order) == [older, *made], ".10 after .9"

    images, logs = write_images(tmp_path / "images", n=4), tmp_path / "logs"
    for steps in (1, 2):  # two runs of one name in the same second, each in its own folder
        assert main(finetune_args(tiny_sd, images, logs, f"lightning.trainer.max_steps={steps}",
                                  "lightning.callbacks.image_logger=null")) == 0  # fmt: skip
    first, second = sorted(logs.iterdir(), key=run_folder.started_order)
    assert (first.name, second.name) == ("2026-12-07T10-00-00_tiny", "2026-12-07T10-00-00.2_tiny")
    assert find_resume("auto", logs, "tiny").ckpt.name == "step-000002.ckpt", "-r auto takes the newer run"
    other = logs / "2026-12-07T10-00-01_my_tiny"  # a newer run whose name only ends in _tiny
    shutil.copytree(first, other)
    assert find_resume("auto", logs, "tiny").run_dir == second, "my_tiny is not a run of tiny"
    assert find_resume("auto", logs, "my_tiny").run_dir == other
    assert run_folder.runs_named(logs, "tiny") == [second, first]
    assert run_folder.runs_named(tmp_path / "none", "x") == []
