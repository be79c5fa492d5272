"""The progress bar counts what bounds the run: optimizer steps out of max_steps, or an epoch's batches."""

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from ldm.training.callbacks.progress import StepProgressBar


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch).pow(2).mean()
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(torch.randn(3, 2), batch_size=1)  # 3 batches per epoch


class Record(pl.Callback):
    """What the bar shows after every batch."""

    def __init__(self, bar):
        self.bar, self.seen = bar, []

    def on_train_batch_end(self, trainer, *args):
        tqdm = self.bar.train_progress_bar
        self.seen.append((tqdm.desc, tqdm.n, tqdm.total))


def fit(tmp_path, **trainer_kwargs):
    bar = StepProgressBar(lines=False)
    record = Record(bar)
    trainer = pl.Trainer(
        callbacks=[bar, record], logger=False, enable_checkpointing=False, default_root_dir=tmp_path, **trainer_kwargs
    )
    trainer.fit(Tiny())
    return record.seen, bar


def test_a_run_bounded_by_steps_counts_steps_out_of_max_steps_across_epochs(tmp_path):
    # 3 batches per epoch, accumulated by 2: steps end at batches 2 and 3 of each epoch; 7 steps in 11 batches
    seen, bar = fit(tmp_path, max_steps=7, accumulate_grad_batches=2)
    assert [total for _, _, total in seen] == [7] * 11
    assert [n for _, n, _ in seen] == [0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7]
    assert [desc for desc, _, _ in seen] == [f"epoch {e}: " for e in (0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3)]
    assert "v_num" not in bar.train_progress_bar.postfix and "loss=" in bar.train_progress_bar.postfix


def test_a_run_bounded_by_epochs_counts_the_batches_of_each_epoch(tmp_path):
    seen, _ = fit(tmp_path, max_epochs=2)
    assert [(n, total) for _, n, total in seen] == [(1, 3), (2, 3), (3, 3)] * 2
