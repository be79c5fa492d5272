"""Benchmarks are not tests; their smoke modes run here so they do not rot (a few seconds each)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def smoke(name: str, tmp_path: Path) -> tuple[dict, str]:
    """Run `benchmarks/NAME --smoke`; return its JSON result and its last line (the headline)."""
    out = tmp_path / f"{name}.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / name), "--smoke", "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
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
    best = next(k for k in tiny if k.startswith("ours, best"))
    assert headline == (
        f"throughput: tiny model, {best}: {tiny[best]['images_per_s']:.2f} images/s vs plain "
        f"{tiny['plain']['images_per_s']:.2f} = {tiny[best]['vs_plain']:.2f}x"
    )


def test_time_to_quality_smoke(tmp_path):
    result, headline = smoke("time_to_quality.py", tmp_path)
    for side in ("ours", "plain"):
        ((seconds, step, accuracy),) = result[side]["points"]  # judged once, after the first step
        assert seconds > 0 and step == 1 and 0.0 <= accuracy <= 1.0
    assert headline.startswith("time to quality: digits to 80%: ")
