"""EMA as MosaicML used it: nothing kept before its start step, then an average that starts as the weights; the
average optionally in host memory; on two processes each keeps half (DDP: half the parameters, FSDP: its shards)
and the checkpoint holds the same average as one process's."""

import json

import pytest
import torch

from ldm.training.callbacks.ema import EMA
from ldm.training.strategies.fsdp import CPU_CAPABLE
from main import main
from tests.helpers import finetune_args
from tests.test_world_sizes import train


def ema_args(folder, *params: str) -> list[str]:
    return ["lightning.callbacks.ema.target=ldm.training.callbacks.ema.EMA", "lightning.callbacks.ema.params.decay=0.9",
            "lightning.callbacks.weights.target=tests.helpers.RecordWeights",
            f"lightning.callbacks.weights.params.folder={folder}",
            *(f"lightning.callbacks.ema.params.{p}" for p in params)]  # fmt: skip


def expected_average(folder, start: int, end: int, decay: float = 0.9) -> dict[str, torch.Tensor]:
    """The average by its definition: the weights at `start`, then min(decay, (1 + n) / (10 + n)) at update n."""
    average = torch.load(folder / f"step-{start}.pt")
    for n, step in enumerate(range(start + 1, end + 1), start=1):
        d = min(decay, (1 + n) / (10 + n))
        weights = torch.load(folder / f"step-{step}.pt")
        average = {k: d * v + (1 - d) * weights[k] for k, v in average.items()}
    return average


def ema_of(run_dir) -> tuple[dict[str, torch.Tensor], int]:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    shadow = {k.removeprefix("unet."): v for k, v in ckpt["ema_state_dict"].items()}
    return shadow, ckpt["ema_updates"]


@pytest.mark.parametrize("device", [None, "cpu"])
def test_the_average_starts_at_its_step_as_the_weights(tiny_sd, image_folder, tmp_path, device):
    logs, weights = tmp_path / "logs", tmp_path / "weights"
    weights.mkdir()
    extra = [f"device={device}"] if device else []
    argv = finetune_args(tiny_sd, image_folder, logs, "lightning.trainer.max_steps=5",
                         "lightning.callbacks.image_logger=null",
                         "lightning.modelcheckpoint.params.every_n_train_steps=2",
                         "lightning.modelcheckpoint.params.keep=3",
                         *ema_args(weights, "start_step=3", *extra))  # fmt: skip
    assert main(argv) == 0
    (run_dir,) = logs.iterdir()
    early = torch.load(run_dir / "checkpoints" / "step-000002.ckpt", map_location="cpu", weights_only=True)
    assert early["ema_state_dict"] == {} and early["ema_updates"] == 0, "nothing kept before the start step"
    shadow, updates = ema_of(run_dir)
    assert updates == 3
    expected = expected_average(weights, 3, 5)
    assert shadow.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(shadow[name], value, rtol=0, atol=1e-6, msg=name)
    if device is None:  # stopped at step 4, resumed: the same average, to the bit
        stop = ["lightning.callbacks.stop.target=tests.helpers.SendSignal",
                "lightning.callbacks.stop.params={step: 4, signal: SIGTERM}"]  # fmt: skip
        assert main([*argv[:4], str(tmp_path / "broken"), *argv[5:], *stop]) == 128 + 15
        assert main([*argv[:4], str(tmp_path / "broken"), *argv[5:], "-r", "auto"]) == 0
        (resumed,) = (tmp_path / "broken").iterdir()
        again, updates = ema_of(resumed)
        assert updates == 3 and all(torch.equal(again[k], shadow[k]) for k in shadow)


def test_settings_are_checked():
    for kwargs, message in [({"decay": 1.0}, "decay: got 1.0"), ({"start_step": -1}, "start_step: got 1, -1"),
                            ({"device": "cuda"}, "device: got 'cuda'")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            EMA(**kwargs)


NEEDS_FSDP2_ON_CPU = pytest.mark.skipif(not CPU_CAPABLE, reason="FSDP2 on a CPU needs torch >= 2.6")


@pytest.mark.exclusive
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=NEEDS_FSDP2_ON_CPU)])
def test_two_processes_each_keep_half_and_save_one_processs_average(tiny_sd, shards, tmp_path, strategy):
    """1 process at batch 16 against 2 at batch 8 (the same global batches, so the same weights within 1e-5):
    each of the 2 averages about half the numbers, and the saved average is the single process's."""
    runs = {}
    for world in (1, 2):
        folder = tmp_path / f"weights-{world}"
        folder.mkdir()
        fsdp = strategy == "fsdp" and world == 2
        extra = ["lightning.trainer.strategy.target=ldm.training.strategies.fsdp.FSDPStrategy"] if fsdp else []
        run_dir, _ = train(tiny_sd, shards, tmp_path / f"w{world}", world, *ema_args(folder, "start_step=2"), *extra)
        runs[world] = (run_dir, folder)
    one, _ = ema_of(runs[1][0])
    two, updates = ema_of(runs[2][0])
    assert updates == 3 and one.keys() == two.keys()
    for name, value in one.items():
        torch.testing.assert_close(two[name], value, rtol=0, atol=1e-5, msg=name)
    total = json.loads((runs[1][1] / "ema-0.json").read_text())["numel"]
    shares = [json.loads((runs[2][1] / f"ema-{rank}.json").read_text())["numel"] for rank in (0, 1)]
    assert sum(shares) == total, "every number averaged once: no process keeps another's share"
    assert abs(shares[0] - shares[1]) < 0.1 * total, f"each process keeps about half: {shares} of {total}"
