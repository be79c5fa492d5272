"""Fine-tune a tiny SD folder through main.py: checkpoint, resume, export, and load in diffusers."""

import re
import time
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel
from safetensors.torch import load_file

from ldm.config import ConfigError
from ldm.weights.checkpoint import load_checkpoint
from main import main
from tests.helpers import finetune_args, run_command, run_script, train_once

REPO = Path(__file__).resolve().parents[1]


args = finetune_args


@pytest.fixture(scope="module")
def run(tiny_sd, image_folder, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("logs")
    return train_once(args(tiny_sd, image_folder, logdir), logdir)


def test_run_folder_layout(run):
    assert run.name.endswith("_tiny")
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert (run / "configs" / "project.yaml").is_file()
    assert len(list((run / "csv").glob("*/metrics.csv"))) == 1
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert (run / "images" / "step_000002.png").is_file()


def test_only_the_unet_changed(run, tiny_sd):
    ckpt = load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 3
    state = ckpt["state_dict"]
    for part, file in [
        ("unet", "diffusion_pytorch_model"),
        ("vae", "diffusion_pytorch_model"),
        ("text_encoder", "model"),
    ]:
        before = load_file(tiny_sd / part / f"{file}.safetensors")
        after = {k.removeprefix(f"{part}."): v for k, v in state.items() if k.startswith(f"{part}.")}
        after = {k.removeprefix("text_model."): v for k, v in after.items()}
        before = {k.removeprefix("text_model."): v for k, v in before.items()}
        assert before.keys() == after.keys()
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        if part == "unet":
            assert len(changed) > len(before) // 2, "most UNet tensors should have been trained"
        else:
            assert changed == [], f"frozen {part} changed: {changed[:3]}"
    assert ckpt["ldm"]["config"]["data"]["params"]["size"] == 16
    assert set(ckpt["ema_state_dict"]) == {k for k in state if k.startswith("unet.")}


def test_export_loads_in_diffusers_with_exactly_the_trained_weights(run, tmp_path):
    out = tmp_path / "pipe"
    ckpt = load_checkpoint(run / "checkpoints" / "last.ckpt")
    for ema in (False, True):
        from ldm.export import export_pipeline

        export_pipeline(run / "checkpoints" / "last.ckpt", out, ema=ema)
        pipe = StableDiffusionPipeline.from_pretrained(out, local_files_only=True)
        assert sorted(p.name for p in out.iterdir()) == [
            "ldm_config.json", "model_index.json", "scheduler", "text_encoder", "tokenizer", "unet", "vae",
        ]  # fmt: skip
        source = ckpt["ema_state_dict"] if ema else ckpt["state_dict"]
        for name, tensor in pipe.unet.state_dict().items():
            assert torch.equal(tensor, source[f"unet.{name}"]), name
        for name, tensor in pipe.vae.state_dict().items():
            assert torch.equal(tensor, ckpt["state_dict"][f"vae.{name}"]), name
    assert not torch.equal(ckpt["ema_state_dict"]["unet.conv_in.weight"], ckpt["state_dict"]["unet.conv_in.weight"])
    assert pipe.tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    image = pipe("a photo of a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (16, 16)


IDS = "49406,320,1125,539,320,2368,49407"  # "a photo of a cat" in the SD 1.x CLIP tokenizer
CHECK_EXPORT = """
import sys, torch
from safetensors.torch import load_file
from transformers import CLIPTextModel, CLIPTokenizer
from ldm.weights.checkpoint import load_checkpoint
folder, ckpt = sys.argv[1], load_checkpoint(sys.argv[2])
def plain(state, prefix=""):  # the text_model. level exists in transformers 4, not in 5
    return {k[len(prefix):].removeprefix("text_model."): v for k, v in state.items() if k.startswith(prefix)}
model = plain(CLIPTextModel.from_pretrained(folder + "/text_encoder").state_dict())
saved = plain(ckpt["state_dict"], "text_encoder.")
assert all(torch.equal(model[k], v) for k, v in saved.items()) and len(model) == len(saved), "text encoder differs"
ids = CLIPTokenizer.from_pretrained(folder + "/tokenizer")("a photo of a cat").input_ids
assert ids == [int(i) for i in sys.argv[3].split(",")], f"tokenizer differs: {ids}"
print("export ok")
"""


def test_export_loads_the_same_under_transformers_4_and_5(run, tmp_path):
    """The layout both read: `text_model.`-prefixed text encoder weights, slow and fast tokenizer files.
    Where the other supported stack is installed too (CI's second run), each side reads the other's export."""
    import sys

    from ldm.export import export_pipeline

    ckpt = run / "checkpoints" / "last.ckpt"
    here = export_pipeline(ckpt, tmp_path / "here")
    assert all(k.startswith("text_model.") for k in load_file(here / "text_encoder" / "model.safetensors"))
    assert {"vocab.json", "merges.txt", "tokenizer.json"} <= {p.name for p in (here / "tokenizer").iterdir()}
    done = run_command([sys.executable, "-c", CHECK_EXPORT, str(here), str(ckpt), IDS])
    assert done.returncode == 0, done.stderr[-2000:]
    in_compat = Path(sys.prefix).name == ".venv-compat"
    other = REPO / (".venv" if in_compat else ".venv-compat") / "bin" / "python"
    if not other.is_file():
        pytest.skip(f"{other} is not installed: nothing to cross-check against")
    there = tmp_path / "there"
    export = f"from ldm.export import export_pipeline; export_pipeline({str(ckpt)!r}, {str(there)!r})"
    done = run_command([str(other), "-c", export])
    assert done.returncode == 0, done.stderr[-2000:]
    for python, folder in ((sys.executable, there), (str(other), here)):
        done = run_command([python, "-c", CHECK_EXPORT, str(folder), str(ckpt), IDS])
        assert done.returncode == 0 and "export ok" in done.stdout, done.stderr[-2000:]


def test_export_script_and_txt2img(run, tmp_path):
    out = tmp_path / "pipe"
    ckpt = run / "checkpoints" / "last.ckpt"
    run_script("export_diffusers.py", "--ckpt", ckpt, "--out", out)
    for model in (ckpt, out):
        run_script("txt2img.py", "--model", model, "--prompt", "a cat", "--prompt", "a dog", "--n", "2",
                   "--steps", "2", "--outdir", tmp_path / "t2i")  # fmt: skip
        assert len(list((tmp_path / "t2i").glob("0*_*.png"))) == 4
    with pytest.raises(SystemExit, match="checkpoint not found"):
        run_script("export_diffusers.py", "--ckpt", tmp_path / "none.ckpt", "--out", out)


def test_export_single_file_reads_in_diffusers_as_trained(run, tiny_sd, tmp_path):
    ckpt = run / "checkpoints" / "last.ckpt"
    trained = load_checkpoint(ckpt)
    for ema, state in ((False, trained["state_dict"]), (True, trained["ema_state_dict"])):
        out = tmp_path / f"ema-{ema}.safetensors"
        run_script("export_single_file.py", "--ckpt", ckpt, "--out", out, *["--ema"] * ema)
        unet = UNet2DConditionModel.from_single_file(str(out), config=str(tiny_sd), subfolder="unet")
        for name, tensor in unet.state_dict().items():
            assert torch.equal(tensor, state[f"unet.{name}"]), name
    assert any(k.startswith("model.diffusion_model.") for k in load_file(out))


def test_finetune_from_our_own_checkpoint(run):
    from ldm.models.diffusion.ddpm import LatentDiffusion

    ckpt = load_checkpoint(run / "checkpoints" / "last.ckpt")
    for ema, state in ((False, ckpt["state_dict"]), (True, ckpt["ema_state_dict"])):
        model = LatentDiffusion(pretrained=str(run / "checkpoints" / "last.ckpt"), pretrained_ema=ema)
        model.configure_model()
        for name, tensor in model.unet.state_dict().items():
            assert torch.equal(tensor, state[f"unet.{name}"]), name


def test_finetune_from_an_original_single_file(tiny_sd, image_folder, tmp_path):
    from ldm.export import convert

    single = convert(tiny_sd, tmp_path / "tiny-sd.safetensors")
    run_dir = train_once(
        args(tiny_sd, image_folder, tmp_path / "logs", f"model.params.pretrained={single}"), tmp_path / "logs"
    )
    log = (run_dir / "train.log").read_text()
    assert f"model.params.pretrained: {single}: a custom architecture (epsilon), from the file's ldm metadata" in log
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 3
    from ldm.models.diffusion.ddpm import LatentDiffusion

    with pytest.raises(ConfigError, match="prediction_type: 'v_prediction' contradicts the pretrained weights'"):
        LatentDiffusion(pretrained=str(single), prediction_type="v_prediction").configure_model()
    with pytest.raises(ConfigError, match="pretrained_ema: applies to a single-file model.params.pretrained"):
        LatentDiffusion(pretrained=str(tiny_sd), pretrained_ema=True).configure_model()


def test_resuming_never_runs_code_from_the_checkpoint(run, tiny_sd, image_folder, tmp_path, capsys):
    import shutil

    from tests.test_single_file import Payload

    copy = shutil.copytree(run, tmp_path / "logs" / run.name)
    ckpt = torch.load(copy / "checkpoints" / "last.ckpt", weights_only=True)
    ckpt["callbacks"]["planted"] = Payload(tmp_path / "marker")
    torch.save(ckpt, copy / "checkpoints" / "last.ckpt")
    argv = args(tiny_sd, image_folder, tmp_path / "logs", "lightning.trainer.max_steps=4")
    assert main([*argv, "-r", str(copy / "checkpoints" / "last.ckpt")]) == 1
    err = capsys.readouterr().err
    # torch names the first global it refuses: the getattr that the payload's pickle calls
    assert re.search(r"refused: resuming would unpickle (builtins\.)?getattr, which can run code", err)
    assert not (tmp_path / "marker").exists()


def test_resume_continues_step_and_data_position(tiny_sd, image_folder, tmp_path, monkeypatch):
    logdir = tmp_path / "logs"
    strftime = time.strftime  # both launches start in the same second, as a fast resume can
    monkeypatch.setattr(
        time, "strftime", lambda f, *t: "2026-01-01T00-00-00" if f == "%Y-%m-%dT%H-%M-%S" else strftime(f, *t)
    )
    # 6 images, batch 2: 3 batches per epoch; stop after 4 steps, mid-way through epoch 1.
    assert main(args(tiny_sd, image_folder, logdir, "lightning.trainer.max_steps=4")) == 0
    (run_dir,) = logdir.iterdir()
    first = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert first["global_step"] == 4
    assert first["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 1, "batches_done": 1}]
    assert main(args(tiny_sd, image_folder, logdir, "lightning.trainer.max_steps=6") + ["-r", "auto"]) == 0
    assert len(list(logdir.iterdir())) == 1, "-r auto continues the same run folder"
    second = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert second["global_step"] == 6
    assert second["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 1, "batches_done": 3}]
    assert second["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"] == 6 - 1, (
        "6 batches in all: the resumed run trained on the 2 batches left of epoch 1, not a fresh epoch"
    )
    assert len(list((run_dir / "csv").glob("*/metrics.csv"))) == 2, "each launch keeps its own metrics file"


def test_resumed_run_sees_the_batches_an_unbroken_run_sees(tiny_sd, image_folder, tmp_path):
    def captions(logdir, *extra):
        record = tmp_path / f"{logdir}.jsonl"
        rec = [
            "lightning.callbacks.rec.target=tests.helpers.RecordCaptions",
            f"lightning.callbacks.rec.params.path={record}",
        ]
        assert main(args(tiny_sd, image_folder, tmp_path / logdir, *extra, *rec)) == 0
        return record.read_text().splitlines()

    unbroken = captions("a", "lightning.trainer.max_steps=5")
    assert len(captions("b", "lightning.trainer.max_steps=2")) == 2
    interrupted = captions("b", "lightning.trainer.max_steps=5", "-r", "auto")  # appends to the same record
    assert len(unbroken) == 5 and interrupted == unbroken


def test_prediction_type_follows_the_weights(tiny_sd):
    from ldm.models.diffusion.ddpm import LatentDiffusion

    model = LatentDiffusion(pretrained=str(tiny_sd))
    model.configure_model()
    assert model.prediction_type == "epsilon"
    contradicting = LatentDiffusion(pretrained=str(tiny_sd), prediction_type="v_prediction")
    with pytest.raises(ConfigError, match="contradicts the pretrained weights' prediction type 'epsilon'"):
        contradicting.configure_model()


def test_a_users_own_datamodule_plugs_in_by_target(tiny_sd, tmp_path):
    cfg = tmp_path / "user.yaml"
    cfg.write_text(
        f"model:\n  target: ldm.models.diffusion.ddpm.LatentDiffusion\n  params: {{pretrained: {tiny_sd}}}\n"
        "data:\n  target: tests.helpers.UserDataModule\n  params: {size: 16, count: 4, batch_size: 2}\n"
        "lightning:\n  trainer: {max_steps: 3}\n"
    )
    assert main(["-t", "-b", str(cfg), "-l", str(tmp_path / "logs")]) == 0
    (run_dir,) = (tmp_path / "logs").iterdir()
    assert run_dir.name.endswith("_user")
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 3
