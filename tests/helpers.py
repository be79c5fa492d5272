"""Test helpers: main.py arguments for a tiny fine-tune, and plug-ins named by `target` in configs."""

import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[1]
SD_FOLDER = REPO / "configs" / "finetune" / "sd-folder.yaml"
HUNG = 300  # seconds after which a test's command counts as hung (every one here takes well under a minute)


def clean_env() -> dict:
    """This environment without the variables an earlier in-process distributed run may have left, which
    would make Lightning in a child process believe it was launched as one rank of a job."""
    leaked = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "LDM_RUN_DIR")
    return {k: v for k, v in os.environ.items() if k not in leaked}


def run_together(commands: list[list[str]], envs: list[dict] | None = None, timeout: float = HUNG,
                 cwd: Path = REPO) -> list[subprocess.CompletedProcess]:  # fmt: skip
    """Run `commands` at once (the ranks of one job), each in a process group of its own with whatever it
    starts (Lightning's other ranks, data workers), and wait for all. Output goes to files, so a rank that
    writes a lot cannot block on a full pipe. A job still running after `timeout` seconds is a hang: every
    group is killed and the test fails, naming the command, with the end of its stderr. No process of the job
    outlives the call, however it ends (a pytest-timeout interrupt included)."""
    envs = envs or [clean_env()] * len(commands)
    with tempfile.TemporaryDirectory() as logs:
        outs = [(Path(logs) / f"{i}.out", Path(logs) / f"{i}.err") for i in range(len(commands))]
        procs = []
        try:
            for command, env, (out, err) in zip(commands, envs, outs):
                with out.open("w") as stdout, err.open("w") as stderr:
                    procs.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout, stderr=stderr,
                                                  text=True, start_new_session=True))  # fmt: skip
            deadline = time.monotonic() + timeout
            for proc, command, (_, err) in zip(procs, commands, outs):
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0))
                except subprocess.TimeoutExpired:
                    raise AssertionError(
                        f"hung: `{' '.join(map(str, command))[:300]}` still ran after {timeout:g} s and was killed "
                        f"with its process group; its stderr ends:\n{err.read_text()[-3000:]}"
                    ) from None
            return [subprocess.CompletedProcess(command, proc.returncode, out.read_text(), err.read_text())
                    for proc, command, (out, err) in zip(procs, commands, outs)]  # fmt: skip
        finally:  # what is left of a group a few seconds after its command ended (a rank that hangs) is killed;
            # a clean exit leaves only helpers finishing (the resource tracker freeing shared memory)
            grace = time.monotonic() + 10
            for proc in procs:
                while proc.poll() is not None and _group_alive(proc.pid) and time.monotonic() < grace:
                    time.sleep(0.1)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):  # the group is gone already
                    pass
                proc.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def run_command(command: list[str], env: dict | None = None, timeout: float = HUNG,
                cwd: Path = REPO) -> subprocess.CompletedProcess:  # fmt: skip
    """`run_together` for one command."""
    return run_together([command], [env or clean_env()], timeout, cwd)[0]


def run_main(*argv: str, env: dict | None = None, timeout: float = HUNG) -> subprocess.CompletedProcess:
    """main.py in a new process (where a kill -9 cannot hit pytest, and Lightning can start other ranks)."""
    return run_command([sys.executable, "main.py", *map(str, argv)], env, timeout)


NO_SD35 = "this diffusers predates SD3.5's layers (MMDiT-X, QK-norm): the Colossal-AI stack's 0.29 does"


def has_sd35_layers() -> bool:
    """Whether the installed diffusers builds SD3.5's transformer (Medium's MMDiT-X layers)."""
    from diffusers import SD3Transformer2DModel

    return "dual_attention_layers" in inspect.signature(SD3Transformer2DModel.__init__).parameters


def finetune_args(tiny_sd, images, logdir, *extra) -> list[str]:
    """main.py arguments for a 3-step fine-tune of the tiny SD on 16 px images; `extra` overrides win."""
    return [
        "-t", "-b", str(SD_FOLDER), "-l", str(logdir), "-n", "tiny", "-s", "1",
        f"model.params.pretrained={tiny_sd}", f"data.params.root={images}", "data.params.size=16",
        "data.params.batch_size=2", "data.params.num_workers=0", "lightning.trainer.max_steps=3",
        "lightning.trainer.accumulate_grad_batches=1", "lightning.trainer.log_every_n_steps=1",
        "model.params.learning_rate=1e-3",
        "lightning.callbacks.image_logger.params.every_n_steps=2",
        "lightning.callbacks.image_logger.params.num_inference_steps=2", *extra,
    ]  # fmt: skip


def recorded_losses(weights, images, tmp_path: Path, name: str, *extra: str) -> list[float]:
    """Each step's loss of a fine-tune of `weights` (`finetune_args`: 3 steps) without sample grids or flips and
    with half the captions dropped, `extra` overrides winning: for runs compared step by step."""
    logdir, rec = tmp_path / name, tmp_path / f"{name}.jsonl"
    train_once(finetune_args(weights, images, logdir, "lightning.callbacks.image_logger=null",
                             "data.params.flip=false", "data.params.caption_dropout=0.5",
                             "lightning.callbacks.rec.target=tests.helpers.RecordLosses",
                             f"lightning.callbacks.rec.params.path={rec}", *extra), logdir)  # fmt: skip
    return [json.loads(line)["loss"] for line in rec.read_text().splitlines()]


def train_once(argv: list[str], logdir: Path) -> Path:
    """Run main.py with `argv`, which must succeed, and return the one run folder it made in `logdir`."""
    from main import main

    assert main(argv) == 0
    (run_dir,) = logdir.iterdir()
    return run_dir


def run_script(name: str, *args) -> str:
    """Run `scripts/NAME` in this process with `args` as its command line; return what it printed.

    In-process, to spare each call the seconds of importing torch and diffusers again. A script
    that exits with an error message raises SystemExit carrying that message."""
    import contextlib
    import io
    import runpy
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / name
    argv, sys.argv = sys.argv, [str(script), *map(str, args)]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    return printed.getvalue()


class RecordCaptions(pl.Callback):
    """Append the captions of every training batch to a file, one JSON line per batch."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(batch["caption"]) + "\n")


class UserDataModule(pl.LightningDataModule):
    """What a user might write: their own LightningDataModule yielding pixel_values and captions."""

    def __init__(self, size: int = 16, count: int = 4, batch_size: int = 2) -> None:
        super().__init__()
        self.size, self.count, self.batch_size = size, count, batch_size

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        examples = [
            {"pixel_values": torch.rand(3, self.size, self.size, generator=g) * 2 - 1, "caption": f"user example {i}"}
            for i in range(self.count)
        ]
        return DataLoader(examples, batch_size=self.batch_size)


class RecordZeroBytes(pl.Callback):
    """At the end of a ZeRO run, write what its optimizer really holds for the UNet, in bytes (JSON)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_end(self, trainer, pl_module) -> None:
        optimizer = trainer.strategy.optimizers[0]
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        unet = list(pl_module.unet.parameters())
        masters = [optimizer.working_to_master_param[id(p)] for p in unet]
        moments = [t for m in masters for t in optimizer.optim.state[m].values() if torch.is_tensor(t) and t.dim()]
        record = {
            "working": sum(p.numel() * p.element_size() for p in unet),
            "master": sum(m.numel() * m.element_size() for m in masters),
            "moments": sum(t.numel() * t.element_size() for t in moments),
            "master_device": str(masters[0].device),
        }
        self.path.write_text(json.dumps(record))


class RecordLosses(pl.Callback):
    """Append `{"step", "loss"}` of every training batch to a JSON-lines file (loss null when skipped)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].item() if outputs else None  # empty when training_step skipped the batch
        with self.path.open("a") as f:
            f.write(json.dumps({"step": trainer.global_step, "loss": loss}) + "\n")


class SendSignal(pl.Callback):
    """Send `signal` to this process at the end of step `step` (on rank `rank` only, or every rank when it is
    None: a lost node), or to its whole process group with `group` (a cancelled job: its helper processes
    too; only in a process that `run_main` started, in a group of its own); each rank writes `RANK.done` into
    `done_dir` when its fit ends, so a test can see that every rank got out."""

    def __init__(self, step: int, signal: str, rank: int | None = 0, done_dir: str | None = None,
                 group: bool = False) -> None:  # fmt: skip
        self.step, self.signal, self.rank, self.done_dir, self.group = step, signal, rank, done_dir, group

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            sig = getattr(signal, self.signal)
            os.killpg(os.getpgrp(), sig) if self.group else os.kill(os.getpid(), sig)

    def teardown(self, trainer, pl_module, stage) -> None:
        if self.done_dir:
            (Path(self.done_dir) / f"{trainer.global_rank}.done").write_text(str(trainer.global_step))


class _KillWhenPickled:
    def __reduce__(self):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


class KillDuringSave(pl.Callback):
    """kill -9 this process while it writes the checkpoint of step `step`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_step == self.step:
            checkpoint["kill"] = _KillWhenPickled()


class PoisonBatch(pl.Callback):
    """Make the batches of the given steps (1-based, as logged) NaN: a transient non-finite loss."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = set(steps)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step + 1 in self.steps:
            batch["pixel_values"].fill_(float("nan"))


class RecordSamples(pl.Callback):
    """Append `{"step", "keys", "dropped", "loss"}` of every training batch to `DIR/samples-RANK.jsonl`: which
    samples (`source/key`) the batch held and which had their caption dropped."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        row = {
            "step": trainer.global_step,
            "keys": [f"{s}/{k}" for s, k in zip(batch["source"], batch["key"])],
            "dropped": [caption == "" for caption in batch["caption"]],
            "loss": outputs["loss"].item() if outputs else None,
        }
        with (self.folder / f"samples-{trainer.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")


class RecordShards(pl.Callback):
    """Write `{"local": N, "total": M}` to `DIR/shards-RANK.json` at the start of training: how many of the
    denoiser's parameter values this process holds (its shard, under FSDP) of how many in all."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_start(self, trainer, pl_module) -> None:
        params = list(getattr(pl_module, pl_module.denoiser_name).parameters())
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
        row = {"local": local, "total": sum(p.numel() for p in params)}
        (self.folder / f"shards-{trainer.global_rank}.json").write_text(json.dumps(row))


class SaveStartWeights(pl.Callback):
    """Save the denoiser's weights as training starts (after any pretrained weights are loaded) to `path`."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_start(self, trainer, pl_module) -> None:
        module = getattr(pl_module, pl_module.denoiser_name)
        torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, self.path)


class RecordBatches(pl.Callback):
    """Append `{"step", "shape", "captions"}` of every training batch (its pixels' or latents' shape) to a
    JSON-lines file."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        shape = list(batch.get("pixel_values", batch.get("latents")).shape)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": trainer.global_step, "shape": shape, "captions": batch["caption"]}) + "\n")


class RecordWeights(pl.Callback):
    """Save the denoiser's weights (fp32, on the CPU) after every optimizer step to `folder/step-N.pt`, and each
    rank's EMA share (how many numbers its average holds) at the end of training to `folder/ema-RANK.json`."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.is_global_zero:
            module = getattr(pl_module, pl_module.denoiser_name)
            weights = {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}
            torch.save(weights, self.folder / f"step-{trainer.global_step}.pt")

    def on_train_end(self, trainer, pl_module) -> None:
        from ldm.training.callbacks.ema import EMA

        (ema,) = [c for c in trainer.callbacks if isinstance(c, EMA)]
        share = {"numel": sum(t.numel() for t in ema.shadow.values())}
        (self.folder / f"ema-{trainer.global_rank}.json").write_text(json.dumps(share))
