"""Entry point, run on every rank: `verl-mcore-train --config FILE [a.b=c ...]`
(or `python -m verl_mcore.train ...`). FILE may be a shipped config's name: `--config quickstart`.

config -> launch environment -> torch.distributed -> process groups -> Trainer -> fit.
"""
from __future__ import annotations

import argparse
import faulthandler
import sys

from verl_mcore.config import Config, ConfigError, validate
from verl_mcore.distributed.agree import AgreedFailure
from verl_mcore.distributed.launch import detect_launch, init_distributed, setup_logging
from verl_mcore.distributed.watchdog import process_group_timeout
from verl_mcore.run_dir import RunDirError
from verl_mcore.trainer import Trainer


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="verl-mcore-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config file, or the name of a shipped one "
                                          "(quickstart, ...)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the fully resolved config as YAML and exit")
    parser.add_argument("overrides", nargs="*", metavar="a.b.c=value",
                        help="config overrides, values parsed as YAML (lists: key=[a,b])")
    return parser.parse_args(argv)


def load_config(args: argparse.Namespace) -> Config:
    return Config.load(args.config, args.overrides)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0

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
        trainer = Trainer(cfg, launch=info)  # writes RUN_DIR/config.yaml once it holds the lock
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
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
