"""The configs and quickstart examples that ship with the package, and how a config finds them.

`pip install .` (not editable) copies configs/*.yaml and the quickstart's example files into
verl_mcore/_shipped/ (setup.py, SHIPPED); in a checkout the repository root plays that part. Two
rules, so that `verl-mcore-train --config quickstart` runs from any directory after an install:

  --config NAME      a NAME with no directory part and no file of that name in the current
                     directory is the shipped configs/NAME.yaml (`quickstart`, `quickstart.yaml`);
  relative paths     a relative path in one of PATH_KEYS that does not exist relative to the
                     current directory but does among the shipped files is read from there
                     (examples/data/quickstart_train.parquet, examples/quickstart_reward.py).

A path that exists relative to the current directory always wins, so a checkout or a copy of the
examples behaves as before; a path that exists in neither place is left for the usual error.
Other paths (model.path, trainer.run_dir) are never redirected: they are written to, and the
package directory may be read-only.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

from verl_mcore.errors import ConfigError

log = logging.getLogger("verl_mcore.config")

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
# Config keys that name input files the shipped configs refer to.
PATH_KEYS = ("data.train_files", "data.val_files", "data.custom_cls.path",
             "reward.custom_fn.path", "reward.custom_cls.path")


def shipped_root() -> Optional[str]:
    """verl_mcore/_shipped in an installed package; the repository root in a checkout."""
    for root in (os.path.join(_PACKAGE, "_shipped"), os.path.dirname(_PACKAGE)):
        if os.path.isdir(os.path.join(root, "configs")):
            return root
    return None


def shipped_configs() -> list[str]:
    root = shipped_root()
    if root is None:
        return []
    return sorted(f[:-len(".yaml")] for f in os.listdir(os.path.join(root, "configs"))
                  if f.endswith(".yaml"))


def config_file(path: str) -> str:
    """`path` itself, or the shipped config a bare name stands for (the first rule above)."""
    if os.path.exists(path) or os.path.dirname(path):
        return path
    root = shipped_root()
    name = path if path.endswith((".yaml", ".yml")) else f"{path}.yaml"
    candidate = os.path.join(root, "configs", name) if root else None
    if candidate and os.path.isfile(candidate):
        return candidate

    raise ConfigError(f"--config {path}: no such file here, and no shipped config of that name "
                      f"(shipped: {', '.join(shipped_configs()) or 'none found'})")


def _resolve(path: str, root: str) -> str:
    if os.path.isabs(path) or os.path.exists(path):
        return path
    candidate = os.path.join(root, path)
    if os.path.exists(candidate):
        log.info("%s: not in %s; reading the shipped %s", path, os.getcwd(), candidate)
        return candidate
    return path


def resolve_paths(cfg) -> None:
    """Apply the second rule above to cfg's PATH_KEYS, in place."""
    root = shipped_root()
    if root is None:
        return
    for key in PATH_KEYS:
        *parents, leaf = key.split(".")
        owner = cfg
        for name in parents:
            owner = getattr(owner, name)
        value = getattr(owner, leaf)
        if isinstance(value, list):
            setattr(owner, leaf, [_resolve(v, root) for v in value])
        elif value:
            setattr(owner, leaf, _resolve(value, root))
