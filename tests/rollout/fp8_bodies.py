"""Rank bodies of tests/rollout/test_fp8_rollout.py (module level: spawn pickles them by name)."""
from __future__ import annotations

import torch

from tests.rollout.engine_bodies import MAX_NEW, PROMPTS, generation_model, setup

NEW = 12  # greedy tokens compared between FP8 and full precision


def hf_fp8_greedy(hf_dir: str, prompts, max_new: int):
    """The oracle of the FP8 engine: transformers' greedy generate (fp32, one prompt at a time)
    with every decoder-layer Linear replaced by ops.fp8's reference over its own weight,
    quantized per output row. HF's q/k/v and gate/up are the rows of megatron's fused linear_qkv
    and linear_fc1, and per-row scales do not change when rows are regrouped: the same quantized
    numbers as the engine's, through an independent model implementation."""
    import transformers as T

    from verl_mcore.ops import fp8

    model = T.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()

    class Fp8Linear(torch.nn.Module):
        def __init__(self, linear: torch.nn.Linear):
            super().__init__()
            self.wq, self.ws = fp8.quantize_weight(linear.weight.detach())
            self.bias = linear.bias

        def forward(self, x):
            y = fp8.fp8_linear_reference(x, self.wq, self.ws)
            return y if self.bias is None else y + self.bias

    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                setattr(parent, name, Fp8Linear(getattr(parent, name)))
    tokens, logps = [], []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            new = out.sequences[0, len(p):].tolist()
            tokens.append(new)
            logps.append([torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, new)])
    return tokens, logps


def _greedy(engine, max_new=NEW):
    from verl_mcore.rollout.base import SamplingParams

    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=max_new, logprobs=True))
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


def copy_body(rank, world_size, hf_dir: str):
    """One rank, the training model serving generation (Fp8LinearWeights.copy_of): FP8 greedy
    against full precision and against the HF oracle, the fused decode path, sleep / wake /
    load_weights, and a refresh that follows the training weights."""
    from verl_mcore.rollout import native
    from verl_mcore.rollout.fp8_weights import Fp8LinearWeights
    from verl_mcore.rollout.native import NativeEngine

    groups = setup(1, 1)
    arch, model = generation_model(hf_dir, groups, 1, 1)
    res = {}
    full = NativeEngine(model, vocab_size=arch.vocab_size, max_num_seqs=3)
    res["full"] = _greedy(full)
    store = Fp8LinearWeights.copy_of(model)
    res["linear_dtypes"] = sorted({str(s.module.weight.dtype) for s in store.slots})  # untouched
    res["store_bytes"] = store.nbytes
    res["linear_numel"] = sum(s.weight.numel() for s in store.slots)
    res["linear_rows"] = sum(s.weight.shape[0] for s in store.slots)
    engine = NativeEngine(model, vocab_size=arch.vocab_size, max_num_seqs=3, fp8_weights=store)
    res["fp8"] = _greedy(engine)
    # The fused decode step (on the CPU its ops run their references) through the same store.
    supported = native._CachedGPT.fused_decode_supported
    native._CachedGPT.fused_decode_supported = lambda self: None
    try:  # pooled ranks: restore the class for the next task
        fused = NativeEngine(model, vocab_size=arch.vocab_size, max_num_seqs=3, fp8_weights=store)
        res["fused_engine"] = fused.fused
        res["fp8_fused"] = _greedy(fused)
    finally:
        native._CachedGPT.fused_decode_supported = supported
    engine.sleep()
    res["released"] = store.weights.untyped_storage().size() == 0
    engine.wake()
    engine.load_weights()
    res["fp8_after_wake"] = _greedy(engine)
    # The training weights change (an update): load_weights requantizes the copy from them.
    with torch.no_grad():
        fc2 = model.decoder.layers[0].mlp.linear_fc2.weight
        saved = fc2.clone()
        fc2.mul_(-1.0)
        engine.load_weights()
        res["refresh_follows"] = torch.equal(store.slots[3].weight.float(), -_requant(saved).float())
        fc2.copy_(saved)
    engine.load_weights()
    return res


def _requant(w):
    from verl_mcore.ops import fp8

    return fp8.quantize_weight(w)[0]


def repartition_body(rank, world_size, hf_dir: str, tp_train: int):
    """Training model at TP_t -> repartition -> an FP8 generation model of its own at TP_g = 1
    (Fp8LinearWeights.in_place): its linear weights are e4m3 views, the flat buffer holds only
    the rest, greedy output, the weight-sync check at the FP8 bound, a corrupted weight."""
    from verl_mcore.config import Config
    from verl_mcore.config.schema import logprob_check_bound
    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import transformer_config
    from verl_mcore.models.hf_weights import load_hf_weights
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.fp8_weights import Fp8LinearWeights
    from verl_mcore.rollout.native import NativeEngine
    from verl_mcore.rollout.repartition import Repartitioner
    from verl_mcore.rollout.sync_check import WeightSyncError, check_weight_sync, model_logprobs_fn

    groups = setup(tp_train, 1)
    arch, gen = generation_model(hf_dir, groups, 1, tp_train, load=False)
    bf16_numel = sum(p.numel() for p in gen.parameters())
    train = build_gpt_model(arch, transformer_config(arch, tp=tp_train, dtype="fp32"), role="actor")
    load_hf_weights(train, arch, hf_dir, role="actor")
    store = Fp8LinearWeights.in_place(gen)
    rep = Repartitioner([train], gen, groups, gated_linear_unit=True, fp8=store)
    engine = NativeEngine(gen, vocab_size=arch.vocab_size, repartitioner=rep, max_num_seqs=3,
                          fp8_weights=store)
    stats = rep.run()
    linear_numel = sum(s.weight.numel() for s in store.slots)
    res = {"linear_dtypes": sorted({str(s.module.weight.dtype) for s in store.slots}),
           "buffer_numel": rep.buffer.numel, "expected_buffer_numel": bf16_numel - linear_numel,
           "generation_bytes": stats.generation_bytes,
           "expected_generation_bytes": (bf16_numel - linear_numel) * 4 + store.nbytes,
           "peak_temp_bytes": stats.peak_temp_bytes}
    res["fp8"] = _greedy(engine)
    trainer = model_logprobs_fn(train, arch.vocab_size, groups.train.tp)
    bound = logprob_check_bound(Config.load(None, ["actor.dtype=fp32", "rollout.dtype=fp8"]))
    sp = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=0, logprobs=True)
    res["check"] = check_weight_sync(engine.generate(PROMPTS, sp), PROMPTS, trainer, 1.0, bound)
    engine.sleep()
    res["released"] = (store.weights.untyped_storage().size() == 0
                       and rep.buffer.buffer.untyped_storage().size() == 0)
    engine.wake()
    engine.load_weights()
    res["fp8_after_wake"] = _greedy(engine)
    # A broken sync: one layer's MLP output weight and one's QKV scaled up on the generation side
    # (their scales). This random model's log-probs move little even then (1.96 nats at most,
    # against FP8's 0.06): the difference is measured, and checked at fp32's bound (0.5).
    store.slots[3].scale.mul_(30.0)
    store.slots[4].scale.mul_(30.0)
    res["corrupt_check"] = check_weight_sync(engine.generate(PROMPTS, sp), PROMPTS, trainer, 1.0,
                                             float("inf"))
    try:
        check_weight_sync(engine.generate(PROMPTS, sp), PROMPTS, trainer, 1.0, 0.5)
        res["corrupt"] = None
    except WeightSyncError as e:
        res["corrupt"] = str(e)
    return res
