"""Benchmarks are not tests; their smoke modes run here so they do not rot (seconds each).

Once per CI run: in the default stack, not again in the Colossal-AI one (the same code, and time)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.helpers import NO_SD35, has_sd35_layers, run_command

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("colossalai") is not None, reason="benchmark smoke runs in the default stack only"
)
REPO = Path(__file__).resolve().parents[1]


def smoke(name: str, tmp_path: Path, *args: str) -> tuple[dict, str]:
    """Run `benchmarks/NAME --smoke [ARGS]`; return its JSON result and its last line (the headline)."""
    out = tmp_path / f"{name}.json"
    done = run_command([sys.executable, str(REPO / "benchmarks" / name), "--smoke", "--json", str(out), *args],
                       cwd=tmp_path, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    result = json.loads(out.read_text())
    assert json.loads(lines[-2]) == result, "the JSON line comes just before the headline"
    return result, lines[-1]


def test_throughput_smoke(tmp_path):
    result, headline = smoke("throughput.py", tmp_path)
    tiny = result["models"]["tiny"]
    assert {"plain", "ours (as shipped)", "+ precomputed latents & text", "math attention (not SDPA)"} <= set(tiny)
    assert all(v["images_per_s"] > 0 for v in tiny.values())
    assert tiny["plain"]["vs_plain"] == 1.0
    assert any(k.startswith("ours, best") for k in tiny), "the helpful features together"
    top = max((k for k in tiny if k != "plain"), key=lambda k: tiny[k]["images_per_s"])
    assert headline == (
        f"throughput: tiny model, fastest of ours ({top}): {tiny[top]['images_per_s']:.2f} images/s vs plain "
        f"{tiny['plain']['images_per_s']:.2f} = {tiny[top]['vs_plain']:.2f}x"
    )


def test_time_to_quality_smoke(tmp_path):
    result, headline = smoke("time_to_quality.py", tmp_path)
    for side in ("ours", "plain"):
        ((seconds, step, accuracy),) = result[side]["points"]  # judged once, after the first step
        assert seconds > 0 and step == 1 and 0.0 <= accuracy <= 1.0
    assert headline.startswith("time to quality: digits to 80%: ")


def test_memory_smoke(tmp_path):
    result, headline = smoke("memory.py", tmp_path)
    assert set(result["sides"]) == {"plain", "ours"}
    assert 0 < result["sides"]["ours"]["step_peak_gib"] and 0 < result["sides"]["plain"]["step_peak_gib"]
    assert result["tiny"]["within_tolerance"], result["tiny"]
    assert headline.startswith("memory: tiny model step on CPU, ours ")


def test_load_memory_smoke(tmp_path):
    result, headline = smoke("load_memory.py", tmp_path)
    (row,) = result["presets"].values()
    assert row["kept"] > 0 and row["ours_peak"] > 0 and row["before_peak"] > 0
    assert row["ours_vs_kept"] == row["ours_peak"] / row["kept"] and "run_peak" not in row
    assert headline.startswith(f"load memory: worst preset sd15-lora.yaml: peak {row['ours_vs_kept']:.2f}x the bytes")


def test_gpu_throughput_smoke_on_a_cpu(tmp_path):
    result, headline = smoke("gpu_throughput.py", tmp_path)
    assert result["flops_per_image"] > 0
    for variant in ("plain", "ours"):
        (run,) = result["runs"][variant]
        assert run["batch"] == 2 and run["images_per_s"] > 0 and 0 < run["mfu"] < 1, run
    assert headline.startswith("gpu throughput: SD 1.5 at 16 px, ours ")


@pytest.mark.exclusive
def test_pretrain_smoke(tmp_path):
    result, headline = smoke("pretrain.py", tmp_path)
    tiny = result["models"]["tiny"]
    assert set(tiny["rates"]) == {"plain", "ours, from images", "ours, from shards"}
    assert all(rate["images_per_s"] > 0 for rate in tiny["rates"].values())
    assert tiny["precompute"]["count"] == 64 and tiny["precompute"]["bytes"] > 0
    online, shards = (tiny["rates"][k]["images_per_s"] for k in ("ours, from images", "ours, from shards"))
    assert tiny["online_cost"] == pytest.approx(shards / online)
    assert 0 < tiny["precompute_share_at_mosaic_passes"] < 1
    assert headline.startswith("pretrain: tiny model, from shards ")


def test_masking_smoke(tmp_path):
    results = tmp_path / "runs.jsonl"
    result, headline = smoke("masking.py", tmp_path, "--results", str(results))
    flops, (budget,) = result["flops_per_step"], result["budgets"]
    assert flops["A"] > flops["C"] > flops["B"] > 0, "75 % masking cuts a step's FLOPs; the mixer costs some"
    assert abs(flops["D"] - flops["C"]) < 0.25 * flops["C"], "D is sized to C's FLOPs per step"
    assert result["d_shape"]["width"] * result["d_shape"]["depth"] < 64 * 4, "D is smaller than A"
    assert [run["arm"] for run in result["runs"]] == ["A", "B", "C", "D"]
    for run in result["runs"]:
        spent = run["steps"] * flops[run["arm"]]
        assert abs(spent - budget * flops["A"]) <= flops[run["arm"]] / 2, f"equal FLOPs, to a step: {run}"
        masked = run["arm"] in ("B", "C")
        assert run["unmasked_from"] == (run["steps"] - round(0.1 * run["steps"]) if masked else run["steps"])
        assert 0 <= run["accuracy"] <= 1 and run["frechet_distance"] > 0 and run["train_s"] > 0
    assert headline.startswith(f"masking at equal FLOPs, budget {budget}: A acc ")
    assert [json.loads(line) for line in results.read_text().splitlines()] == result["runs"], "each run recorded"

    again, _ = smoke("masking.py", tmp_path, "--results", str(results), "--arms", "B", "D")
    assert again["runs"] == [run for run in result["runs"] if run["arm"] in ("B", "D")], "recorded runs not rerun"
    assert len(results.read_text().splitlines()) == 4, "nothing appended when nothing ran"


def test_masking_results_file_errors_name_the_line(tmp_path):
    from benchmarks.masking import finished_runs

    results = tmp_path / "runs.jsonl"
    run = {"arm": "A", "budget": 2, "seed": 0, "batch_size": 8, "accuracy": 0.1}
    results.write_text(json.dumps(run) + "\n\n" + json.dumps({**run, "batch_size": 64}) + "\n")
    assert finished_runs(results, 8) == [run], "runs at another batch size do not count"
    assert finished_runs(tmp_path / "none.jsonl", 8) == []
    results.write_text(json.dumps(run) + '\n{"arm": "B", "bud')  # a run cut off mid-write
    with pytest.raises(SystemExit, match=r"runs.jsonl:2: not a recorded run"):
        finished_runs(results, 8)


def test_microdit_vs_unet_smoke(tmp_path):
    result, headline = smoke("microdit_vs_unet.py", tmp_path)
    sides = result["sides"]
    assert list(sides) == ["unet", "microdit"]
    for side in sides.values():
        assert side["steps"] == 3 and side["train_s"] > 0, side
        assert [step for _, step, _ in side["points"]][:1] == [1], "judged from the first step until reached"
        assert 0 <= side["accuracy"] <= 1 and side["frechet_distance"] > 0
    assert sides["unet"]["denoiser_parameters"] != sides["microdit"]["denoiser_parameters"]
    assert headline.startswith("microdit vs unet, digits, guidance 2: unet to 80% ")


def test_gpu_microdit_smoke_on_a_cpu(tmp_path):
    result, headline = smoke("gpu_microdit.py", tmp_path)
    masked, unmasked = result["flops_per_image"]["masked 75 %"], result["flops_per_image"]["unmasked"]
    assert 0 < masked < 0.75 * unmasked, "75 % of the patches skip the backbone blocks"
    for variant in ("masked 75 %", "unmasked"):
        (run,) = result["runs"][variant]
        assert run["batch"] == 2 and run["images_per_s"] > 0 and 0 < run["mfu"] < 1, run
    assert headline.startswith("gpu microdit: tiny MicroDiT on a CPU (smoke), masked ")


@pytest.mark.skipif(not has_sd35_layers(), reason=NO_SD35)
def test_gpu_8gb_writes_an_sd35_folder_from_the_family_configs(tmp_path):
    """`gpu_8gb.py --family sd35-medium` needs a GPU; the folder of random weights it trains is written here from
    tiny configs laid out as `configs/models/sd35-medium/` is, and diffusers loads and samples it offline."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from safetensors.torch import load_file
    from transformers import CLIPTextConfig, T5Config

    from benchmarks.gpu_8gb import FAMILIES, random_sd35
    from examples.tiny_sd35 import TINY_CLIP_G, TINY_CLIP_L, TINY_MMDIT, TINY_SD3_VAE, TINY_T5

    src = tmp_path / "configs"
    SD3Transformer2DModel(**TINY_MMDIT, dual_attention_layers=(0,)).save_config(src / "unet")
    AutoencoderKL(**TINY_SD3_VAE).save_config(src / "vae")
    CLIPTextConfig(**TINY_CLIP_L).save_pretrained(src / "text_encoder")
    CLIPTextConfig(**TINY_CLIP_G).save_pretrained(src / "text_encoder_2")
    T5Config(**TINY_T5).save_pretrained(src / "text_encoder_3")
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_config(src / "scheduler")
    assert FAMILIES["sd35-medium"][:2] == (random_sd35, REPO / "configs" / "finetune" / "sd35m-8gb.yaml")

    folder = random_sd35(tmp_path / "sd35", src)
    for part in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        (weights,) = (folder / part).glob("*.safetensors")
        assert {t.dtype for t in load_file(weights).values()} == {torch.bfloat16}, part
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, local_files_only=True, torch_dtype=torch.float32)
    assert list(pipe.transformer.config.dual_attention_layers) == [0]
    image = pipe("a cat", num_inference_steps=1, height=16, width=16, output_type="np").images
    assert image.shape == (1, 16, 16, 3)
