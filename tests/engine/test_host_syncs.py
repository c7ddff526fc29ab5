"""No host syncs inside forward_backward: nothing in the packed (THD) forward/backward of the
actor reads a device value back to the host, so on a GPU the CPU can queue micro-batch after
micro-batch ahead of the kernels. Metrics stay on the device and are read once per optimizer step
(`reduce_metrics`, the grad norm), outside forward_backward.

On the CPU every tensor is a host tensor, so what is watched is the operations that would sync on
a GPU: `.item()`, `bool(t)`, `int(t)`, `float(t)` (all `aten::_local_scalar_dense`), `.tolist()`,
`nonzero` and the ops built on it (boolean-mask indexing, masked_select, unique), and
repeat_interleave without `output_size`. The one call allowed is the per-sequence SDPA loop of
SDPAttention, which only runs on the CPU (CUDA takes varlen_attn).
"""
from __future__ import annotations

import collections
import math
import traceback

import pytest

from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed

ALLOWED = {("tolist", "verl_mcore/models/attention.py:_packed")}
_SYNCING_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
                "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim"}
_INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def _where() -> str:
    """'path:function' of the innermost frame in our package or megatron-core."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        for root in ("verl_mcore/", "megatron/"):
            if root in path and "cpu_compat" not in path:
                return f"{root}{path.split(root, 1)[1]}:{frame.name}"
    return "?"


class _SyncWatch:
    """Counts would-be host syncs, by (what, where), while `active`."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self.hits: collections.Counter = collections.Counter()
        self.active = False
        watch = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func._schema.name
                flagged = name in _SYNCING_OPS
                if name in _INDEX_OPS:  # boolean masks become nonzero() inside
                    flagged = any(i is not None and i.dtype == torch.bool for i in args[1])
                if name == "aten::repeat_interleave":
                    flagged = (kwargs or {}).get("output_size") is None
                if flagged and watch.active:
                    watch.hits[(name, _where())] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self._tolist = torch.Tensor.tolist

        def tolist(tensor):
            if watch.active:
                watch.hits[("tolist", _where())] += 1
                watch.active = False  # a torch-function mode may route the call back here
                try:
                    return watch._tolist(tensor)
                finally:
                    watch.active = True
            return watch._tolist(tensor)

        torch.Tensor.tolist = tolist

    def wrap(self, fn):
        def watched(*args, **kwargs):
            self.active = True
            try:
                with self.mode:
                    return fn(*args, **kwargs)
            finally:
                self.active = False

        return watched

    def close(self):
        import torch

        torch.Tensor.tolist = self._tolist


def _body(rank, world_size):
    import torch
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    from tests.engine import common as C
    from verl_mcore.engine import optim_step
    from verl_mcore.engine.actor import Actor
    from verl_mcore.models import rope

    torch.manual_seed(0)
    cfg = C.actor_config(max_tokens_per_microbatch=40)
    engine = C.make_engine("actor", C.reference_weights("actor"), optim=cfg.optim)
    actor = Actor(engine, cfg, mini_batch_size=8)
    batch = C.make_batch(seed=1, num=8)
    watch = _SyncWatch()
    try:
        fb = engine.forward_backward
        engine.forward_backward = watch.wrap(fb)
        actor.compute_log_prob(batch, compute_entropy=True)
        actor.update(batch)
        ours = dict(watch.hits)
        # The optimizer step alone, then our norm next to megatron's on the same gradients.
        watch.hits.clear()
        engine.forward_backward, watched_fb = fb, engine.forward_backward
        step = engine.optimizer_step
        engine.optimizer_step = watch.wrap(step)
        actor.update(batch)
        engine.optimizer_step = step
        step_syncs = dict(watch.hits)
        norms = []

        def both_norms_then_step():
            engine.optimizer.prepare_grads()
            norms.append(float(optim_step.global_grad_norm(engine.optimizer)))
            norms.append(float(engine.optimizer.get_grad_norm()))
            return step()

        engine.optimizer_step = both_norms_then_step
        actor.update(batch)
        engine.optimizer_step, engine.forward_backward = step, watched_fb
        # The watch does see syncs: megatron's own THD RoPE, put back for one forward pass.
        watch.hits.clear()
        attention.apply_rotary_pos_emb = rope_utils.apply_rotary_pos_emb
        try:
            actor.compute_log_prob(batch)
        finally:
            attention.apply_rotary_pos_emb = rope.apply_rotary_pos_emb
        megatron_rope = dict(watch.hits)
    finally:
        watch.close()
    return {"ours": ours, "megatron_rope": megatron_rope, "step_syncs": step_syncs, "norms": norms}


def test_packed_forward_backward_has_no_host_sync():
    res = run_on_ranks(_body, 1, timeout=240)[0]
    unexpected = {k: n for k, n in res["ours"].items() if k not in ALLOWED}
    assert not unexpected, f"host syncs inside forward_backward (op, where): count {unexpected}"
    assert any("rope_utils.py" in where for _, where in res["megatron_rope"]), res["megatron_rope"]


def test_optimizer_step_reads_the_grad_norm_once():
    """The engine's optimizer step reads two values back per step (the global grad norm, for the
    finiteness check and the metrics, and the weights' norm after the step, for the divergence
    check); megatron's fallback norm without TE/apex read one per parameter, and the checked
    step computed it twice. The norm is megatron's.

    torch's own Adam step is not counted: on the CPU it keeps `step` in a host tensor it reads
    per parameter (no device involved); on a GPU the engine switches it to the fused Adam,
    which keeps `step` on the device (tests/engine/test_optim_step_gpu.py)."""
    res = run_on_ranks(_body, 1, timeout=240)[0]
    steps = len(res["norms"]) // 2
    engine_syncs = {where: n for (_, where), n in res["step_syncs"].items()
                    if not where.endswith("optimizer.py:step_with_ready_grads")}
    # One read of the grad norm in the step, one of the weights' norm after it (the divergence
    # check, engine._check_param_norm).
    assert engine_syncs == {"verl_mcore/engine/engine.py:_step": steps,
                            "verl_mcore/engine/engine.py:_check_param_norm": steps}, res["step_syncs"]
    for ours, megatron in zip(res["norms"][::2], res["norms"][1::2]):
        assert math.isclose(ours, megatron, rel_tol=1e-6) and ours > 0, res["norms"]
