"""Entry point, run on every rank: `verl-mcore-train --config FILE [a.b=c ...]`
(or `python -m verl_mcore.train ...`). FILE may be a shipped config's name: `--config quickstart`.

config -> (verl_mcore/job.py) launch environment -> torch.distributed -> process groups ->
Trainer -> fit.
"""
from __future__ import annotations

import argparse
import sys

from verl_mcore.config import Config, ConfigError


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
    # The job needs torch and megatron-core (seconds to import, and megatron warns as it
    # imports): deferred until the config has loaded, so that a config error comes in a fraction
    # of a second and is the last line printed (issue 39).
    from verl_mcore.job import run

    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
