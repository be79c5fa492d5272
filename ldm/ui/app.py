"""`ldm-ui`: a local web app (Gradio) to plan, launch, watch, stop and resume training runs, read their reports,
sample from a model and convert weights. One user, one machine: a run is `main.py` in a child process.

Tabs: Train, Runs, Sample, Convert / export. Every path typed in is checked against the folders the app was
started with (`Roots`); images go to the browser as pictures, never as paths it could fetch.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd
from PIL import Image

from ldm.training.report import read_metrics, write_report
from ldm.ui.runs import Job, Roots, dry_run, launch, list_runs, newest_grid, presets, train_args


def _error(err: Exception) -> gr.Error:
    return gr.Error(" ".join(str(err).split()))


def _loss_frame(run_dir: Path | None) -> pd.DataFrame:
    points = read_metrics(run_dir).get("train/loss", []) if run_dir else []
    return pd.DataFrame({"step": [s for s, _ in points], "loss": [v for _, v in points]})


def _picture(path: Path | None) -> Image.Image | None:
    if path is None:
        return None
    with Image.open(path) as image:
        return image.convert("RGB")


def build_app(roots: Roots, logdir: Path) -> gr.Blocks:
    """The app; `logdir` holds the runs it starts and lists (it must lie inside `roots`)."""
    logdir = roots.check(str(logdir), "log folder", must_exist=False)
    logdir.mkdir(parents=True, exist_ok=True)
    jobs: dict[str, Job] = {}  # "train": the newest run started here
    pipelines: dict[str, Any] = {}  # the sampled model, kept loaded between clicks

    def arguments(preset: str, weights: str, images: str, name: str, steps: float | None, overrides: str) -> list[str]:
        return train_args(
            preset,
            roots.check(weights, "weights") if weights and weights.strip() else None,
            roots.check(images, "image folder") if images and images.strip() else None,
            name,
            int(steps) if steps else None,
            overrides,
            logdir,
        )

    def plan(*fields: Any) -> str:
        try:
            return dry_run(arguments(*fields))
        except ValueError as err:
            raise _error(err) from None

    def start(*fields: Any) -> str:
        if "train" in jobs and jobs["train"].running:
            raise gr.Error("a run is going on; stop it first")
        try:
            jobs["train"] = launch(arguments(*fields), logdir)
        except ValueError as err:
            raise _error(err) from None
        return "started"

    def stop() -> str:
        job = jobs.get("train")
        if job is None or not job.running:
            return "no run is going on"
        job.stop()
        return "stopping: saving a checkpoint at the next step"

    def resume(run: str | None) -> str:
        """Continue the run chosen in Runs (a folder name in the log folder), else the last one started here."""
        if "train" in jobs and jobs["train"].running:
            raise gr.Error("a run is going on; stop it first")
        last = jobs["train"].run_dir() if "train" in jobs else None
        try:
            run_dir = roots.check(str(logdir / run) if run else str(last or ""), "run to resume")
        except ValueError as err:
            raise _error(err) from None
        jobs["train"] = launch(["-t", "-r", str(run_dir), "-l", str(logdir)], logdir)
        return f"resuming {run_dir.name}"

    def watch() -> tuple[str, pd.DataFrame, Image.Image | None]:
        job = jobs.get("train")
        if job is None:
            return "no run started here yet", _loss_frame(None), None
        run_dir = job.run_dir()
        return job.status(), _loss_frame(run_dir), _picture(newest_grid(run_dir))

    def runs() -> gr.Dropdown:
        names = [run.name for run in list_runs(logdir)]
        return gr.Dropdown(choices=names, value=names[0] if names else None)

    def report(name: str | None) -> str:
        if not name:
            return "<p>No run chosen.</p>"
        try:
            run_dir = roots.check(str(logdir / name), "run")
        except ValueError as err:
            raise _error(err) from None
        page = write_report(run_dir).read_text(encoding="utf-8")
        frame = 'title="report" style="width:100%;height:1200px;border:0"'
        return f'<iframe {frame} srcdoc="{html.escape(page)}"></iframe>'

    def generate(model: str, prompt: str, count: float, steps: float, guidance: float, seed: float) -> list:
        from ldm.export import load_pipeline
        from ldm.sampling import sample

        try:
            path = roots.check(model, "model")
            if pipelines.get("path") != path:
                pipelines.update(path=path, pipe=load_pipeline(path))
                pipelines["pipe"].set_progress_bar_config(disable=True)
        except (ValueError, FileNotFoundError) as err:
            raise _error(err) from None
        images = sample(pipelines["pipe"], [prompt], int(count), int(steps), float(guidance), int(seed))
        return list(images)

    def convert_weights(src: str, dst: str, half: bool, ema: bool) -> str:
        from ldm.export import convert

        try:
            out = convert(roots.check(src, "from"), roots.check(dst, "to", must_exist=False), half=half, ema=ema)
        except (ValueError, FileNotFoundError, FileExistsError) as err:
            raise _error(err) from None
        return f"wrote {out}"

    with gr.Blocks(title="ldm") as app:
        gr.Markdown(f"## ldm\nRuns in `{logdir}`; paths must lie in: " + ", ".join(f"`{r}`" for r in roots.folders))
        with gr.Tab("Train"):
            with gr.Row():
                preset = gr.Dropdown(presets(), value="finetune/sd-folder.yaml", label="preset", elem_id="preset")
                name = gr.Textbox("ui-run", label="run name", elem_id="name")
                steps = gr.Number(0, precision=0, label="max steps (0: the preset's)", elem_id="steps")
            with gr.Row():
                weights = gr.Textbox(label="weights: a diffusers folder or a single file", elem_id="weights")
                images = gr.Textbox(label="image folder", elem_id="images")
            overrides = gr.Textbox(label="more overrides, one key.path=value per line", lines=3, elem_id="overrides")
            with gr.Row():
                plan_button = gr.Button("Plan (dry run)", elem_id="plan")
                start_button = gr.Button("Start", variant="primary", elem_id="start")
                stop_button = gr.Button("Stop (saves)", elem_id="stop")
                resume_button = gr.Button("Resume", elem_id="resume")
            said = gr.Textbox(label="plan", lines=8, elem_id="plan-out")
            progress = gr.Textbox(label="progress", lines=3, elem_id="progress")
            with gr.Row():
                loss = gr.LinePlot(_loss_frame(None), x="step", y="loss", title="loss", elem_id="loss")
                grid = gr.Image(label="newest samples", type="pil", elem_id="grid")
            fields = [preset, weights, images, name, steps, overrides]
            plan_button.click(plan, fields, said)
            start_button.click(start, fields, progress)
            stop_button.click(stop, None, progress)
            gr.Timer(2.0).tick(watch, None, [progress, loss, grid])
        with gr.Tab("Runs"):
            with gr.Row():
                run = gr.Dropdown([r.name for r in list_runs(logdir)], label="run", elem_id="run")
                refresh = gr.Button("Refresh", elem_id="refresh")
            page = gr.HTML(elem_id="report")
            refresh.click(runs, None, run)
            run.change(report, run, page)
            resume_button.click(resume, run, progress)
        with gr.Tab("Sample"):
            model = gr.Textbox(label="model: a pipeline folder, a checkpoint or a single file", elem_id="model")
            prompt = gr.Textbox("a photo of a cat", label="prompt", elem_id="prompt")
            with gr.Row():
                count = gr.Number(2, precision=0, label="images", minimum=1, maximum=16)
                sample_steps = gr.Number(25, precision=0, label="steps", minimum=1, elem_id="sample-steps")
                guidance = gr.Number(5.0, label="guidance")
                seed = gr.Number(0, precision=0, label="seed")
            go = gr.Button("Sample", variant="primary", elem_id="sample")
            gallery = gr.Gallery(label="images", elem_id="gallery")
            go.click(generate, [model, prompt, count, sample_steps, guidance, seed], gallery)
        with gr.Tab("Convert / export"):
            gr.Markdown("A checkpoint, single file or diffusers folder to a diffusers folder (a path without a "
                        "suffix) or a single file (`.safetensors`). Nothing is overwritten.")  # fmt: skip
            src = gr.Textbox(label="from", elem_id="src")
            dst = gr.Textbox(label="to", elem_id="dst")
            with gr.Row():
                half = gr.Checkbox(label="fp16 weights")
                ema = gr.Checkbox(label="the EMA weights (checkpoints)")
            convert_button = gr.Button("Convert", elem_id="convert")
            wrote = gr.Textbox(label="result", elem_id="wrote")
            convert_button.click(convert_weights, [src, dst, half, ema], wrote)
    return app
