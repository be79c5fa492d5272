"""Loading fits the RAM of the PC a preset is for: each network is read straight into the dtype the run keeps it
in, never whole in float32 first (issue 41, part 4; the real-size peaks: benchmarks/load_memory.py).

What is measured here: every CPU tensor an operation makes during the load (not a view of one it had), through a
`TorchDispatchMode`, and the peak of those alive at once. A network read in float32 and then cast to bf16 would
peak at twice its bf16 bytes, and three times with the file's tensors held beside it."""

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ldm.models.diffusion.ddpm import LatentDiffusion
from ldm.weights.read import load_pretrained, read_parts
from ldm.weights.single_file import save_single_file

NETWORKS = ("unet", "vae", "text_encoder", "text_encoder_2")


class MadeBytes(TorchDispatchMode):
    """The floating-point CPU tensors the operations run under it make (views not counted), by dtype: their bytes
    in all, and the peak of the bytes alive at once (an upper bound: a storage counts until it is seen freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_dtype: Counter = Counter()
        self.alive: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_floating_point():
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs:
                    self.by_dtype[t.dtype] += t.nbytes
                    self.alive[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.alive = {k: v for k, v in self.alive.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(size for _, size in self.alive.values()))
        return out


def kept(parts) -> int:
    return sum(p.nbytes for module in parts.networks.values() for p in module.state_dict().values())


@pytest.fixture(scope="module")
def half_file(tiny_sdxl, tmp_path_factory) -> Path:
    """The tiny SDXL model as an fp16 original single file, as most SDXL files are published."""
    return save_single_file(read_parts(tiny_sdxl), tmp_path_factory.mktemp("half") / "sdxl.safetensors", half=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_single_file_is_read_straight_into_the_dtype_kept(half_file, dtype):
    with MadeBytes() as made:
        parts = load_pretrained(str(half_file), dtypes=dict.fromkeys(NETWORKS, dtype), keep_extras=False)
    assert sorted(parts.networks) == sorted(NETWORKS)
    assert {p.dtype for module in parts.networks.values() for p in module.parameters()} == {dtype}
    assert made.peak <= 1.2 * kept(parts), (made.peak, kept(parts))
    # the values are those of the float32 read, cast: nothing else changed
    reference = read_parts(half_file)
    for name, module in parts.networks.items():
        theirs = reference[name].state_dict()
        assert all(torch.equal(v, theirs[k].to(dtype)) for k, v in module.state_dict().items()), name


def test_a_diffusers_folder_is_read_straight_into_the_dtype_kept(tiny_sdxl, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    folder = tmp_path / "half"
    StableDiffusionXLPipeline.from_pretrained(tiny_sdxl, local_files_only=True).to(torch.float16).save_pretrained(
        folder
    )
    with MadeBytes() as made:
        parts = load_pretrained(str(folder), dtypes=dict.fromkeys(NETWORKS, torch.bfloat16))
    assert {p.dtype for module in parts.networks.values() for p in module.parameters()} == {torch.bfloat16}
    assert made.peak <= 1.5 * kept(parts), (made.peak, kept(parts))


def test_the_lora_preset_never_makes_a_network_in_float32(half_file):
    """sdxl-lora-8gb.yaml's model: every network frozen in bf16, fp32 adapters on the UNet's attention."""
    lora = {"rank": 4, "alpha": 4, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}
    with MadeBytes() as made:
        model = LatentDiffusion(pretrained=str(half_file), lora=lora, frozen_dtype="bfloat16", unconditional="zeros")
        model.configure_model()
    frozen = {p.dtype for n, p in model.named_parameters() if "lora" not in n}
    assert frozen == {torch.bfloat16} and any("lora" in n for n, _ in model.named_parameters())
    held = sum(t.nbytes for t in model.state_dict().values())
    assert made.peak <= 1.2 * held, (made.peak, held)
