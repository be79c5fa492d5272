"""Stable Diffusion 3.5 in the files users have: single files in ComfyUI's / sd-scripts' layout both ways, the text
encoders' files of their own, and the family told from a file's keys."""

import inspect
import json

import numpy as np
import pytest
import torch
from diffusers import SD3Transformer2DModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from examples.tiny_sd35 import write_tiny_sd35
from ldm.families import FAMILIES, LAYOUTS, SingleFileError, detect_family, family_of

pytestmark = pytest.mark.skipif(
    "dual_attention_layers" not in inspect.signature(SD3Transformer2DModel.__init__).parameters,
    reason="this diffusers predates SD3.5's layers (MMDiT-X, QK-norm): the Colossal-AI stack's 0.29 does",
)
TEXT = {"text_encoder": "clip_l", "text_encoder_2": "clip_g", "text_encoder_3": "t5xxl"}
FLOW = ("model.params.objective=flow", "model.params.snr_gamma=null")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_sd35(tmp_path_factory.mktemp("sd35"), "sd35-medium")


@pytest.fixture(scope="module")
def parts(folder):
    from ldm.weights.read import read_parts

    return read_parts(folder)


def _same(ours, theirs) -> list[str]:
    """The keys where two modules' weights differ (or one lacks them)."""
    a, b = ours.state_dict(), theirs.state_dict()
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def _files_of_their_own(parts, out) -> dict[str, str]:
    """Each text encoder as ComfyUI keeps it: transformers' names, one file each; T5's embedding once, as `shared`
    (its `encoder.embed_tokens` is the same tensor); CLIP-L without the projection SD3 does not use."""
    files = {}
    for part, name in TEXT.items():
        state = {k: v.contiguous() for k, v in parts[part].state_dict().items()}
        state = {k: v for k, v in state.items() if k not in ("encoder.embed_tokens.weight", "text_projection.weight")
                 or part == "text_encoder_2"}  # fmt: skip
        save_file(state, str(out / f"{name}.safetensors"))
        files[part] = str(out / f"{name}.safetensors")
    return files


def test_a_single_file_reads_back_exactly_and_diffusers_reads_it_as_the_folder(folder, parts, tmp_path):
    """Written in the layout ComfyUI and sd-scripts read: the MMDiT under `model.diffusion_model.` with Stability's
    names (fused q/k/v), the VAE under `first_stage_model.`, the encoders under `text_encoders.*.transformer.`.
    diffusers' own single-file reader makes of it the very weights of the diffusers folder."""
    from diffusers import StableDiffusion3Pipeline

    from ldm.sampling import build_pipeline, sample
    from ldm.weights.single_file import load_single_file, save_single_file

    path = save_single_file(parts, tmp_path / "tiny.safetensors")
    with safe_open(str(path), "pt") as handle:
        keys, metadata = set(handle.keys()), handle.metadata()
    assert {".".join(k.split(".")[:2]) for k in keys} == {
        "model.diffusion_model", "first_stage_model.encoder", "first_stage_model.decoder",
        "text_encoders.clip_l", "text_encoders.clip_g", "text_encoders.t5xxl",
    }  # fmt: skip
    assert "model.diffusion_model.joint_blocks.0.x_block.attn2.qkv.weight" in keys  # Medium's MMDiT-X
    assert "text_encoders.t5xxl.transformer.shared.weight" in keys
    assert not any(
        k.endswith(("clip_l.transformer.text_projection.weight", "encoder.embed_tokens.weight")) for k in keys
    )
    assert json.loads(metadata["ldm"])["prediction_type"] == "flow"
    back, line = load_single_file(path)
    assert all(not _same(parts[name], back[name]) for name in parts.networks)
    pipe = StableDiffusion3Pipeline.from_single_file(str(path), config=str(folder), local_files_only=True)
    assert not _same(parts.unet, pipe.transformer)
    for name in ("vae", "text_encoder", "text_encoder_2"):
        assert not _same(parts[name], getattr(pipe, name)), name
    # diffusers 0.42 leaves T5's `encoder.embed_tokens` (the same tensor as `shared`) unread from any such file
    t5 = pipe.text_encoder_3.state_dict()
    assert [k for k, v in t5.items() if v.is_meta] == ["encoder.embed_tokens.weight"]
    assert pipe.text_encoder_3.training  # and leaves T5 in training mode: its dropout on
    pipe.text_encoder_3.tie_weights()  # the workaround the docs give: T5 then is the model written
    pipe.text_encoder_3.eval()
    assert not _same(parts.text_encoder_3, pipe.text_encoder_3)
    ours = build_pipeline(parts, "euler")
    pipe.scheduler = type(ours.scheduler).from_config(ours.scheduler.config)
    assert np.array_equal(*(np.stack([np.asarray(i) for i in sample(p, ["a cat"], steps=2, height=16, width=16)])
                            for p in (pipe, ours)))  # fmt: skip


def test_text_encoders_come_from_files_of_their_own(parts, tmp_path):
    """Stability's `sd3.5_medium.safetensors` holds the MMDiT and the VAE only: the encoders come from ComfyUI's
    `clip_l` / `clip_g` / `t5xxl` files, named by part; without them the error says how to give them."""
    from ldm.weights.single_file import load_single_file, save_single_file

    full = save_single_file(parts, tmp_path / "full.safetensors")
    with safe_open(str(full), "pt") as handle:
        metadata = handle.metadata()
    state = {k: v for k, v in load_file(str(full)).items() if not k.startswith("text_encoders.")}
    save_file(state, str(tmp_path / "bare.safetensors"), metadata=metadata)
    with pytest.raises(SingleFileError, match=r"holds no text_encoder \(text_encoders.clip_l.transformer.\*\): .*"
                       r"model.params.part_weights.text_encoder=FILE"):  # fmt: skip
        load_single_file(tmp_path / "bare.safetensors")
    files = _files_of_their_own(parts, tmp_path)
    back, _ = load_single_file(tmp_path / "bare.safetensors", part_files=files)
    assert all(not _same(parts[name], back[name]) for name in parts.networks)
    wrong = {**files, "text_encoder_3": files["text_encoder"]}
    with pytest.raises(SingleFileError, match=r"text_encoder_3.s own file .*clip_l.safetensors has no shared.weight"):
        load_single_file(tmp_path / "bare.safetensors", part_files=wrong)


def test_a_fine_tune_from_single_files_exports_single_files_that_read_back(parts, image_folder, tmp_path):
    """Through main.py from the MMDiT + VAE file and the encoders' own files (`model.params.part_weights`): the run
    trains, and its checkpoint exports a single file that holds the trained transformer."""
    from ldm.weights.checkpoint import load_checkpoint
    from ldm.weights.read import parts_from_checkpoint
    from ldm.weights.single_file import load_single_file, save_single_file
    from tests.helpers import finetune_args, train_once

    full = save_single_file(parts, tmp_path / "full.safetensors")
    with safe_open(str(full), "pt") as handle:
        metadata = handle.metadata()
    state = {k: v for k, v in load_file(str(full)).items() if not k.startswith("text_encoders.")}
    save_file(state, str(tmp_path / "bare.safetensors"), metadata=metadata)
    files = _files_of_their_own(parts, tmp_path)
    given = "{" + ", ".join(f"{part}: {path}" for part, path in files.items()) + "}"
    tokenizer = f"model.params.tokenizer_3={{pretrained: {parts_folder(parts)}, subfolder: tokenizer_3}}"
    run = train_once(finetune_args(tmp_path / "bare.safetensors", image_folder, tmp_path / "logs", *FLOW, tokenizer,
                                   f"model.params.part_weights={given}", "lightning.callbacks.image_logger=null"),
                     tmp_path / "logs")  # fmt: skip
    ckpt = load_checkpoint(run / "checkpoints" / "last.ckpt")
    trained = parts_from_checkpoint(ckpt)
    assert _same(parts.unet, trained.unet), "the transformer trained"
    assert all(not _same(parts[name], trained[name]) for name in TEXT), "the frozen encoders are the files' own"
    back, _ = load_single_file(save_single_file(trained, tmp_path / "trained.safetensors"))
    assert all(not _same(trained[name], back[name]) for name in trained.networks)
    # A LoRA checkpoint holds its adapters only: its base comes back from the same files, encoders and all
    run = train_once(finetune_args(tmp_path / "bare.safetensors", image_folder, tmp_path / "lora", *FLOW, tokenizer,
                                   f"model.params.part_weights={given}", "lightning.callbacks.image_logger=null",
                                   "model.params.lora.rank=2"), tmp_path / "lora")  # fmt: skip
    merged = parts_from_checkpoint(load_checkpoint(run / "checkpoints" / "last.ckpt"))
    assert _same(parts.unet, merged.unet) and all(not _same(parts[name], merged[name]) for name in TEXT)


def parts_folder(parts):
    """The diffusers folder the fixture's parts were read from (its tokenizers are there)."""
    return parts.tokenizer_3.name_or_path.rsplit("/tokenizer_3", 1)[0]


def test_a_changed_clip_l_projection_is_refused_not_dropped(parts, tmp_path):
    """SD3 files have no place for CLIP-L's projection (readers take the identity): a trained one is refused."""
    from ldm.weights.single_file import save_single_file

    projection = parts.text_encoder.text_projection.weight
    saved = projection.detach().clone()
    try:
        with torch.no_grad():
            projection.mul_(2)
        with pytest.raises(SingleFileError, match="text_encoder.text_projection.weight has been changed"):
            save_single_file(parts, tmp_path / "x.safetensors")
        assert not (tmp_path / "x.safetensors").exists()
    finally:
        with torch.no_grad():
            projection.copy_(saved)


@pytest.mark.parametrize("name, told", [("sd35-medium", "x_block.attn2"), ("sd35-large", "no x_block.attn2")])
def test_real_size_files_are_told_apart_by_their_keys_with_or_without_encoders(name, told):
    """Real-size keys, from the shipped configs on the meta device: Medium has MMDiT-X blocks, Large none; a file
    with every encoder and one with none are told alike, and nothing else is read from them but their keys."""
    from ldm.components.describe import family_description, parts_from_description
    from ldm.weights.keymaps import original_names

    parts = parts_from_description(family_description(FAMILIES[name]))
    assert family_of(parts) is FAMILIES[name] and FAMILIES[name].prediction_type == "flow"
    names = original_names(parts, LAYOUTS["sd3"])
    assert (
        len({original for original, _ in names.values()})
        == len(names) - sum(1 for _, slot in names.values() if slot in (1, 2)) - 1
    )  # the fused q/k/v tensors, once each; T5's tied embedding once
    full = {original: torch.empty(0) for original, _ in names.values()}
    bare = {k: v for k, v in full.items() if not k.startswith("text_encoders.")}
    for state in (full, bare):
        family, how = detect_family(state, {}, where="x.safetensors")
        assert family.name == name and told in how


def test_lora_files_in_kohyas_and_diffusers_formats_merge_as_ours_and_read_back(folder, image_folder, tmp_path):
    """Adapters on the transformer's attention (image and caption streams), its final modulation and CLIP-L:
    kohya's file names them as sd-scripts' SD3 files do (Stability's module paths, q/k/v fused into one `qkv`
    adapter, `lora_te1_`), which ComfyUI applies to a single file's tensors by name: that gives our merged single
    file. diffusers' `load_lora_weights` + `fuse_lora` of the diffusers-format file gives our merged weights, and
    our reader reads either back into the adapters trained."""
    from diffusers import StableDiffusion3Pipeline

    from ldm.components.lora_keys import lora_modules, read_adapters
    from ldm.weights.checkpoint import load_checkpoint
    from ldm.weights.lora_file import save_lora
    from ldm.weights.read import parts_from_checkpoint, read_parts
    from ldm.weights.single_file import to_original
    from tests.helpers import finetune_args, train_once

    targets = "[to_q, to_k, to_v, to_out.0, add_q_proj, add_k_proj, add_v_proj, to_add_out, norm_out.linear]"
    lora = f"model.params.lora={{rank: 2, alpha: 6, target_modules: {targets}}}"
    run = train_once(finetune_args(folder, image_folder, tmp_path / "logs", *FLOW, lora,
                                   "model.params.learning_rate=1e-2", "model.params.trainable=[unet,text_encoder]",
                                   "lightning.callbacks.image_logger=null"), tmp_path / "logs")  # fmt: skip
    ckpt = load_checkpoint(run / "checkpoints" / "last.ckpt")
    adapters, merged, base = parts_from_checkpoint(ckpt, merge=False), parts_from_checkpoint(ckpt), read_parts(folder)
    kohya = save_lora(adapters, tmp_path / "kohya.safetensors", "kohya")
    state = load_file(str(kohya))
    qkv = "lora_unet_joint_blocks_0_x_block_attn_qkv"
    assert state[f"{qkv}.lora_down.weight"].shape == (6, 16) and state[f"{qkv}.lora_up.weight"].shape == (48, 6)
    assert float(state[f"{qkv}.alpha"]) == 18.0  # three rank-2 adapters as one of rank 6: alpha / rank stays 3
    with safe_open(str(kohya), "pt") as handle:
        metadata = handle.metadata()
    assert (metadata["ss_network_dim"], metadata["ss_network_alpha"]) == ("2", "6.0")  # the adapters' own
    names = {key.partition(".")[0] for key in state}
    assert {"lora_unet_joint_blocks_0_context_block_attn_proj", "lora_unet_final_layer_adaLN_modulation_1",
            "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"} <= names  # fmt: skip
    assert not any("transformer_blocks" in name for name in names)
    # ComfyUI's application: each weight of the single file plus up @ down * alpha / rank, found by name
    before, after = to_original(base, "sd3"), to_original(merged, "sd3")
    applied = dict(before)
    for name in names:
        down, up, alpha = (state[f"{name}.{s}"] for s in ("lora_down.weight", "lora_up.weight", "alpha"))
        prefix = "model.diffusion_model." if name.startswith("lora_unet_") else "text_encoders.clip_l.transformer."
        key = next(
            k
            for k in before
            if k.startswith(prefix)
            and k.endswith(".weight")
            and k.removeprefix(prefix).removesuffix(".weight").replace(".", "_") == name.split("_", 2)[2]
        )
        applied[key] = before[key] + up @ down * (float(alpha) / down.shape[0])
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert changed and all(torch.allclose(applied[k], after[k], rtol=0, atol=1e-6) for k in after), changed
    diffusers = save_lora(adapters, tmp_path / "diffusers", "diffusers")
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, local_files_only=True)
    pipe.load_lora_weights(str(diffusers.parent), weight_name=diffusers.name)
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    for name, theirs in (("unet", pipe.transformer), ("text_encoder", pipe.text_encoder)):
        torch.testing.assert_close(theirs.state_dict(), merged[name].state_dict(), rtol=0, atol=1e-6, msg=name)

    def delta(layer):
        return layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]

    trained = {name: {path: delta(layer) for path, layer in lora_modules(adapters[name]).items()}
               for name in ("unet", "text_encoder")}  # fmt: skip
    # The last block's caption queries feed nothing (its caption stream ends there): their adapter never trains,
    # and a fused file cannot tell the rank of an adapter that is all zeros: it reads as none, the same weights.
    idle = {path for path, d in trained["unet"].items() if not d.any()}
    assert idle == {"transformer_blocks.1.attn.add_q_proj"}
    for file in (kohya, diffusers):
        read = read_adapters(file, base, "--lora")
        assert sorted(read) == ["text_encoder", "unet"]
        for name, modules in read.items():
            expected = trained[name].keys() - (idle if file == kohya and name == "unet" else set())
            assert modules.keys() == expected, file.name
            for path, a in modules.items():
                assert a.rank == 2, f"{file.name}: {path} splits back into its own rank-2 adapter"
                torch.testing.assert_close(a.up @ a.down * (a.alpha / a.rank), trained[name][path], rtol=0, atol=1e-6)


def test_the_weights_scheduler_sets_the_objective(folder, parts, image_folder, tmp_path):
    """A config that names no objective trains SD3.5 by flow matching, its scheduler being a flow-matching one:
    told from a folder or a single file without loading a network; `sd-folder.yaml`'s Min-SNR is left out."""
    from ldm.weights.read import scheduler_class
    from ldm.weights.single_file import save_single_file
    from tests.helpers import finetune_args, train_once

    path = save_single_file(parts, tmp_path / "tiny.safetensors")
    assert scheduler_class(folder) == scheduler_class(path) == "FlowMatchEulerDiscreteScheduler"
    assert scheduler_class(tmp_path / "missing.safetensors") is None
    train_once(finetune_args(path, image_folder, tmp_path / "logs", "lightning.callbacks.image_logger=null",
                             "lightning.trainer.max_steps=1"), tmp_path / "logs")  # fmt: skip
