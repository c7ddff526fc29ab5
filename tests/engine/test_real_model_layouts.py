"""One actor update of the real model (SmolLM2-135M-Instruct, fp32) at TP = 3 x PP = 2 on 6 gloo
ranks equals the 1-rank update: loss, grad norm, log-probs before and after, and the updated
weights (every HF tensor, gathered as Policy.save_pretrained gathers them); and the same for a
LoRA update (loss, grad norm, every adapter tensor, the base untouched).

Why TP 3 x PP 2: the model has 9 query heads over 3 KV heads, so TP 2 cannot shard it (megatron
refuses); 3 is the TP above 1 that divides both, and PP 2 splits its 30 layers 15 / 15. One layout
of 6 ranks covers TP (vocabulary-parallel head with the tied embedding across stages, sharded
GQA) and PP (the tied embedding's gradient reduced between the first and last stage) together.

The batch: 4 chat prompts with written answers; old log-probs 0.05 below the current ones
(ratio e^0.05, inside the clip) and an entropy bonus, so the loss depends on the model, not only
on the advantages. Adam's eps is 1e-4, far above the layouts' rounding of the gradients (see
tests/engine/test_lora_training.py: with a tiny eps an element whose gradient is ~0 moves by up
to lr on a rounding difference); lr 1e-3 makes the update large against the fp32 ulp of the
weights."""
from __future__ import annotations

import pytest
import torch

from tests.models.lora_bodies import assemble_adapters
from tests.multiproc import run_on_ranks

pytestmark = pytest.mark.distributed

ANSWERS = ["The capital of France is Paris.", "Red, blue and yellow.",
           "A spider has eight legs.", "William Shakespeare wrote Romeo and Juliet."]
REL = 1e-4  # loss, grad norm
LOGP_REL = 5e-5  # log-probs, over max(1, |log-prob|)
# Updated weights (full, and LoRA's B): max |difference| over the oracle's max |update|. Measured
# when this was written: 5.2e-4 (full) and 6.9e-4 (LoRA, layer 0's v_proj B): Adam's first step
# lr·g/(|g| + eps) passes on the relative rounding of an element's gradient where |g| is near
# eps, and 30 fp32 layers summed in other orders leave ~1e-3 on the smallest gradients (the grad
# norms agree to 2.5e-5 and 2e-6). A sharding error moves whole tensors by O(update).
WEIGHT_REL = 1e-3


def _batch(hf_dir):
    from transformers import AutoTokenizer

    from tests.e2e import real_model_bodies as rb

    tok = AutoTokenizer.from_pretrained(hf_dir)
    prompts = rb.chat_ids(tok, rb.PROMPTS[:1] + rb.PROMPTS[4:5] + rb.PROMPTS[15:16]
                          + rb.PROMPTS[8:9])
    responses = [tok(a, add_special_tokens=False)["input_ids"] + [rb.EOS] for a in ANSWERS]
    return prompts, responses


def _overrides(hf_dir, tp, pp, lora):
    out = [f"model.path={hf_dir}", "trainer.device=cpu", f"parallel.tensor_model_parallel_size={tp}",
           f"parallel.pipeline_model_parallel_size={pp}", f"rollout.tensor_parallel_size={tp}",
           "actor.dtype=fp32", "actor.ppo_mini_batch_size=4", "rollout.n=1", "data.train_batch_size=4",
           "actor.micro_batch_size_per_gpu=2", "actor.max_tokens_per_microbatch=256",
           "actor.entropy_coeff=0.01", "actor.use_kl_loss=false", "actor.optim.lr=1e-3",
           "actor.optim.adam_eps=1e-4", "actor.optim.weight_decay=0.0"]
    if lora:
        out += ["actor.lora.enable=true", "actor.lora.r=4", "actor.lora.alpha=8"]
    return out


def _body(rank, world_size, hf_dir, prompts, responses, tp, pp, lora):
    from tests.models.lora_bodies import adapter_shards
    from verl_mcore import build
    from verl_mcore.config import Config
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.distributed.groups import build_groups
    from verl_mcore.engine.batch import TrainBatch
    from verl_mcore.rollout.vllm_engine import hf_weight_stream

    cpu_compat.install()
    cfg = Config.load(None, _overrides(hf_dir, tp, pp, lora))
    groups = build_groups(cfg)
    info = build.load_model_info(cfg)
    with build.role_seed(cfg.trainer.seed, "actor"):
        actor = build.build_actor(cfg, groups, info)
    batch = TrainBatch.from_sequences(prompts, responses, info.pad_token_id)
    mask = batch.response_mask
    logp, _ = actor.compute_log_prob(batch)
    batch.old_log_probs = (logp - 0.05) * mask
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * mask
    frozen = {n: p.detach().clone() for m in actor.engine.model for n, p in m.named_parameters()
              if not p.requires_grad}
    _, steps = actor.update(batch)
    after, _ = actor.compute_log_prob(batch)
    out = {"steps": [(s["loss"], s["grad_norm"]) for s in steps], "logp": logp, "after": after,
           "dp_rank": groups.train.dp.rank()}
    if lora:
        out["base_unchanged"] = all(torch.equal(p, frozen[n]) for m in actor.engine.model
                                    for n, p in m.named_parameters() if n in frozen)
        out["adapters"] = adapter_shards(actor.engine.model)
        return out
    # Every updated weight in HF names, as Policy.save_pretrained gathers it: repartitioned to
    # the generation layout (PP stages all-gathered), then each tensor gathered over TP_g.
    model, repartitioner = build.build_generation_model(cfg, groups, info, actor)
    if repartitioner is not None:
        repartitioner.run()
    weights = {}
    if groups.gen_dp_rank == 0:
        for bucket in hf_weight_stream(model, info.arch, groups.gen_tp):
            weights.update(bucket)
    out["weights"] = weights if rank == 0 else None
    return out


@pytest.fixture(scope="module")
def batch(smollm2):
    return _batch(smollm2)


def _run(smollm2, batch, world, tp, pp, lora):
    return run_on_ranks(_body, world, args=(smollm2, *batch, tp, pp, lora), timeout=600)


def _check_steps_and_logp(results, oracle):
    (want_loss, want_gn), = oracle["steps"]
    for rank, res in enumerate(results):
        (loss, gn), = res["steps"]
        print(f"real-model rank {rank}: loss {loss:.6e} vs {want_loss:.6e}, "
              f"grad norm {gn:.6e} vs {want_gn:.6e}")
        assert abs(loss - want_loss) <= REL * abs(want_loss), (rank, loss, want_loss)
        assert abs(gn - want_gn) <= REL * want_gn, (rank, gn, want_gn)
        for key in ("logp", "after"):
            # Relative to the log-prob's size: a token at log-prob -30 carries 30x the rounding
            # of one near 0 (the after-step model's unlikely tokens reached 1.3e-4 absolute).
            err = ((res[key] - oracle[key]).abs() / oracle[key].abs().clamp(min=1.0)).max().item()
            print(f"real-model rank {rank} {key}: max relative log-prob difference {err:.2e}")
            assert err <= LOGP_REL, f"rank {rank} {key}: max relative difference {err:.2e}"
    # The update changed the policy (so the comparison after it is not of the same model).
    assert (oracle["after"] - oracle["logp"]).abs().max() > 1e-2


def test_full_update_tp3_pp2_matches_one_rank(smollm2, batch, tmp_path):
    [oracle] = _run(smollm2, batch, 1, 1, 1, lora=False)
    results = _run(smollm2, batch, 6, 3, 2, lora=False)
    _check_steps_and_logp(results, oracle)
    from safetensors.torch import load_file

    base = load_file(f"{smollm2}/model.safetensors")
    want, got = oracle["weights"], results[0]["weights"]
    assert sorted(want) == sorted(got) == sorted(base)
    update = max((want[k] - base[k].float()).abs().max().item() for k in want)
    err = max((got[k] - want[k]).abs().max().item() for k in want)
    print(f"real-model TP3xPP2 update: max |update| {update:.2e}, max |difference| {err:.2e}")
    assert update > 1e-4 and err <= WEIGHT_REL * update, (err, update)


def test_lora_update_tp3_pp2_matches_one_rank(smollm2, batch):
    oracle_results = _run(smollm2, batch, 1, 1, 1, lora=True)
    results = _run(smollm2, batch, 6, 3, 2, lora=True)
    _check_steps_and_logp(results, oracle_results[0])
    assert all(res["base_unchanged"] for res in oracle_results + results)
    want, got = (assemble_adapters(oracle_results, "adapters"),
                 assemble_adapters(results, "adapters"))
    assert got.keys() == want.keys() and len(want) == 30 * 7 * 2
    # A: no gradient while B is 0 (peft's init), so no update: the layouts' initial A exactly.
    a_keys = [k for k in want if ".lora_A." in k]
    assert len(a_keys) == len(want) // 2 and all(torch.equal(got[k], want[k]) for k in a_keys)
    # B (0 before the step) is the update: compared as the full update is, against its largest
    # element over the model (a tensor's own largest can be a small gradient's, all rounding).
    update = max(want[k].abs().max().item() for k in want if k not in a_keys)
    errs = sorted(((got[k] - want[k]).abs().max().item(), k) for k in want if k not in a_keys)
    print(f"real-model LoRA update: max |B| {update:.2e}, max |difference| {errs[-1][0]:.2e} "
          f"({errs[-1][1]})")
    assert errs[-1][0] <= WEIGHT_REL * update, errs[-3:]
