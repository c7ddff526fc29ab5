"""trainer.device=cpu where torch sees a GPU: the configured device decides, not CUDA's presence.

Under the GPU image's CUDA build (torch 2.11+cu130) the quickstart with trainer.device=cpu
segfaulted in the first optimizer step: cpu_compat was installed only without CUDA, so megatron
built the model and its parameter buffers on the GPU while the process group was gloo, and
megatron's coalesced parameter all-gather (param_and_grad_buffer.py start_param_sync) handed the
CUDA buffers to gloo's coalesced all-gather, which has no CUDA variant and reads them as host
memory. Here (a CPU build) torch.cuda.is_available is made to answer True in the ranks, which
takes the same branches; the real CUDA build is the gpu-marked test below (and the GPU
matrix's device-cpu-* cases).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


def _overrides(model_dir, run_dir):
    return [f"model.path={model_dir}", f"trainer.run_dir={run_dir}", "trainer.total_steps=2",
            "trainer.device=cpu", "trainer.val_every=0", "checkpoint.save_every=0",
            "reward.num_workers=0", "parallel.use_distributed_optimizer=true",
            f"data.train_files=[{ROOT}/examples/data/quickstart_train.parquet]",
            f"data.val_files=[{ROOT}/examples/data/quickstart_val.parquet]",
            f"reward.custom_fn.path={ROOT}/examples/quickstart_reward.py",
            "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2",
            "actor.micro_batch_size_per_gpu=4"]


def _train_with_cuda_visible(rank, world_size, overrides, cuda_visible):
    """The trainer (quickstart config) in this rank, torch.cuda.is_available() answering
    `cuda_visible`; returns what decided the device and where the parameter all-gather ran."""
    import torch
    from megatron.core.distributed import param_and_grad_buffer

    from verl_mcore.config import Config, validate
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.trainer import Trainer
    from verl_mcore.utils.device import cuda_in_use

    torch.cuda.is_available = lambda: cuda_visible  # a fresh rank: nothing to restore
    synced = []  # devices of the buckets the distributed optimizer all-gathered
    start_param_sync = param_and_grad_buffer._ParamAndGradBucketGroup.start_param_sync

    def recording(self, *args, **kwargs):
        synced.extend(str(bucket.param_data.device) for bucket in self.buckets)
        return start_param_sync(self, *args, **kwargs)

    param_and_grad_buffer._ParamAndGradBucketGroup.start_param_sync = recording
    cfg = Config.load(str(ROOT / "configs/quickstart.yaml"), overrides)
    validate(cfg, world_size)
    trainer = Trainer(cfg)
    code = trainer.fit()
    return {"code": code, "cpu_compat": cpu_compat.is_installed(), "cuda_in_use": cuda_in_use(),
            "param_devices": sorted({str(p.device) for m in trainer.actor.engine.model
                                     for p in m.parameters()}),
            "synced": sorted(set(synced))}


def _rows(run_dir):
    from verl_mcore.tracking import read_metrics

    return read_metrics(str(run_dir))


@pytest.mark.slow
@pytest.mark.distributed
def test_device_cpu_with_cuda_visible_runs_the_cpu_path_on_two_gloo_ranks(tiny_model, tmp_path):
    # The oracle: the same run where torch sees no GPU (how CPU machines always ran it).
    plain = run_on_ranks(_train_with_cuda_visible, 2, timeout=600, fresh=True,
                         args=(_overrides(tiny_model, tmp_path / "plain"), False))
    seen = run_on_ranks(_train_with_cuda_visible, 2, timeout=600, fresh=True,
                        args=(_overrides(tiny_model, tmp_path / "seen"), True))
    for result in plain + seen:
        assert result == {"code": 0, "cpu_compat": True, "cuda_in_use": False,
                          "param_devices": ["cpu"], "synced": ["cpu"]}, result
    # The distributed optimizer's all-gather ran (the call that segfaulted), and the run is the
    # CPU run it would be on a CPU build, number for number.
    keys = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean")
    a, b = _rows(tmp_path / "plain"), _rows(tmp_path / "seen")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]


def quickstart_argv(ranks: int, *overrides: str) -> list[str]:
    """`python -m verl_mcore.train --config configs/quickstart.yaml ...` on `ranks` processes
    (torchrun's launcher for more than one: gloo ranks on the CPU)."""
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return launcher + ["-m", "verl_mcore.train", "--config", "configs/quickstart.yaml", *overrides]


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [1, 2])
def test_device_cpu_under_a_cuda_build_of_torch(tiny_model, tmp_path, ranks):
    """The quickstart, 2 steps, trainer.device=cpu, where this interpreter's torch has CUDA and
    sees a GPU: it segfaulted (exit -11) in the distributed optimizer's first parameter
    all-gather before cpu_compat followed the configured device."""
    import torch

    assert torch.version.cuda and torch.cuda.is_available()  # what this test is about
    run_dir = tmp_path / "run"
    argv = quickstart_argv(ranks, f"model.path={tiny_model}", f"trainer.run_dir={run_dir}",
                           "trainer.device=cpu", "trainer.total_steps=2",
                           "parallel.use_distributed_optimizer=true")
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="2"))
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"exit {run.returncode} (-11 was the segfault)\n{out[-4000:]}"
    assert [r["step"] for r in _rows(run_dir)] == [1, 2]
    # The trainer decided on the CPU (offload "auto" reads the compute device, not CUDA's presence).
    assert "offload between phases: off (auto: on CPU" in out
    assert (run_dir / "checkpoints" / "actor" / "step_00000002").is_dir()
