"""Hugging Face Hub ids in place of local directories: `model.path=Qwen/Qwen2.5-0.5B-Instruct`.

One function, `local_dir`, turns what the user wrote into the directory everything downstream
reads (config.json, safetensors headers, tokenizer, weights, the planners): a local directory as
is; a hub id `org/name` through huggingface_hub's cache (snapshot_download with only the config,
safetensors and tokenizer files), which honours HF_HOME / HF_HUB_CACHE, HF_TOKEN and
HF_HUB_OFFLINE because huggingface_hub reads them itself. Anything that looks like a path
(absolute, ./, ../, ~, or not exactly one '/') is never sent to the Hub, so a mistyped directory
still fails as "no such directory".

Each id is resolved once per process and kept: the run reads one snapshot from start to end
even if a shared cache's refs/main moves on meanwhile (another job downloading a newer commit).
In the trainer, build.fetch_for_run first downloads on local rank 0 of each node while the node's
other ranks wait, then every rank finds the same snapshot in the cache; both steps are agreed
across ranks (distributed/agree.py), so a failed download stops every rank with its message.
The config keeps the id (RUN_DIR/config.yaml, checkpoints), so the run stays reproducible.
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Optional

from verl_mcore.errors import ConfigError

log = logging.getLogger("verl_mcore.models.hub")

# What a training run reads from a model repo; other weight formats (.bin, .pt, gguf) and
# repo extras (images, ONNX exports) are never downloaded.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt",
                  "*.jinja"]

_resolved: dict[tuple[str, Optional[str]], str] = {}  # (id, revision) -> snapshot directory
# A file or directory in a snapshot of huggingface_hub's cache: .../models--org--name/snapshots/
# <commit>/... (a Hub repo name has no "--", so the first one separates org and name).
_IN_SNAPSHOT = re.compile(r"^(?P<repo>.*models--(?P<org>[^/]+?)--(?P<name>[^/]+))/snapshots/"
                          r"(?P<commit>[^/]+)")


def is_hub_id(where: Optional[str]) -> bool:
    """`org/name` that is not a local directory (a local directory of that name wins, as in
    transformers)."""
    if not where or os.path.isdir(where):
        return False
    looks_like_path = (os.path.isabs(where) or where.startswith((".", "~"))
                       or where.count("/") != 1)
    # `runs/tiny_modle`: a mistyped directory under one that exists here is a path, so it fails
    # as "no such directory" instead of going to the Hub.
    return not looks_like_path and not os.path.isdir(where.split("/", 1)[0])


def local_dir(where: Optional[str], revision: Optional[str] = None, key: str = "model.path",
              download: bool = True) -> Optional[str]:
    """The local directory for `where`: itself unless it is a hub id (callers keep their own
    "no such directory" check), else the cached snapshot of `revision` (None: the default
    branch), downloaded when not cached and `download`. Raises ConfigError naming `key`."""
    if not is_hub_id(where):
        return where
    if (where, revision) in _resolved:
        return _resolved[(where, revision)]
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hub_errors

    at = f" at revision {revision!r}" if revision else ""
    try:
        path = snapshot_download(where, revision=revision, allow_patterns=ALLOW_PATTERNS,
                                 local_files_only=not download)
    except (hub_errors.GatedRepoError, hub_errors.RepositoryNotFoundError) as e:
        # GatedRepoError is a RepositoryNotFoundError: both mean "not visible with this token".
        raise ConfigError(f"{key}={where}: no such model on the Hugging Face Hub, or it is gated "
                          f"or private and needs a token (huggingface_hub says "
                          f"{type(e).__name__}); check the id, or set HF_TOKEN / run `hf auth "
                          "login` with an account that may read it") from e
    except hub_errors.RevisionNotFoundError as e:
        raise ConfigError(f"{key}={where}: the Hub has no revision {revision!r} of it; set the "
                          "revision to a branch, tag or commit hash of that repo") from e
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled,
            hub_errors.IncompleteSnapshotError) as e:
        why = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else
               "the Hub could not be reached" if download else "only the cache is read here")
        rev = f" --revision {revision}" if revision else ""
        raise ConfigError(
            f"{key}={where}: a Hugging Face Hub id{at}, not a local directory, and it is not in "
            f"the Hugging Face cache {constants.HF_HUB_CACHE} ({why}: {e}). Download it first on "
            f"a machine with network into the cache this job reads: `hf download {where}{rev}` "
            f"(`huggingface-cli download` in older huggingface_hub) with the same HF_HOME / "
            f"HF_HUB_CACHE; or set HF_HOME (or HF_HUB_CACHE) to a cache that has it; or set "
            f"{key} to a local directory") from e
    except (hub_errors.HfHubHTTPError, OSError) as e:
        raise ConfigError(f"{key}={where}: downloading it from the Hugging Face Hub{at} into "
                          f"{constants.HF_HUB_CACHE} failed ({type(e).__name__}: {e})") from e
    except hub_errors.HFValidationError as e:  # `org/ti ny`, `org/`: not an id the Hub accepts
        raise ConfigError(f"{key}={where}: neither a local directory nor a valid Hugging Face "
                          f"Hub id ({e}); give a directory that exists or an `org/name` id") from e
    _resolved[(where, revision)] = path
    log.info("%s=%s%s: the Hugging Face snapshot %s", key, where, at, path)
    return path


def cache_advice(path: Optional[str]) -> str:
    """For a damaged or incomplete file (or directory) in the Hugging Face cache: '. It is ...'
    naming the snapshot and how to download it again, to end a message with; '' for any other
    path. Files of a snapshot are links into the repo's blobs/, and huggingface_hub re-links an
    existing blob without checking it, so deleting the snapshot directory alone would bring the
    same damaged file back: the advice is a forced download, or deleting the whole repo folder."""
    found = _IN_SNAPSHOT.match(os.path.abspath(path)) if path else None
    if found is None:
        return ""
    repo_id, commit = f"{found['org']}/{found['name']}", found["commit"]
    offline = " and HF_HUB_OFFLINE unset" if _offline() else ""
    return (f". It is in the Hugging Face cache (snapshot {commit} of {repo_id}), so the copy "
            f"is damaged or incomplete (a download cut short?): download it again with `hf "
            f"download {repo_id} --revision {commit} --force-download` (`huggingface-cli download` "
            f"in older huggingface_hub) where the Hub can be reached and with this job's HF_HOME / "
            f"HF_HUB_CACHE, or delete {found['repo']} and start again with the Hub id {repo_id} "
            f"as the path{offline}, which downloads it anew")


def load_config_json(cfg_file: str) -> dict:
    """A Hugging Face config.json as a dict; a broken file fails naming it and where it breaks
    (and, in the Hugging Face cache, how to download it again)."""
    try:
        with open(cfg_file, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" (line {e.lineno}, column {e.colno}: {e.msg})" if isinstance(e, json.JSONDecodeError) else ""
        raise ConfigError(f"{cfg_file} is not valid JSON{where}: repair or replace the model "
                          f"directory's config.json (model.path){cache_advice(cfg_file)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{cfg_file}: expected a JSON object (a Hugging Face config), got "
                          f"{type(data).__name__} (model.path){cache_advice(cfg_file)}")
    return data


def _offline() -> bool:
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)


def run_sources(cfg) -> list[tuple[str, str, Optional[str]]]:
    """(config key, hub id, revision) of every hub id `cfg` names, in the order they are read."""
    specs = []

    def add(key: str, where: Optional[str], revision: Optional[str]) -> None:
        if is_hub_id(where):
            specs.append((key, where, revision))

    add("model.path", cfg.model.path, cfg.model.revision)
    if cfg.model.tokenizer and cfg.model.tokenizer != cfg.model.path:
        add("model.tokenizer", cfg.model.tokenizer, None)
    for i, s in enumerate(cfg.reward.sources):
        if s.type == "reward_model":
            add(f"reward.sources[{i}].path", s.path, s.revision)
            if s.tokenizer and s.tokenizer != s.path:
                add(f"reward.sources[{i}].tokenizer", s.tokenizer, None)
    return specs
