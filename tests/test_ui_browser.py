"""`ldm-ui` in a real browser: headless Chromium (Debian's chromium and chromium-driver) driven by Selenium plans
a tiny run, starts it, watches it finish with a sample grid, reads its report, and samples from its checkpoint.

Needs the `ui` extra and Chromium; skipped without them, unless LDM_BROWSER_TEST=required (CI) makes a missing
piece a failure. LDM_UI_SCREENSHOTS=FOLDER saves the screenshots the docs show.
"""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
TINY_RUN = [
    "data.params.size=16", "data.params.batch_size=2", "data.params.num_workers=0",
    "lightning.trainer.accumulate_grad_batches=1", "lightning.trainer.log_every_n_steps=1",
    "model.params.learning_rate=1e-3", "lightning.modelcheckpoint.params.every_n_train_steps=2",
    "lightning.callbacks.image_logger.params.every_n_steps=2",
    "lightning.callbacks.image_logger.params.num_inference_steps=2",
]  # fmt: skip


def _needs(condition: bool, what: str) -> None:
    if not condition:
        if os.environ.get("LDM_BROWSER_TEST") == "required":
            pytest.fail(f"the browser test needs {what}")
        pytest.skip(f"needs {what}")


@pytest.fixture
def app(tiny_sd, image_folder, tmp_path):
    """The app on a free port, allowed to use tmp_path only; the tiny SD and the images copied in there."""
    try:
        import gradio  # noqa: F401
        import selenium  # noqa: F401
    except ImportError as err:
        _needs(False, f"the ui extra and selenium ({err})")
    _needs(CHROMIUM is not None and DRIVER is not None, "Debian's chromium and chromium-driver")
    shutil.copytree(tiny_sd, tmp_path / "tiny-sd")
    shutil.copytree(image_folder, tmp_path / "images")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "scripts/ui.py", "--logdir", str(tmp_path / "logs"), "--root", str(tmp_path),
               "--port", str(port)]  # fmt: skip
    output = open(tmp_path / "app.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                assert server.poll() is None, (tmp_path / "app.log").read_text()
                time.sleep(0.5)
        yield url, tmp_path
    finally:
        server.terminate()
        server.wait(timeout=30)
        output.close()


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1700"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    yield driver
    driver.quit()


def _wait(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"waited {seconds} s for {what}")


def test_a_run_is_planned_started_watched_reported_and_sampled_in_the_browser(app, browser, request):
    from selenium.webdriver.common.by import By

    url, folder = app
    shots = os.environ.get("LDM_UI_SCREENSHOTS")

    def field(element_id: str):
        return browser.find_element(By.CSS_SELECTOR, f"#{element_id} textarea, #{element_id} input")

    def fill(element_id: str, text: str) -> None:
        box = field(element_id)
        box.clear()
        box.send_keys(text)

    def value(element_id: str) -> str:
        return field(element_id).get_attribute("value") or ""

    def tab(name: str) -> None:
        next(b for b in browser.find_elements(By.CSS_SELECTOR, "button[role=tab]") if b.text == name).click()

    browser.get(url)
    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#weights textarea"), 60, "the app")

    # a path outside the chosen folders is refused by the server, naming the field
    fill("weights", "/etc")
    browser.find_element(By.ID, "plan").click()
    # the toast's element may show before its text does: wait for the text
    toast = _wait(lambda: [t.text for t in browser.find_elements(By.CSS_SELECTOR, ".toast-body") if t.text], 30,
                  "an error")  # fmt: skip
    assert any("weights: /etc is outside the folders this app may use" in text for text in toast), toast

    fill("weights", str(folder / "tiny-sd"))
    fill("images", str(folder / "images"))
    fill("name", "tiny")
    fill("steps", "4")
    fill("overrides", "\n".join(TINY_RUN))
    browser.find_element(By.ID, "plan").click()
    plan = _wait(lambda: "plan:" in value("plan-out") and value("plan-out"), 120, "the dry run's plan")
    assert "  data   6 examples, batches of 2 x 1 process, 3 steps per epoch" in plan, plan
    assert not list((folder / "logs").glob("*_tiny")), "a plan writes no run"

    browser.find_element(By.ID, "start").click()
    _wait(lambda: "done: step 4 of 4" in value("progress"), 300, "the run to finish: " + value("progress"))
    assert "step 4/4 (100 %): loss" in value("progress")
    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#grid img"), 30, "the newest sample grid")
    if shots:
        browser.save_screenshot(str(Path(shots) / "ui-train.png"))
    (run_dir,) = (folder / "logs").glob("*_tiny")
    assert (run_dir / "images" / "step_000004.png").is_file() and (run_dir / "report.html").is_file()

    tab("Runs")
    browser.find_element(By.ID, "refresh").click()
    frame = _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#report iframe"), 60, "the run's report")
    assert run_dir.name in frame[0].get_attribute("srcdoc")

    tab("Sample")
    fill("model", str(run_dir / "checkpoints" / "last.ckpt"))
    fill("prompt", "a red square")
    fill("sample-steps", "2")
    browser.find_element(By.ID, "sample").click()
    images = _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#gallery img"), 180, "sampled images")
    assert len(images) >= 2, "two images by default"
    if shots:
        browser.save_screenshot(str(Path(shots) / "ui-sample.png"))

    # a longer run, stopped (it saves a checkpoint) and resumed from the Runs tab to its end
    tab("Train")
    fill("name", "long")
    fill("steps", "40")
    browser.find_element(By.ID, "start").click()
    _wait(lambda: value("progress").startswith("step "), 120, "the long run's first progress line")
    browser.find_element(By.ID, "stop").click()
    _wait(lambda: "exited with status 143" in value("progress"), 120, "the stop: " + value("progress"))
    assert "stopped by SIGTERM; saved " in value("progress")
    (long_run,) = (folder / "logs").glob("*_long")
    saved = sorted((long_run / "checkpoints").glob("step-*.ckpt"))
    assert saved and saved[-1].name != "step-000040.ckpt", "stopped before its end, with a checkpoint"
    tab("Runs")
    browser.find_element(By.ID, "refresh").click()
    _wait(lambda: long_run.name in (browser.find_element(By.CSS_SELECTOR, "#run input").get_attribute("value") or ""),
          30, "the newest run chosen")  # fmt: skip
    tab("Train")
    browser.find_element(By.ID, "resume").click()
    _wait(lambda: "done: step 40 of 40" in value("progress"), 300, "the resumed run's end: " + value("progress"))
    assert (long_run / "checkpoints" / "step-000040.ckpt").is_file()
