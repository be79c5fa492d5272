"""The same global batches at any number of processes: 1 process at batch 16 and 2 at batch 8 (DDP over gloo,
fp32) train on the same samples at every step, with the same noise, to the same weights; a run killed mid-epoch
on one world size resumes on the other exactly; a resume that cannot be exact says so, or is refused."""

import json
import shutil
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel

from ldm.training.strategies.fsdp import CPU_CAPABLE
from main import main
from tests.helpers import clean_env, finetune_args, run_main, run_script, run_together
from tests.test_shards import TINY, args, clean_up_after_killed_runs, recorded  # noqa: F401 (an autouse fixture)

pytestmark = pytest.mark.exclusive  # most start 2 ranks and all stream shards
GLOBAL_BATCH = 16  # 40 samples an epoch: 2 steps an epoch, 4 steps are 2 epochs


# Checkpoint every step; every rank is killed with kill -9 at the end of step 4 (a lost node), so the last
# checkpoint is step 3's: one batch into the second epoch.
KILLED = ["lightning.modelcheckpoint.params.every_n_train_steps=1",
          "lightning.callbacks.kill.target=tests.helpers.SendSignal",
          "lightning.callbacks.kill.params={step: 4, signal: SIGKILL, rank: null}"]  # fmt: skip


def train(tiny_sd, shards, tmp: Path, world: int, *extra: str, rec: str = "rec", code: int = 0):
    """Train up to step 4 at the global batch on `world` processes, logging to `tmp/logs`; return the run folder
    and, per step, the samples of every rank: their keys and whether their caption was dropped, sorted by key."""
    (tmp / rec).mkdir(parents=True)
    argv = args(tiny_sd, shards, tmp / "logs", tmp / rec, f"data.params.batch_size={GLOBAL_BATCH // world}",
                "lightning.trainer.max_steps=4", *extra)  # fmt: skip
    if world > 1:
        argv += [f"lightning.trainer.devices={world}"]
        if not any(arg.startswith("lightning.trainer.strategy") for arg in extra):
            argv += ["lightning.trainer.strategy=ddp"]
    if world == 1 and code in (0, 2):
        assert main(argv) == code
    else:  # Lightning starts the other ranks by running this command again; kill -9 must not hit pytest
        done = run_main(*argv)
        assert done.returncode == code, done.stderr[-3000:]
    (run_dir,) = (tmp / "logs").iterdir()
    return run_dir, batches(tmp / rec, world) if code != 2 else {}


def batches(rec: Path, world: int) -> dict[int, dict]:
    """Per step, the samples of every rank's batch: key -> caption dropped, sorted by key."""
    per_rank = [recorded(rec, rank) for rank in range(world)]
    steps = {}
    for step in per_rank[0]:
        samples = [(k, d) for rows in per_rank for k, d in zip(rows[step]["keys"], rows[step]["dropped"])]
        steps[step] = dict(sorted(samples))
    return steps


def unet_weights(run_dir: Path, checkpoint: str) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "checkpoints" / checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("unet.")}


@pytest.fixture(scope="module")
def one_process(tiny_sd, shards, tmp_path_factory):
    """The reference: 4 steps unbroken on one process at batch 16, checkpointed every step."""
    return train(tiny_sd, shards, tmp_path_factory.mktemp("one"), 1, KILLED[0])


def test_two_processes_train_on_the_same_global_batches_to_the_same_weights(one_process, killed):
    run_dir, steps = killed(2)
    reference_dir, reference = one_process
    assert sorted(steps) == [1, 2, 3, 4] and all(len(samples) == GLOBAL_BATCH for samples in steps.values())
    assert steps == reference, "each step: the same 16 samples, the same captions dropped"
    assert steps[1] != steps[3], "the second epoch is shuffled anew"
    assert_same_weights(run_dir, reference_dir, "step-000003.ckpt")  # its last checkpoint before the kill


def assert_same_weights(run_dir: Path, reference_dir: Path, checkpoint: str = "last.ckpt") -> None:
    ours, theirs = unet_weights(run_dir, checkpoint), unet_weights(reference_dir, checkpoint)
    assert ours.keys() == theirs.keys()
    for name, weight in ours.items():
        torch.testing.assert_close(weight, theirs[name], rtol=0, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def killed(tiny_sd, shards, one_process, tmp_path_factory):
    """world -> (the run folder, its batches) of a run on that many processes killed after step 4 (made once)."""
    made = {}

    def make(world: int) -> tuple[Path, dict[int, dict]]:
        if world not in made:
            tmp = tmp_path_factory.mktemp(f"killed-on-{world}")
            made[world] = train(tiny_sd, shards, tmp, world, *KILLED, code=-signal.SIGKILL)
            assert (made[world][0] / "checkpoints" / "step-000003.ckpt").exists()
        return made[world]

    return make


@pytest.mark.parametrize(("killed_on", "resumed_on"), [(2, 1), (1, 2)])
def test_a_run_killed_mid_epoch_resumes_exactly_on_another_number_of_processes(
    tiny_sd, shards, one_process, killed, tmp_path, killed_on, resumed_on
):
    reference_dir, reference = one_process
    run_dir, before = killed(killed_on)
    assert before == reference, "steps 1 to 4 as the unbroken run"
    shutil.copytree(run_dir.parent, tmp_path / "logs")
    run_dir, after = train(tiny_sd, shards, tmp_path, resumed_on, "-r", "auto", rec="resumed")
    assert after == {4: reference[4]}, "step 4 again, from step 3's checkpoint: the unbroken run's samples"
    assert_same_weights(run_dir, reference_dir)


def test_a_resume_with_another_seed_says_it_is_not_exact_and_goes_on(tiny_sd, shards, killed, tmp_path):
    shutil.copytree(killed(1)[0].parent, tmp_path / "logs")
    run_dir, after = train(tiny_sd, shards, tmp_path, 1, "-r", "auto", "data.params.seed=18", rec="resumed")
    log = (run_dir / "train.log").read_text()
    assert "resume is not exact: seed 17 -> 18; going on from sample 16 of epoch 1 in the new order" in log
    assert sorted(after) == [4] and len(after[4]) == GLOBAL_BATCH


def test_an_inexact_resume_can_be_refused(tiny_sd, shards, killed, tmp_path, capsys):
    shutil.copytree(killed(1)[0].parent, tmp_path / "logs")
    train(tiny_sd, shards, tmp_path, 1, "-r", "auto", "data.params.batch_size=8", "data.params.inexact_resume=refuse",
          rec="resumed", code=2)  # fmt: skip
    err = capsys.readouterr().err
    assert "cannot resume the checkpoint's sample order exactly: global batch 16 -> 8" in err
    assert "data.params.inexact_resume: warn" in err


@pytest.mark.skipif(not CPU_CAPABLE, reason="FSDP2 on a CPU needs torch >= 2.6 (the Colossal-AI stack has 2.5.1)")
def test_fsdp_shards_the_unet_over_two_processes_saves_both_ways_resumes_exactly_and_exports(
    tiny_sd, shards, one_process, tmp_path
):
    """FSDP2 on 2 processes, killed after step 4: sharded checkpoints (a folder per step); resumed from step 3's
    folder writing full ones (a file), to the unbroken single process's samples and weights; both export."""
    reference_dir, reference = one_process
    fsdp = ["lightning.trainer.strategy.target=ldm.training.strategies.fsdp.FSDPStrategy",
            "lightning.callbacks.shards.target=tests.helpers.RecordShards",
            f"lightning.callbacks.shards.params.folder={tmp_path}"]  # fmt: skip
    sharded = "lightning.trainer.strategy.params.state_dict=sharded"
    run_dir, before = train(tiny_sd, shards, tmp_path, 2, *fsdp, sharded, *KILLED, code=-signal.SIGKILL)
    assert before == reference, "each step: the same 16 samples as one process at batch 16"
    held = [json.loads((tmp_path / f"shards-{rank}.json").read_text()) for rank in (0, 1)]
    total = sum(w.numel() for w in unet_weights(reference_dir, "last.ckpt").values())
    assert held[0]["total"] == held[1]["total"] == total == held[0]["local"] + held[1]["local"]
    assert abs(held[0]["local"] - held[1]["local"]) < 0.05 * total, f"each process holds about half: {held}"
    assert "fsdp: unet sharded over 2 processes" in (run_dir / "train.log").read_text()
    folder = run_dir / "checkpoints" / "step-000003.ckpt"
    assert folder.is_dir() and len(list(folder.glob("*.distcp"))) == 2, "one shard per process"

    _, after = train(tiny_sd, shards, tmp_path, 2, *fsdp, "-r", "auto", rec="resumed")
    assert after == {4: reference[4]}
    assert (run_dir / "checkpoints" / "last.ckpt").resolve().is_file(), "state_dict: full (the default) is a file"
    assert_same_weights(run_dir, reference_dir)
    for checkpoint, step in ((folder, 3), (run_dir / "checkpoints" / "last.ckpt", 4)):
        out = tmp_path / f"export-{step}"
        run_script("export_diffusers.py", "--ckpt", checkpoint, "--out", out / "pipe")
        run_script("export_single_file.py", "--ckpt", checkpoint, "--out", out / "model.safetensors")
        exported = UNet2DConditionModel.from_pretrained(out / "pipe" / "unet").state_dict()
        expected = unet_weights(reference_dir, f"step-{step:06d}.ckpt")
        for name, weight in expected.items():
            torch.testing.assert_close(exported[name.removeprefix("unet.")], weight, rtol=0, atol=1e-5, msg=name)
        assert (out / "model.safetensors").stat().st_size > 0


def test_fsdp_settings_are_checked():
    from ldm.config import ConfigError
    from ldm.training.strategies.fsdp import FSDPStrategy

    with pytest.raises(ConfigError, match="mixed_precision: got 'fp8'; valid: fp32, bf16, fp16"):
        FSDPStrategy(mixed_precision="fp8")
    with pytest.raises(ConfigError, match="state_dict: got 'both'; valid: full, sharded"):
        FSDPStrategy(state_dict="both")


LAUNCHERS = {  # what torchrun and SLURM's srun set in each process they start (on one node here), beside RANK
    "torchrun": {"TORCHELASTIC_RUN_ID": "job", "GROUP_RANK": "0", "LOCAL_RANK": "{rank}", "LOCAL_WORLD_SIZE": "2"},
    "slurm": {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "{rank}", "SLURM_LOCALID": "{rank}",
              "SLURM_NODEID": "0", "SLURM_JOB_NAME": "pretrain", "SLURM_NODELIST": "127.0.0.1", "SLURM_JOB_ID": "7"},
}  # fmt: skip


# srun's variables are Lightning's to read (tests/test_launch.py checks ours under both): -m slow runs it here too
@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("slurm", marks=pytest.mark.slow)])
def test_processes_started_by_torchrun_or_srun_train_as_one_process_does(tiny_sd, shards, one_process, tmp_path,
                                                                        launcher):  # fmt: skip
    reference_dir, reference = one_process
    (tmp_path / "rec").mkdir()
    argv = args(tiny_sd, shards, tmp_path / "logs", tmp_path / "rec", "data.params.batch_size=8", KILLED[0],
                "lightning.trainer.max_steps=4", "lightning.trainer.strategy=ddp", "lightning.trainer.devices=2",
                "lightning.trainer.num_nodes=1")  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    envs = []
    for rank in range(2):
        env = {**clean_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)}
        env["WORLD_SIZE"] = "2"
        envs.append({**env, **{k: v.format(rank=rank) for k, v in LAUNCHERS[launcher].items()}})
    for done in run_together([[sys.executable, "main.py", *argv]] * 2, envs):
        assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "logs").iterdir()
    assert batches(tmp_path / "rec", 2) == reference
    assert_same_weights(run_dir, reference_dir)


def test_the_run_log_gives_one_batchs_flops_and_the_throughput_per_process(tiny_sd, shards, one_process):
    import re

    from omegaconf import OmegaConf
    from torch.utils.flop_counter import FlopCounterMode

    from ldm.data.shard_format import read_manifest

    run_dir, _ = one_process
    log = (run_dir / "train.log").read_text()
    counted = 16 * float(re.search(r"; (\S+) FLOPs per image \(counted once\)", log)[1])
    summary = re.search(r"throughput: .* images/s \((\S+) per process\); (\S+) TFLOP/s per process (.*)", log)
    assert summary, log[-2000:]
    assert "(no dense float32 peak known for cpu: no MFU)" in summary[3]
    assert float(summary[2]) == pytest.approx(float(summary[1]) * counted / 16 / 1e12, rel=0.01)
    # the same count, made here: the UNet's forward and backward at batch 16 (the encoders do not run)
    manifest = read_manifest(shards["a"], "test")
    unet = UNet2DConditionModel(**OmegaConf.to_container(OmegaConf.load(TINY).model.params.unet.config))
    x = torch.randn(16, *manifest["latent_shape"])
    cond = torch.randn(16, *manifest["cond_shapes"]["encoder_hidden_states"])
    with FlopCounterMode(display=False) as here:
        unet(x, torch.randint(0, 1000, (16,)), cond).sample.square().mean().backward()
    assert counted == pytest.approx(here.get_total_flops(), rel=0.02)


def test_mfu_is_the_achieved_flops_per_process_over_the_dense_peak():
    from types import SimpleNamespace

    from ldm.training.callbacks.throughput import Throughput, compute_dtype

    assert compute_dtype("bf16-mixed") == compute_dtype("bf16-true") == torch.bfloat16
    assert compute_dtype("16-mixed") == torch.float16 and compute_dtype("32-true") == torch.float32
    meter = Throughput()
    meter._images, meter.flops_per_image, meter.peak = 2000, 3e12, 989e12  # 2,000 images in 10 s on 2 processes
    rates = meter._rates(SimpleNamespace(world_size=2), steps=5, elapsed=10.0)
    assert rates["perf/images_per_s"] == 200 and rates["perf/images_per_s_per_process"] == 100
    assert rates["perf/tflops_per_s_per_process"] == pytest.approx(300)
    assert rates["perf/mfu"] == pytest.approx(300 / 989)


def test_a_folder_trains_to_the_same_weights_on_two_processes_as_on_one(tiny_sd, tmp_path):
    """Data from a folder: 2 processes at batch 2 and 1 process at batch 4 (flips, caption dropout and the VAE's
    posterior drawn) train to the same weights, because each example carries its `sample_id` and its noise,
    timestep and latent are drawn from it, not from the generator every rank seeds the same."""
    from tests.conftest import write_images

    images = write_images(tmp_path / "images", n=8)
    runs = {}
    for world in (1, 2):
        logs = tmp_path / f"logs-{world}"
        argv = finetune_args(tiny_sd, images, logs, f"data.params.batch_size={4 // world}", "-s", "3",
                             "lightning.trainer.max_steps=4", "data.params.caption_dropout=0.25",
                             "lightning.callbacks.image_logger=null", "lightning.callbacks.ema=null")  # fmt: skip
        if world == 1:
            assert main(argv) == 0
        else:
            done = run_main(*argv, "lightning.trainer.devices=2", "lightning.trainer.strategy=ddp")
            assert done.returncode == 0, done.stderr[-3000:]
        (runs[world],) = logs.iterdir()
    assert_same_weights(runs[2], runs[1])
