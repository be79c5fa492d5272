"""The plan block a run prints, in its variants: adapters, accumulation, several processes, epochs, resumes."""

from ldm.training.callbacks.plan import Plan, count, duration


def plan(**changes) -> Plan:
    fields = dict(parts=[("unet", "UNet2DConditionModel", 859_520_964, 859_520_964)], examples=1000, batch_size=4,
                  processes=1, accumulate=1, steps_per_epoch=250, max_steps=1000, max_epochs=None, start_step=0,
                  checkpoint_every=500, where="cuda:0 (NVIDIA H100, 79.1 GiB, 78.6 free), SingleDeviceStrategy, "
                  "precision bf16-mixed")  # fmt: skip
    return Plan(**{**fields, **changes})


def test_a_plain_fine_tune():
    assert plan().lines() == [
        "plan:",
        "  model  unet (UNet2DConditionModel) 860 M trained",
        "  data   1,000 examples, batches of 4 x 1 process, 250 steps per epoch",
        "  run    1,000 steps (~4 epochs); a checkpoint every 500 steps and at the end",
        "  on     cuda:0 (NVIDIA H100, 79.1 GiB, 78.6 free), SingleDeviceStrategy, precision bf16-mixed",
    ]


def test_adapters_accumulation_processes_a_resume_and_notes():
    lines = plan(
        parts=[("unet", "UNet2DConditionModel", 862_000_000, 3_200_000), ("vae", "AutoencoderKL", 83_653_863, 0)],
        processes=2, accumulate=4, steps_per_epoch=31, start_step=600, notes=[("memory", "one step peaks at 7.1 GiB")],
    ).lines()  # fmt: skip
    assert lines[1] == "  model  unet (UNet2DConditionModel) 3.2 M of 862 M trained; vae (AutoencoderKL) 83.7 M frozen"
    assert (
        lines[2]
        == "  data   1,000 examples, batches of 4 x 2 processes x 4 accumulated = 32 per step, 31 steps per epoch"
    )
    assert lines[3] == "  run    1,000 steps (~33 epochs), from step 600; a checkpoint every 500 steps and at the end"
    assert lines[5] == "  memory one step peaks at 7.1 GiB"


def test_a_stream_bounded_by_epochs():
    lines = plan(examples=None, steps_per_epoch=None, max_steps=-1, max_epochs=3).lines()
    assert lines[2] == "  data   a stream of examples, batches of 4 x 1 process"
    assert lines[3] == "  run    3 epochs; a checkpoint every 500 steps and at the end"


def test_counts_and_durations_read_as_people_write_them():
    assert [count(n) for n in (12, 953_412, 1_077_572, 2_567_463_684)] == ["12", "953 K", "1.08 M", "2.57 B"]
    assert [duration(s) for s in (41.4, 281, 7500)] == ["41 s", "4 min 41 s", "2 h 05 min"]
