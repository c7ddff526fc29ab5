"""Checkpoints that cannot run code or poison a resume (issue 18, parts 1 and 2).

A planted pickle never runs: `.metadata` payloads are refused by the allow-list, `.distcp`
objects and `.pt` files by weights_only, on every load path (auto-resume, checkpoint.load_path,
model.checkpoint, tools/convert_hf's reader), whether or not the attacker rewrote the manifest;
each test proves it by the marker file the payload would write. A checkpoint whose files differ
from its manifest (truncated, overwritten) is set aside at resume, and the run continues from the
previous one bitwise like a run that was never interrupted. One real save/resume sequence on 2
gloo ranks (DP=2) covers all of it; the rest are single-process unit tests.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil

import pytest
import torch

from tests.multiproc import run_on_ranks
from verl_mcore.engine import checkpoint as ck
from verl_mcore.utils import manifest
from verl_mcore.utils.safe_read import (
    BadCheckpointError,
    SafeBytesPlanner,
    _megatron_reads_safely,
    read_dcp_metadata,
    torch_load,
)

TIMEOUT = 600


class _Payload:
    """Unpickled by plain pickle, writes `marker`: what a hostile checkpoint would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def _remanifest(path: str) -> None:
    """The attacker rewrites the manifest to match their files."""
    with open(os.path.join(path, manifest.MANIFEST), "w") as f:
        json.dump(manifest.build_manifest(path), f)


def _plant_metadata(dist_dir: str, marker: str) -> None:
    """A `.metadata` that is a valid index *and* runs the payload under plain pickle."""
    path = os.path.join(dist_dir, ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # our own checkpoint
    metadata.planted = _Payload(marker)
    with open(path, "wb") as f:
        pickle.dump(metadata, f)


def _plant_object(dist_dir: str, marker: str) -> None:
    """Replace one of megatron's sharded objects (an `_extra_state`) inside a .distcp by a
    payload appended to that file, with `.metadata` pointing at it (allow-listed classes only)."""
    path = os.path.join(dist_dir, ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    index = next(i for i in metadata.storage_data if "_extra_state" in i.fqn)
    info = metadata.storage_data[index]
    blob = io.BytesIO()
    torch.save(_Payload(marker), blob)
    target = os.path.join(dist_dir, info.relative_path)
    info.offset = os.path.getsize(target)
    info.length = len(blob.getvalue())
    with open(target, "ab") as f:
        f.write(blob.getvalue())
    with open(path, "wb") as f:
        pickle.dump(metadata, f)


def _distcp(path: str) -> str:
    return os.path.join(path, ck.DIST_DIR, "__0_0.distcp")


def _truncate(file: str, keep: int) -> None:
    with open(file, "r+b") as f:
        f.truncate(keep)


def _overwrite_256(file: str) -> None:
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) // 2)
        f.write(bytes(range(256)))


# What each variant does to the newest checkpoint (step 3) of a copy of the run's directory;
# marker: the payload's marker file. Every one must make the resume fall back to step 2.
def _corrupt(step3: str, variant: str, marker: str) -> None:
    if variant == "truncated_distcp":
        _truncate(_distcp(step3), os.path.getsize(_distcp(step3)) // 2)
    elif variant == "truncated_trainer_state":
        _truncate(os.path.join(step3, ck.TRAINER_STATE), 100)
    elif variant == "overwritten_distcp":
        _overwrite_256(_distcp(step3))
    elif variant == "planted_metadata":  # with a matching manifest: the allow-list refuses it
        _plant_metadata(os.path.join(step3, ck.DIST_DIR), marker)
        _remanifest(step3)
    elif variant == "planted_object":  # the same for weights_only on a .distcp object
        _plant_object(os.path.join(step3, ck.DIST_DIR), marker)
        _remanifest(step3)
    elif variant == "no_manifest_truncated":  # an old checkpoint: the size checks still apply
        _as_saved_before_manifests(step3)
        _truncate(_distcp(step3), os.path.getsize(_distcp(step3)) - 10)
    elif variant == "deleted_manifest":  # a new checkpoint's manifest removed, bytes altered
        os.remove(os.path.join(step3, manifest.MANIFEST))
        _overwrite_256(_distcp(step3))
    elif variant == "renamed":  # the directory renamed: its name says step 5, meta.json step 3
        os.rename(step3, step3.replace("step_00000003", "step_00000005"))
    elif variant == "mixed_trainer_state":  # step 2's trainer state copied in, manifest matching
        shutil.copy(step3.replace("step_00000003", "step_00000002") + f"/{ck.TRAINER_STATE}",
                    f"{step3}/{ck.TRAINER_STATE}")
        _remanifest(step3)
    else:
        raise ValueError(variant)


FALLBACK_VARIANTS = ["truncated_distcp", "truncated_trainer_state", "overwritten_distcp",
                     "planted_metadata", "planted_object", "no_manifest_truncated",
                     "deleted_manifest", "renamed", "mixed_trainer_state"]
SET_ASIDE_AS = {"renamed": "corrupt.step_00000005"}  # default: corrupt.step_00000003


def _as_saved_before_manifests(step_dir: str) -> None:
    """What a checkpoint saved before manifests looks like: none, and no claim of one."""
    os.remove(os.path.join(step_dir, manifest.MANIFEST))
    meta_file = os.path.join(step_dir, ck.META)
    with open(meta_file) as f:
        meta = json.load(f)
    meta.pop("manifest")
    with open(meta_file, "w") as f:
        json.dump(meta, f)


def _save_then_resume_corrupted(rank, world_size, tmp):
    """Train 4 steps saving every step (async: the manifest is written by the finalize), keep a
    copy of the directory after step 3; for each variant, corrupt step 3 in a copy, restart
    from it and train steps 3 and 4. Then the explicit load paths on a planted copy."""
    import torch.distributed as dist

    from tests.engine import checkpoint_trainer as ct
    from tests.engine.test_checkpoint_layouts import _children_allowed
    from verl_mcore.checkpoints import RunCheckpoints
    from verl_mcore.config.schema import CheckpointConfig
    from verl_mcore.models.checkpoint import load_dist_checkpoint
    from tools.convert_hf.dist_ckpt import DistCheckpointReader

    def on_rank0(fn):
        if rank == 0:
            fn()
        dist.barrier()

    ct.seed_everything(ct.SEED)
    chunks, optimizer, scheduler = ct.build(dropout=0.1)
    root, snapshot = f"{tmp}/run", f"{tmp}/after_step3"
    ckpt = ck.Checkpointer(root, keep_last=2, async_save=True)
    losses = {}
    with _children_allowed():
        for step in range(1, 5):
            losses[step] = ct.train_step(chunks, optimizer, scheduler, ct.next_batch())
            ckpt.save(step, chunks, optimizer, scheduler, {"step": step})
            ckpt.maybe_finalize(blocking=True)
            if step == 3:
                on_rank0(lambda: shutil.copytree(root, snapshot))
        ckpt.close()
    out = {"losses": losses, "manifest": manifest.read_manifest(f"{root}/step_00000004"),
           "files": manifest.list_files(f"{root}/step_00000004"), "variants": {}}

    for variant in FALLBACK_VARIANTS:
        vroot, marker = f"{tmp}/{variant}", f"{tmp}/{variant}.PWNED"
        on_rank0(lambda: (shutil.copytree(snapshot, vroot),
                          _corrupt(f"{vroot}/step_00000003", variant, marker)))
        # As a restart, but without rebuilding (1 s a build): the load must overwrite the model,
        # Adam's state, the LR schedule and the RNGs the previous variant left at step 4.
        ct.seed_everything(999)
        with _children_allowed():
            loaded = ck.Checkpointer(vroot).load(chunks, optimizer, scheduler)
        resumed = [ct.train_step(chunks, optimizer, scheduler, ct.next_batch()) for _ in (3, 4)]
        out["variants"][variant] = {
            "step": loaded.step, "resumed": resumed, "listing": sorted(os.listdir(vroot)),
            "latest": open(f"{vroot}/{ck.LATEST}").read().strip(),
            "pwned": os.path.exists(marker)}

    # An old checkpoint (no manifest, and a meta.json from before they existed, intact) loads
    # with a warning.
    old = f"{tmp}/old"
    on_rank0(lambda: (shutil.copytree(snapshot, old), _as_saved_before_manifests(f"{old}/step_00000003")))
    out["old_step"] = ck.Checkpointer(old).load(chunks, optimizer, scheduler).step

    # Explicit choices are refused, not replaced: checkpoint.load_path, model.checkpoint and
    # tools/convert_hf's reader, on a planted copy whose manifest matches.
    planted, marker = f"{tmp}/planted", f"{tmp}/explicit.PWNED"
    on_rank0(lambda: (shutil.copytree(snapshot, planted),
                      _plant_metadata(f"{planted}/step_00000003/{ck.DIST_DIR}", marker),
                      _remanifest(f"{planted}/step_00000003")))
    errors = {}
    role = type("Role", (), {"engine": type("E", (), {"model": chunks, "optimizer": optimizer,
                                                      "scheduler": scheduler})})
    attempts = {
        "load_path": lambda: RunCheckpoints(CheckpointConfig(), f"{tmp}/other_run", False).resume(
            CheckpointConfig(load_path=f"{planted}/step_00000003"), role, None),
        "model.checkpoint": lambda: load_dist_checkpoint(
            ck._unwrap(chunks[0]), f"{planted}/step_00000003/{ck.DIST_DIR}"),
        "convert_hf": lambda: DistCheckpointReader(f"{planted}/step_00000003/{ck.DIST_DIR}"),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            errors[name] = None
        except BadCheckpointError as e:
            errors[name] = str(e)
    out["explicit"] = {"errors": errors, "pwned": os.path.exists(marker),
                       "run_dir_untouched": sorted(os.listdir(f"{planted}"))}
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ckpt_safety"))
    return run_on_ranks(_save_then_resume_corrupted, 2, (tmp,), timeout=TIMEOUT)


def test_manifest_lists_every_file_of_a_save(resumed):
    r = resumed[0]
    assert sorted(r["manifest"]) == r["files"]
    assert {"meta.json", "trainer_state.pt", "rng/rank_00000.pt", "rng/rank_00001.pt",
            "dist/.metadata", "dist/common.pt", "dist/__1_0.distcp"} <= set(r["files"])
    assert all(len(e["sha256"]) == 64 and e["size"] > 0 for e in r["manifest"].values())


@pytest.mark.parametrize("variant", FALLBACK_VARIANTS)
def test_corrupt_newest_is_set_aside_and_the_resume_is_bitwise(resumed, variant):
    for r in resumed:  # every rank took the same decision
        v = r["variants"][variant]
        assert v["step"] == 2
        assert v["resumed"] == [r["losses"][3], r["losses"][4]]  # exactly
        assert v["listing"] == [SET_ASIDE_AS.get(variant, "corrupt.step_00000003"), ck.LATEST,
                                "step_00000002"]
        assert v["latest"] == "step_00000002"
        assert not v["pwned"]


def test_old_checkpoint_without_manifest_loads(resumed):
    assert resumed[0]["old_step"] == 3


def test_planted_pickle_is_refused_on_every_explicit_load_path(resumed):
    for r in resumed:
        e = r["explicit"]
        assert not e["pwned"]
        for name, error in e["errors"].items():
            assert error is not None, f"{name} loaded a planted checkpoint"
            assert "step_00000003/dist/.metadata: refused to unpickle builtins.exec" in error, name
        assert "checkpoint.load_path=" in e["errors"]["load_path"]
        assert e["run_dir_untouched"] == [ck.LATEST, "step_00000002", "step_00000003"]


# ---------------------------------------------------------------- single process


@pytest.fixture
def real_dcp_dir(tmp_path):
    """A small DCP directory written by torch (no megatron): a tensor and an object."""
    import torch.distributed.checkpoint as dcp

    d = str(tmp_path / "dcp")
    dcp.save({"w": torch.arange(6.0).reshape(2, 3), "obj": io.BytesIO(b"x")},
             storage_writer=dcp.FileSystemWriter(d), no_dist=True)
    return d


def test_the_planted_metadata_would_run_under_plain_pickle(real_dcp_dir, tmp_path):
    marker = str(tmp_path / "PWNED")
    _plant_metadata(real_dcp_dir, marker)
    with pytest.raises(BadCheckpointError, match=r"dcp/\.metadata: refused to unpickle "
                                                 r"builtins\.exec"):
        read_dcp_metadata(os.path.join(real_dcp_dir, ".metadata"))
    assert not os.path.exists(marker)
    with open(os.path.join(real_dcp_dir, ".metadata"), "rb") as f:
        pickle.load(f)  # what torch's own reader does
    assert os.path.exists(marker)  # so the test above proves something


def test_metadata_pointing_outside_the_directory_is_refused(real_dcp_dir):
    path = os.path.join(real_dcp_dir, ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    next(iter(metadata.storage_data.values())).relative_path = "../../etc/passwd"
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(BadCheckpointError, match=r"points at '../../etc/passwd'"):
        read_dcp_metadata(path)


def test_truncated_metadata_names_the_file(real_dcp_dir):
    _truncate(os.path.join(real_dcp_dir, ".metadata"), 40)
    with pytest.raises(BadCheckpointError, match=r"dcp/\.metadata: unreadable"):
        read_dcp_metadata(os.path.join(real_dcp_dir, ".metadata"))


def test_pt_files_and_distcp_objects_are_loaded_as_data_only(tmp_path):
    marker = str(tmp_path / "PWNED")
    pt = str(tmp_path / "trainer_state.pt")
    torch.save({"extra": _Payload(marker)}, pt)
    with pytest.raises(BadCheckpointError, match=r"trainer_state\.pt: cannot be read as plain"):
        torch_load(pt)
    blob = io.BytesIO()
    torch.save(_Payload(marker), blob)
    planner = SafeBytesPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    item = type("ReadItem", (), {"dest_index": type("I", (), {"fqn": "x._extra_state"})})
    with pytest.raises(BadCheckpointError, match=r"object 'x._extra_state' .* not plain data"):
        planner.load_bytes(item, io.BytesIO(blob.getvalue()))
    assert not os.path.exists(marker)
    blob = io.BytesIO()
    torch.save([None], blob)
    planner.load_bytes(item, io.BytesIO(blob.getvalue()))
    assert planner.state_dict == {"x._extra_state": [None]}


def test_megatron_loads_use_the_safe_reader_and_planner_only_inside_the_context(real_dcp_dir):
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    before = (mcore_torch._get_filesystem_reader, mcore_torch.MCoreLoadPlanner)
    with _megatron_reads_safely():
        reader = mcore_torch._get_filesystem_reader(real_dcp_dir, cache_metadata=True)
        assert reader.read_metadata() is reader.read_metadata()  # cached, as megatron expects
        assert type(reader).__name__ == "SafeFileSystemReader"
        assert issubclass(mcore_torch.MCoreLoadPlanner, SafeBytesPlanner)
    assert (mcore_torch._get_filesystem_reader, mcore_torch.MCoreLoadPlanner) == before


def test_manifest_checks_every_file(tmp_path):
    root = tmp_path / "ckpt"
    (root / "dist").mkdir(parents=True)
    (root / "dist" / "__0_0.distcp").write_bytes(os.urandom(5000))
    (root / "dist" / "__1_0.distcp").write_bytes(os.urandom(3000))
    (root / "meta.json").write_text("{}")
    _remanifest(str(root))
    files = manifest.read_manifest(str(root))
    # Shared out across ranks: every file checked exactly once.
    shares = [manifest._share(files, r, 2) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(files) and all(shares)
    manifest.verify_share(str(root), files)

    def fails(match):
        with pytest.raises(BadCheckpointError, match=match):
            manifest.verify_share(str(root), manifest.read_manifest(str(root)))

    _overwrite_256(str(root / "dist" / "__0_0.distcp"))
    fails(r"dist/__0_0\.distcp: SHA-256 .*contents changed since the save")
    _truncate(str(root / "dist" / "__0_0.distcp"), 10)
    fails(r"dist/__0_0\.distcp: 10 bytes, the manifest says 5000")
    os.remove(root / "dist" / "__0_0.distcp")
    fails(r"dist/__0_0\.distcp: listed in the manifest but unreadable")
    _remanifest(str(root))
    (root / "dist" / "extra.distcp").write_bytes(b"x")
    fails(r"dist/extra\.distcp: not in .*manifest\.json")
    (root / manifest.MANIFEST).write_text('{"format": 1, "files": {"../x": {"size": 1, '
                                          '"sha256": "0"}}}')
    fails(r"manifest\.json: malformed entry '../x'")


def test_writer_rank_from_file_names():
    assert manifest._writer_rank("dist/__3_1.distcp") == 3
    assert manifest._writer_rank("rng/rank_00012.pt") == 12
    assert manifest._writer_rank("dist/common.pt") == 0
    assert manifest._writer_rank("meta.json") == 0
