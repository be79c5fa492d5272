"""ColossalAIStrategy on a CPU: ZeRO fine-tune through main.py, checkpoint folder, resume, export, config checks.

Runs in the Colossal-AI environment (`make test-compat`, installed with `.[colossalai]`); skipped
where Colossal-AI is not installed. The CPU needs the test-side patches in `tests/colossalai_cpu.py`.
Gemini cannot run without CUDA (see ../shared/FACTS.md); its config checks are tested here and its
training is checked by `benchmarks/gpu_8gb.py` on a GPU.
"""

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("colossalai")

from ldm.config import ConfigError, load_config
from ldm.training.checks import check_config  # noqa: E402
from ldm.weights.checkpoint import load_checkpoint
from ldm.weights.formats import COLOSSAL_FILES  # noqa: E402
from main import main  # noqa: E402
from tests import colossalai_cpu  # noqa: E402
from tests.helpers import SD_FOLDER, finetune_args, train_once  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

colossalai_cpu.apply()

ZERO = (
    "lightning.trainer.strategy={target: ldm.training.strategies.ColossalAIStrategy, "
    "params: {plugin: zero, zero: {stage: 2, cpu_offload: true, overlap_communication: false}}}"
)


@pytest.fixture(scope="module", autouse=True)
def close_process_group():
    yield
    if torch.distributed.is_initialized():  # the strategy's gloo group; later tests train without one
        torch.distributed.destroy_process_group()


def args(tiny_sd, images, logdir, *extra):
    colossal = [
        "model.params.optimizer.target=ldm.training.strategies.HybridAdam",
        "lightning.trainer.precision=bf16-mixed",
    ]
    return finetune_args(tiny_sd, images, logdir, *colossal, ZERO, *extra)


@pytest.fixture(scope="module")
def run(tiny_sd, image_folder, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("zero-logs")
    return train_once(args(tiny_sd, image_folder, logdir), logdir)


def test_checkpoint_is_a_booster_folder(run):
    ckpt = run / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(COLOSSAL_FILES.values())
    assert (ckpt / "model" / "model.safetensors.index.json").is_file()
    assert list((ckpt / "optimizer").glob("*.index.json"))
    assert not list(ckpt.parent.glob("*.partial")), "the folder is written aside, then swapped in"
    assert (run / "images" / "step_000002.png").is_file(), "sample grids work under ZeRO"


def test_consolidated_checkpoint_holds_fp32_masters_and_untouched_frozen_parts(run, tiny_sd):
    ckpt = load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 3
    state = ckpt["state_dict"]
    masters = load_file(run / "checkpoints" / "last.ckpt" / COLOSSAL_FILES["master"])
    assert set(masters) == {k for k in state if k.startswith("unet.")}
    assert all(state[k].dtype == torch.float32 and torch.equal(state[k], masters[k]) for k in masters)
    before = load_file(tiny_sd / "unet" / "diffusion_pytorch_model.safetensors")
    changed = [k for k in before if not torch.equal(before[k], state[f"unet.{k}"])]
    assert len(changed) > len(before) // 2, "the UNet trained"
    vae = load_file(tiny_sd / "vae" / "diffusion_pytorch_model.safetensors")
    for k, v in vae.items():  # frozen, stored in the training precision
        assert torch.equal(state[f"vae.{k}"], v.to(torch.bfloat16)), k
    assert set(ckpt["ema_state_dict"]) == set(masters)


def test_resume_restores_exactly_what_was_saved(run, tiny_sd, image_folder, tmp_path):
    """Load through the booster, save again without a step: weights, masters and Adam states are bit-identical."""
    saved = tmp_path / "saved.ckpt"
    shutil.copytree(run / "checkpoints" / "last.ckpt", saved)
    assert main(args(tiny_sd, image_folder, run.parent, "-r", str(run))) == 0  # max_steps 3: nothing to train
    again = run / "checkpoints" / "last.ckpt"
    for sub in ("model", "optimizer"):
        for file in sorted((saved / sub).iterdir()):
            if file.suffix == ".safetensors":
                a, b = load_file(file), load_file(again / sub / file.name)
            elif file.suffix == ".json":
                a, b = file.read_text(), (again / sub / file.name).read_text()
            else:
                a = torch.load(file, weights_only=True)
                b = torch.load(again / sub / file.name, weights_only=True)
            assert _equal(a, b), f"{sub}/{file.name} changed across load and save"
    assert _equal(load_file(saved / "master.safetensors"), load_file(again / "master.safetensors"))


def test_resuming_a_folder_never_runs_code_from_its_optimizer_shards(run, tiny_sd, image_folder, tmp_path, capsys):
    """Colossal-AI reads its optimizer shards with torch's default, which unpickles anything on torch 2.5;
    ours are read weights-only. The planted shard's checksum is rewritten too, as an attacker would."""
    from ldm.utils.atomic import publish
    from tests.test_single_file import Payload

    copy = shutil.copytree(run, tmp_path / "logs" / run.name, symlinks=True)
    folder = (copy / "checkpoints" / "last.ckpt").resolve()
    for shard in sorted((folder / COLOSSAL_FILES["optimizer"]).glob("*.bin")):
        state = torch.load(shard, weights_only=True)
        payload = Payload(tmp_path / "marker")
        torch.save([*state, payload] if isinstance(state, list) else {**state, "planted": payload}, shard)
    partial = folder.with_name(folder.name + ".partial")
    folder.rename(partial)
    publish(partial, folder)
    try:
        code = main(args(tiny_sd, image_folder, tmp_path / "logs", "lightning.trainer.max_steps=4", "-r", "auto"))
    finally:  # whatever Colossal-AI makes of the planted shard afterwards
        assert not (tmp_path / "marker").exists(), "the planted object ran"
    assert code == 1
    err = capsys.readouterr().err
    # torch names the first global it refuses: the getattr that the payload's pickle calls
    assert re.search(r"refused: resuming would unpickle (builtins\.)?getattr, which can run code", err)
    assert not (tmp_path / "marker").exists()


def _equal(a, b, exact: bool = True) -> bool:
    """Nested dicts / lists of tensors alike: bit for bit, or (exact=False) within float tolerance."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k], exact) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y, exact) for x, y in zip(a, b))
    if torch.is_tensor(a):
        if exact:
            return a.dtype == b.dtype and torch.equal(a, b)
        return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-7)
    return a == b


def test_resume_continues_training(tiny_sd, image_folder, tmp_path):
    logdir = tmp_path / "logs"
    assert main(args(tiny_sd, image_folder, logdir, "lightning.trainer.max_steps=2")) == 0
    assert main(args(tiny_sd, image_folder, logdir, "lightning.trainer.max_steps=4", "-r", "auto")) == 0
    (run_dir,) = logdir.iterdir()
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 4
    # 6 images, batch 2: 3 batches per epoch, so step 4 is one batch into epoch 1.
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 1, "batches_done": 1}]


def test_export_from_the_folder(run, tmp_path):
    from diffusers import StableDiffusionPipeline

    from ldm.export import export_pipeline

    export_pipeline(run / "checkpoints" / "last.ckpt", tmp_path / "pipe")
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path / "pipe", local_files_only=True)
    masters = load_file(run / "checkpoints" / "last.ckpt" / COLOSSAL_FILES["master"])
    for name, tensor in pipe.unet.state_dict().items():
        assert torch.equal(tensor, masters[f"unet.{name}"]), name
    image = pipe("a cat", num_inference_steps=2, height=16, width=16, output_type="np").images[0]
    assert image.shape == (16, 16, 3)


def unet_after(logdir, argv) -> dict[str, torch.Tensor]:
    state = load_checkpoint(train_once(argv, logdir) / "checkpoints" / "last.ckpt")["state_dict"]
    return {k: v.float() for k, v in state.items() if k.startswith("unet.")}


def test_zero_with_hybrid_adam_trains_like_plain_adamw(tiny_sd, image_folder, tmp_path):
    """fp32 ZeRO-2 with CPU offload, HybridAdam, accumulation 2 and clipping 0.5 vs Lightning's default strategy
    with torch AdamW: the same seed and data give the same weights."""
    common = ["lightning.trainer.precision=32-true", "lightning.trainer.accumulate_grad_batches=2",
              "lightning.trainer.gradient_clip_val=0.5", "lightning.trainer.max_steps=2",
              "model.params.lr_warmup_steps=0",
              "lightning.callbacks.image_logger.params.every_n_steps=100"]  # fmt: skip
    plain = args(tiny_sd, image_folder, tmp_path / "plain", *common)
    plain = [a for a in plain if a != ZERO and "HybridAdam" not in a]
    ours = unet_after(tmp_path / "zero", args(tiny_sd, image_folder, tmp_path / "zero", *common))
    reference = unet_after(tmp_path / "plain", plain)
    before = load_file(tiny_sd / "unet" / "diffusion_pytorch_model.safetensors")
    moved = max((reference[f"unet.{k}"] - v).abs().max().item() for k, v in before.items())
    assert moved > 1e-4, "the reference run trained"
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def config_error(tmp_path, *overrides) -> str:
    cfg, sources = load_config(
        [SD_FOLDER], [f"model.params.pretrained={tmp_path}", f"data.params.root={tmp_path}", *overrides]
    )
    with pytest.raises(ConfigError) as err:
        check_config(cfg, sources)
    return str(err.value)


NO_CALLBACKS = ("lightning.callbacks.image_logger=null", "lightning.callbacks.ema=null")
GEMINI = "lightning.trainer.strategy={target: ldm.training.strategies.ColossalAIStrategy, params: {plugin: gemini}}"


def test_gemini_needs_an_optimizer_it_can_drive(tmp_path):
    message = config_error(tmp_path, GEMINI, *NO_CALLBACKS)
    assert message.startswith("model.params.optimizer.target")
    assert "torch.optim.AdamW cannot be driven by Gemini; use ldm.training.strategies.HybridAdam" in message


def test_gemini_rejects_callbacks_that_read_weights_between_steps(tmp_path):
    message = config_error(tmp_path, GEMINI, "model.params.optimizer.target=ldm.training.strategies.HybridAdam")
    assert message.startswith("lightning.callbacks.image_logger") and "use plugin: zero" in message


def test_plugin_specific_settings_and_clipping_by_value(tmp_path):
    zero_with_gemini_block = (
        "lightning.trainer.strategy={target: ldm.training.strategies.ColossalAIStrategy, "
        "params: {plugin: zero, gemini: {offload_optim_frac: 1.0}}}"
    )
    assert "params.gemini (command line): applies to plugin gemini only" in config_error(
        tmp_path, zero_with_gemini_block
    )
    misspelt = (
        "lightning.trainer.strategy={target: ldm.training.strategies.ColossalAIStrategy, "
        "params: {plugin: zero, zero: {stages: 2}}}"
    )
    assert config_error(tmp_path, misspelt).startswith(
        "lightning.trainer.strategy.params.zero.stages (command line): unknown key; valid: stage, cpu_offload"
    )
    assert "clips by norm only" in config_error(tmp_path, ZERO, "lightning.trainer.gradient_clip_algorithm=value")
    assert "Gemini trains in fp16 or bf16" in config_error(
        tmp_path,
        GEMINI,
        *NO_CALLBACKS,
        "model.params.optimizer.target=ldm.training.strategies.HybridAdam",
        "lightning.trainer.precision=32-true",
    )


def test_lora_is_rejected_with_a_pointer_to_the_lora_preset(tmp_path):
    message = config_error(tmp_path, ZERO, "model.params.lora.rank=4")
    assert message.startswith("model.params.lora") and "configs/finetune/sd15-lora.yaml" in message


def test_nvme_offload_needs_tensornvme(tmp_path):
    try:
        import tensornvme  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("tensornvme is installed here")
    message = config_error(
        tmp_path,
        ZERO,
        "model.params.optimizer.target=ldm.training.strategies.HybridAdam",
        "model.params.optimizer.params.nvme_offload_fraction=1.0",
    )
    assert "nvme_offload_fraction" in message and "needs the tensornvme package" in message


def test_old_colossalai_config_is_translated(tmp_path):
    cfg, sources = load_config(
        [SD_FOLDER],
        [
            f"model.params.pretrained={tmp_path}",
            f"data.params.root={tmp_path}",
            "model.params.optimizer.target=ldm.training.strategies.HybridAdam",
            *NO_CALLBACKS,
            "lightning.trainer.precision=16",
            "lightning.trainer.strategy={target: lightning.pytorch.strategies.ColossalAIStrategy, params: "
            "{use_chunk: true, enable_distributed_storage: true, placement_policy: cpu, force_outputs_fp32: true, "
            "min_chunk_size: 64}}",
        ],
    )
    check_config(cfg, sources)
    assert cfg.lightning.trainer.strategy == {
        "target": "ldm.training.strategies.ColossalAIStrategy",
        "params": {
            "plugin": "gemini",
            "gemini": {
                "shard_param_frac": 1.0,
                "placement_policy": "static",
                "offload_optim_frac": 1.0,
                "offload_param_frac": 1.0,
                "force_outputs_fp32": True,
                "min_chunk_size_m": 64,
            },
        },
    }


def test_planner_placement_matches_what_zero_allocates(tiny_sd, image_folder, tmp_path):
    """The planner's byte arithmetic for ZeRO + CPU offload against the optimizer of a real run."""
    from ldm.training.memory import plan_training_step
    from ldm.training.placement import place

    record = tmp_path / "bytes.json"
    extra = [
        "lightning.trainer.precision=16-mixed",
        "lightning.trainer.max_steps=1",
        "lightning.callbacks.rec.target=tests.helpers.RecordZeroBytes",
        f"lightning.callbacks.rec.params.path={record}",
    ]
    argv = args(tiny_sd, image_folder, tmp_path / "logs", *extra)
    assert main(argv) == 0
    real = json.loads(record.read_text())
    cfg, sources = load_config([SD_FOLDER], [a for a in argv if "=" in a and not a.startswith("-")])
    check_config(cfg, sources)  # as scripts/plan_memory.py does: the planner reads a checked config
    placement = place(plan_training_step(cfg), cfg)
    rows = {(part, state, device): b for part, state, device, b in placement.rows}
    assert real["master_device"] == "cpu"
    assert rows[("unet", "master weights (fp32)", "cpu")] == real["master"]
    assert rows[("unet", "Adam moments (fp32)", "cpu")] == real["moments"]
    assert rows[("unet", "weights (working)", "gpu")] == real["working"]


@pytest.mark.parametrize("preset", ["sd15-8gb", "sd2-base-8gb", "sd15-24gb", "sd15-nvme"])
def test_presets_pass_the_config_checks(preset, tmp_path):
    overrides = [f"model.params.pretrained={REPO / 'configs' / 'models' / 'sd15'}", f"data.params.root={tmp_path}"]
    if preset == "sd15-nvme":
        overrides.append(f"model.params.optimizer.params.nvme_offload_dir={tmp_path}")
    cfg, sources = load_config([REPO / "configs" / "finetune" / f"{preset}.yaml"], overrides)
    if preset == "sd15-nvme" and importlib.util.find_spec("tensornvme") is None:
        with pytest.raises(ConfigError, match="needs the tensornvme package"):
            check_config(cfg, sources)
    else:
        check_config(cfg, sources)


def test_nvme_offload_trains_saves_and_resumes_like_memory(tiny_sd, image_folder, tmp_path, monkeypatch):
    """HybridAdam with every Adam moment offloaded (to a dict standing in for the NVMe disk) learns the same
    weights as without offload, and its checkpoints hold the real moments, through a save and a resume."""
    for name, module in colossalai_cpu.memory_tensornvme().items():
        monkeypatch.setitem(sys.modules, name, module)
    common = ["lightning.trainer.precision=32-true", "model.params.lr_warmup_steps=0",
              "lightning.callbacks.image_logger.params.every_n_steps=100"]  # fmt: skip
    nvme = ["model.params.optimizer.params.nvme_offload_fraction=1.0",
            f"model.params.optimizer.params.nvme_offload_dir={tmp_path / 'nvme'}"]  # fmt: skip

    def train(logdir, *extra):
        assert (
            main(args(tiny_sd, image_folder, tmp_path / logdir, *common, *extra, "lightning.trainer.max_steps=2")) == 0
        )
        assert (
            main(
                args(
                    tiny_sd,
                    image_folder,
                    tmp_path / logdir,
                    *common,
                    *extra,
                    "lightning.trainer.max_steps=4",
                    "-r",
                    "auto",
                )
            )
            == 0
        )
        (run_dir,) = (tmp_path / logdir).iterdir()
        return run_dir / "checkpoints" / "last.ckpt"

    writes = colossalai_cpu.MemoryDisk.writes
    offloaded = train("nvme", *nvme)
    assert colossalai_cpu.MemoryDisk.writes > writes, "the Adam moments went to the stand-in disk"
    in_memory = train("memory")
    a, b = load_checkpoint(offloaded)["state_dict"], load_checkpoint(in_memory)["state_dict"]
    for name in (k for k in b if k.startswith("unet.")):
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7, msg=name)
    optimizer_files = sorted(p.name for p in (in_memory / "optimizer").glob("*.bin"))
    for file in optimizer_files:
        saved_a = torch.load(offloaded / "optimizer" / file, weights_only=True)
        saved_b = torch.load(in_memory / "optimizer" / file, weights_only=True)
        assert _equal(saved_a, saved_b, exact=False), f"optimizer/{file}: offloaded moments were not saved as they are"


def test_gemini_plugin_is_built_from_the_strategy_and_trainer_settings():
    """Gemini cannot train on a CPU, but its plugin can be built: every option reaches GeminiPlugin."""
    from types import SimpleNamespace

    from colossalai.booster.plugin import GeminiPlugin

    from ldm.training.strategies import ColossalAIPrecision, ColossalAIStrategy

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    gemini = {"offload_optim_frac": 1.0, "offload_param_frac": 0.5, "hidden_dim": 320}
    strategy = ColossalAIStrategy(plugin="gemini", gemini=gemini)
    strategy.precision_plugin = ColossalAIPrecision("16-mixed")
    trainer = SimpleNamespace(gradient_clip_val=1.0, accumulate_grad_batches=4)
    plugin = strategy._make_plugin(trainer)
    assert isinstance(plugin, GeminiPlugin)
    config = plugin.gemini_config
    assert (config["offload_optim_frac"], config["offload_param_frac"], config["hidden_dim"]) == (1.0, 0.5, 320)
    assert config["placement_policy"] == "static" and config["mixed_precision"] == torch.float16
    assert config["enable_gradient_accumulation"] is True
    assert plugin.optim_kwargs["max_norm"] == 1.0 and plugin.optim_kwargs["initial_scale"] == 2**16


@pytest.mark.exclusive
@pytest.mark.slow
def test_two_processes_shard_save_gather_and_resume(tiny_sd, tmp_path):
    """ZeRO-2 over 2 CPU processes (gloo): masters are gathered whole, and a resume continues (about 2 min)."""
    from tests.conftest import write_images
    from tests.helpers import run_command

    images = write_images(tmp_path / "images", n=8)
    strategy = ZERO.replace("cpu_offload: true, ", "")
    argv = args(tiny_sd, images, tmp_path / "logs", strategy, "lightning.trainer.accelerator=cpu",
                "lightning.trainer.devices=2", "lightning.callbacks.image_logger=null")  # fmt: skip
    script = [sys.executable, str(REPO / "tests" / "colossalai_cpu.py")]
    for steps, resume in ((2, []), (4, ["-r", "auto"])):
        done = run_command([*script, *argv, f"lightning.trainer.max_steps={steps}", *resume], timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "logs").iterdir()
    folder = run_dir / "checkpoints" / "last.ckpt"
    ckpt = load_checkpoint(folder)
    # 8 images, batch 2, 2 ranks: 2 steps an epoch, so step 4 ends epoch 1
    assert ckpt["global_step"] == 4
    assert ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 1, "batches_done": 2}]
    masters = load_file(folder / COLOSSAL_FILES["master"])
    working = {}
    for shard in (folder / "model").glob("*.safetensors"):
        working.update(load_file(shard))
    before = load_file(tiny_sd / "unet" / "diffusion_pytorch_model.safetensors")
    assert {k: v.shape for k, v in masters.items()} == {f"unet.{k}": v.shape for k, v in before.items()}
    assert all(torch.equal(masters[k].bfloat16(), working[k]) for k in masters), "each rank's shard in its place"


def test_zero_skips_a_non_finite_loss(tiny_sd, image_folder, tmp_path):
    """The guard's skipped step reaches the booster's optimizer as no step at all; training goes on."""
    rec = tmp_path / "losses.jsonl"
    extra = [
        "lightning.trainer.max_steps=4", "lightning.callbacks.image_logger=null",
        "lightning.callbacks.rec.target=tests.helpers.RecordLosses", f"lightning.callbacks.rec.params.path={rec}",
        "lightning.callbacks.nan.target=tests.helpers.PoisonBatch", "lightning.callbacks.nan.params.steps=[2]",
    ]  # fmt: skip
    run_dir = train_once(args(tiny_sd, image_folder, tmp_path / "logs", *extra), tmp_path / "logs")
    losses = {row["step"]: row["loss"] for row in map(json.loads, rec.read_text().splitlines())}
    assert losses[2] is None and all(losses[s] is not None for s in (1, 3, 4))
    ckpt = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 4
    assert all(torch.isfinite(t.float()).all() for t in ckpt["state_dict"].values())
