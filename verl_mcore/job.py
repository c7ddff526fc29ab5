"""One rank's training job once its config has loaded (verl_mcore/train.py): the launch
environment, the config's cross-field checks, torch.distributed, the Trainer, fit. Returns the
process's exit code (2: refused before training, with the reason on rank 0's stderr).
"""
from __future__ import annotations

import faulthandler
import sys

import torch.distributed as dist

from verl_mcore.config import Config, ConfigError, validate
from verl_mcore.distributed.agree import AgreedFailure
from verl_mcore.distributed.launch import detect_launch, init_distributed, setup_logging
from verl_mcore.distributed.watchdog import process_group_timeout
from verl_mcore.run_dir import RunDirError
from verl_mcore.trainer import Trainer


def run(cfg: Config) -> int:
    # A crash in native code (a user's scorer with reward.num_workers=0, an extension) then
    # prints the Python stack of every thread instead of only "Segmentation fault".
    try:
        faulthandler.enable()
    except (AttributeError, OSError, ValueError):  # sys.stderr replaced by a stream with no fd
        faulthandler.enable(file=sys.__stderr__)
    info = detect_launch()
    setup_logging(info.rank)
    try:
        # The config alone, before torch.distributed: the same verdict on every rank. What it
        # names (data, model, user code) is checked with the ranks' agreement, by the Trainer.
        validate(cfg, info.world_size, None, info.local_world_size)
    except ConfigError as e:
        # Every rank reaches the same verdict from the same inputs; rank 0 says it once.
        if info.rank == 0:
            print(f"config error: {e}", file=sys.stderr)
        return 2
    # The process groups wait a margin longer than the watchdog, so its readable
    # per-rank report comes first (distributed/watchdog.py).
    init_distributed(info, cfg.trainer.device,
                     process_group_timeout(cfg.trainer.collective_timeout_s).total_seconds())

    try:
        trainer = Trainer(cfg, launch=info)  # writes RUN_DIR/config.yaml once the inputs passed
    except (RunDirError, ConfigError, AgreedFailure) as e:
        # Raised on every rank alike, before any model is built: the run directory's lock, and
        # the checks of build.build_inputs (config, data, model directory, reward code) and
        # build.resolve_offload (the memory plan). Rank 0 says why.
        if info.rank == 0:
            kind = "run directory error" if isinstance(e, RunDirError) else "error before training"
            print(f"{kind}: {e}", file=sys.stderr)
        return 2
    code = trainer.fit()
    if code == 0:
        # Every rank finished the same last step; without this NCCL warns that resources leak.
        if dist.is_initialized():
            dist.destroy_process_group()
    return code

