"""actor.mask_truncated_samples through the real actor update (engine/actor.py: mini-batch
denominators, packed micro-batches balanced over 2 data-parallel gloo ranks): in every
loss_agg_mode the update of a batch whose truncated samples are masked (algo/overlong.actor_batch)
has the loss, metrics and gradients of the update of the batch without them. Two ranks, ~20 s."""
from __future__ import annotations

import pytest

from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _body(rank, world_size):
    from functools import partial
    from types import SimpleNamespace

    import torch

    from tests.distributed.tiny_gpt import load_sharded
    from tests.engine import common as C
    from verl_mcore.algo.overlong import actor_batch
    from verl_mcore.config import Config
    from verl_mcore.engine.actor import Actor
    from verl_mcore.engine.engine import MegatronEngine

    batch = C.make_batch(seed=9, num=8)
    # The two longest responses were cut at the limit (they decide the batch's width, too).
    cut = batch.response_lens.argsort(descending=True)[:2].tolist()
    finish = ["length" if i in cut else "stop" for i in range(8)]
    kept = batch.select([i for i in range(8) if i not in cut])
    # lr 0: the weights stay, so one engine serves every update; no clipping: raw gradients.
    # Gradients all-reduced over DP (no distributed optimizer, whose reduce-scatter leaves each
    # rank's main_grad reduced in its own shard only): every rank holds the batch's gradient.
    optim = C.optim_config(lr=0.0, min_lr=0.0, lr_warmup_steps=0, clip_grad=0.0, weight_decay=0.0)
    full = C.reference_weights("actor", seed=4)
    engine = MegatronEngine(C.provider("actor"), C.transformer_config(), C.init_layout(),
                            dtype="fp32", optim=optim, use_distributed_optimizer=False,
                            load_weights=partial(load_sharded, full=full))
    out = {}
    for mode in MODES:
        cfg = C.actor_config(loss_agg_mode=mode, ppo_epochs=1, optim=optim,
                             mask_truncated_samples=True)
        rollout = SimpleNamespace(train=batch, finish=finish)
        masked, metrics = actor_batch(Config(actor=cfg), rollout)
        runs = {}
        for name, b in (("masked", masked), ("kept", kept)):
            actor = Actor(engine, cfg, mini_batch_size=b.num_samples, temperature=0.9, norm_len=10)
            _, steps = actor.update(b)
            params = engine.model[0].parameters()
            grads = torch.cat([p.main_grad.reshape(-1).clone() for p in params])
            runs[name] = (steps[0], grads)
        out[mode] = (runs, metrics)
    return out


def test_masked_truncated_samples_train_as_if_absent():
    for r in run_on_ranks(_body, 2, timeout=300):
        for mode, (runs, metrics) in r.items():
            assert metrics == {"actor/masked_truncated_fraction": 0.25}
            (masked, g_masked), (kept, g_kept) = runs["masked"], runs["kept"]
            assert g_kept.abs().max() > 0, mode
            rel = ((g_masked - g_kept).abs().max() / g_kept.abs().max()).item()
            assert rel < 1e-5, (mode, rel)
            for key in ("loss", "pg_loss", "kl_loss", "entropy", "ppo_kl", "grad_norm"):
                assert masked[key] == pytest.approx(kept[key], rel=1e-5, abs=1e-7), (mode, key)
