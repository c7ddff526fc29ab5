"""Checkpoint files are read as data: a planted pickle never runs (issue 18, part 1).

Each test proves it by the marker file the payload would write.
"""
from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

from verl_mcore.engine.safe_read import (
    BadCheckpointError,
    SafeBytesPlanner,
    _megatron_reads_safely,
    read_dcp_metadata,
    torch_load,
)


class _Payload:
    """Unpickled by plain pickle, writes `marker`: what a hostile checkpoint would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def _plant_metadata(dist_dir: str, marker: str) -> None:
    """A `.metadata` that is a valid index *and* runs the payload under plain pickle."""
    path = os.path.join(dist_dir, ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # our own checkpoint
    metadata.planted = _Payload(marker)
    with open(path, "wb") as f:
        pickle.dump(metadata, f)


def _truncate(file: str, keep: int) -> None:
    with open(file, "r+b") as f:
        f.truncate(keep)



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
