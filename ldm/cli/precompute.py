"""Encode a configured dataset once, with the config's own VAE and text encoder, into MDS shards to train from.

    python scripts/precompute.py -b configs/finetune/sd-folder.yaml --out shards/photos \\
        model.params.pretrained=/path/to/stable-diffusion-v1-5 data.params.root=/path/to/photos

Under torchrun or SLURM every process takes its share of the chunks. A stopped precompute continues where
it stopped when run again with the same arguments; a finished one is only re-indexed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ldm.cli import console
from ldm.config import ConfigError, instantiate
from ldm.data import DataModule
from ldm.training.launch import cluster_environment
from ldm.training.run import REJECTIONS, prepare_config

log = logging.getLogger("ldm")

# How long the first processes wait at the barrier for the slowest one to finish its chunks.
BARRIER_TIMEOUT = timedelta(days=1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-b", "--base", action="append", required=True, metavar="CONFIG", help="later files win")
    parser.add_argument("--out", required=True, type=Path, metavar="SHARDS", help="folder for the shards")
    parser.add_argument("--source", default=None, metavar="NAME", help="the data's name (default: --out's name)")
    parser.add_argument("--chunk-size", type=int, default=4096, help="examples per chunk (default: 4096)")
    parser.add_argument("--batch-size", type=int, default=None, help="default: max(data.params.batch_size, 32)")
    parser.add_argument("--min-bucket", type=int, default=1, metavar="N",
                        help="with data.params.buckets: a bucket of fewer images joins its neighbour; give the "
                        "training run's global batch (default: 1)")  # fmt: skip
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides; win over files")
    parser.add_argument("-v", "--verbose", action="store_true", help="show other libraries' messages too")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console.setup(args.verbose)
    try:
        from ldm.data.precompute import PrecomputeError, precompute
    except ImportError as err:
        print(f"precompute needs the pretrain extra (pip install -e '.[pretrain]'): {err}", file=sys.stderr)
        return 2
    try:
        cfg, _ = prepare_config(args.base, args.overrides, None)
        datamodule = instantiate(cfg.data, "data", REJECTIONS)
        if not isinstance(datamodule, DataModule):
            raise ConfigError(
                f"data.target: {cfg.data.target} is not an ldm.data.DataModule of images and captions; precompute "
                "encodes images: point data at one (ldm.data.folder.FolderDataModule, or data.params.dataset)"
            )
        dataset = datamodule.build_dataset()
        model = instantiate(cfg.model, "model", REJECTIONS)
        model.configure_model()
        rank, world_size, local_rank = _join_processes()
    except ConfigError as err:  # every mistake found, one line each, the key path first
        print(err, file=sys.stderr)
        return 2
    model.to(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    source = args.source or args.out.resolve().name
    batch_size = args.batch_size or max(datamodule.batch_size, 32)
    try:
        cost = precompute(model, dataset, args.out, source, args.chunk_size, batch_size, datamodule.num_workers,
                          rank, world_size, min_bucket=args.min_bucket)  # fmt: skip
    except PrecomputeError as err:
        print(err, file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        print(cost)
        print(f"shards: {args.out.resolve()}")
    return 0


def _join_processes() -> tuple[int, int, int]:
    """This process's rank, the number of processes and its local rank: from torchrun or SLURM, or from
    RANK / WORLD_SIZE / LOCAL_RANK as any launcher sets them. Several processes join a gloo process group at
    MASTER_ADDR:MASTER_PORT (torchrun sets them; under SLURM they default as Lightning sets them), for the barriers."""
    env = cluster_environment()
    if env is not None:
        rank, world_size, local_rank = env.global_rank(), env.world_size(), env.local_rank()
        os.environ.setdefault("MASTER_ADDR", env.main_address)
        os.environ.setdefault("MASTER_PORT", str(env.main_port))
    else:
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if world_size > 1 and not dist.is_initialized():
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise ConfigError(
                f"WORLD_SIZE={world_size} but {' and '.join(missing)} not set; set MASTER_ADDR to rank 0's host "
                "and MASTER_PORT to a free port there (torchrun and SLURM set them)"
            )
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size, timeout=BARRIER_TIMEOUT)
    return rank, world_size, local_rank
