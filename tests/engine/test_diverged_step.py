"""engine.optimizer_step refuses a step that blows up the weights (DivergedStepError) and reports
the weights' norm; a normal step passes."""
import pytest

from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed


def _body(rank, world_size):
    import torch

    from tests.engine import common as C
    from verl_mcore.engine.actor import Actor
    from verl_mcore.engine.engine import DivergedStepError

    torch.manual_seed(0)
    full = C.reference_weights("actor", seed=4)
    out = {}
    for name, lr in (("normal", 1e-3), ("huge", 1e30)):
        cfg = C.actor_config(ppo_epochs=1, optim=C.optim_config(lr=lr, lr_warmup_steps=0))
        actor = Actor(C.make_engine("actor", full, optim=cfg.optim), cfg, mini_batch_size=8, temperature=0.9)
        try:
            summary, _ = actor.update(C.make_batch(seed=9, num=8))
            out[name] = ("ok", summary["actor/param_norm"], actor.engine.param_norm)
        except DivergedStepError as e:
            out[name] = ("diverged", str(e), actor.engine.param_norm)
    return out


def test_a_step_that_blows_up_the_weights_is_refused():
    r = run_on_ranks(_body, 1, timeout=240)[0]
    kind, norm, engine_norm = r["normal"]
    assert kind == "ok" and norm == engine_norm and 0 < norm < float("inf")
    kind, message, engine_norm = r["huge"]
    assert kind == "diverged", message
    # 1e30-sized fp32 weights: the norm overflows, or at smaller lr grows by orders of magnitude.
    assert ("made the weights non-finite" in message or "changed the norm of the weights" in message)
    assert "lr 1e+30" in message and "Lower the learning rate" in message
    assert engine_norm > 1e20  # the step was taken: the run must stop, not save
