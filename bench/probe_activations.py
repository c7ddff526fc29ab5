"""What one actor update keeps for backward, per decoder layer and token, on this device: the
measurement behind verl_mcore.plan's activation term.

    python bench/probe_activations.py --shape 1.5b --tokens 16384 [--lora 16]

One packed micro-batch of `--tokens` tokens through the Actor's update (bench/bench_actor.py's
model and engine). autograd's saved-tensor hooks see every tensor kept for backward; each is
charged to the decoder layer running when it was saved (or to "head" after the last layer: the
final norm, the output layer, the log-prob op), once per storage (views of one storage count
once), parameters excluded. Printed: bytes per token for each layer (their median) and for the
head, next to the planner's activation_bytes_per_token_layer (+ the LoRA term) and its logits
term, and the update's peak allocated memory over the static part (parameters, gradients,
optimizer state) against the planner's activations + logits for that micro-batch.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="1.5b")
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the one micro-batch")
    p.add_argument("--seq", type=int, default=1024, help="length of each packed sequence")
    p.add_argument("--lora", type=int, default=0, metavar="R")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    from bench.bench_actor import SHAPES, _arch, _init_single_rank
    from verl_mcore.config.schema import ActorConfig, LoRAConfig, OptimConfig
    from verl_mcore.distributed import cpu_compat
    from verl_mcore.engine.actor import Actor
    from verl_mcore.engine.engine import MegatronEngine
    from verl_mcore.models.gpt import build_gpt_model
    from verl_mcore.models.hf_config import transformer_config
    from verl_mcore.planning import memory as planner

    _init_single_rank()
    cpu_compat.install()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    arch = _arch(args.shape, args.seq)
    config = transformer_config(arch, tp=1, pp=1, dtype="bf16")
    lora = LoRAConfig(enable=True, r=args.lora, alpha=2.0 * args.lora) if args.lora else None

    def provider(cfg, pre_process, post_process, vp_stage):
        return build_gpt_model(arch, cfg, role="actor", pre_process=pre_process,
                               post_process=post_process, vp_stage=vp_stage)

    def load(module):
        from verl_mcore.models.lora import attach_lora

        attach_lora(module, lora, arch, seed=0)

    actor_cfg = ActorConfig(dtype="bf16", max_tokens_per_microbatch=args.tokens, ppo_epochs=1,
                            entropy_coeff=0.001, use_kl_loss=True,
                            optim=OptimConfig(lr=1e-6, weight_decay=0.01, clip_grad=1.0))
    engine = MegatronEngine(provider, config, pg, dtype="bf16", optim=actor_cfg.optim,
                            lr_decay_steps=4, load_weights=load if lora else None)
    n = args.tokens // args.seq
    actor = Actor(engine, actor_cfg, mini_batch_size=n)
    batch = _batch(n, args.seq, arch.vocab_size)
    actor.update(batch)  # warm-up: optimizer state and buffers exist from here on

    params = {q.untyped_storage().data_ptr() for m in engine.model for q in m.parameters()}
    layers = [m for m in engine.model[0].modules() if type(m).__name__ == "TransformerLayer"]
    where = {"now": "before"}
    seen: dict[str, dict[int, int]] = {}
    listed: dict[str, list] = {"layer0": [], "head": []}  # what one layer and the head keep

    def enter(i):
        return lambda *_: where.__setitem__("now", f"layer{i}")

    def leave(i):
        return lambda *_: where.__setitem__("now", "head" if i == len(layers) - 1 else where["now"])

    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(enter(i)))
        hooks.append(layer.register_forward_hook(leave(i)))

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and (t.device.type != "cpu" or not cuda):
            here = seen.setdefault(where["now"], {})
            if st.data_ptr() not in here and where["now"] in listed:
                listed[where["now"]].append(f"{tuple(t.shape)} {str(t.dtype)[6:]} {st.nbytes()}")
            here[st.data_ptr()] = st.nbytes()
        return t

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    static = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        actor.update(_batch(n, args.seq, arch.vocab_size, seed=1))
    sync()
    peak = torch.cuda.max_memory_allocated() - static if cuda else 0
    for h in hooks:
        h.remove()

    tokens = n * args.seq
    per_layer = [sum(seen.get(f"layer{i}", {}).values()) / tokens for i in range(len(layers))]
    head = sum(seen.get("head", {}).values()) / tokens
    dims = planner.ModelDims(**_dims(SHAPES[args.shape]))
    planned = planner.activation_bytes_per_token_layer(dims, 1, False)
    if lora:
        planned += planner.lora_activation_bytes_per_token_layer(dims, lora, 1, False)
    vocab = planner.padded_vocab(dims, 1, 128)
    result = {
        "shape": args.shape, "tokens": tokens, "lora_r": args.lora,
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "saved_bytes_per_token_layer": statistics.median(per_layer),
        "planned_bytes_per_token_layer": planned,
        "saved_head_bytes_per_token": head, "planned_logits_bytes_per_token": 4 * vocab,
        "peak_over_static_gib": peak / 2**30,
        "planned_activations_plus_logits_gib":
            (planned * dims.num_layers + 4 * vocab) * tokens / 2**30,
        "measured_activations_plus_head_gib":
            (sum(per_layer) + head) * tokens / 2**30,
        "layer0_saved": listed["layer0"], "head_saved": listed["head"],
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _dims(s: dict) -> dict:
    return dict(num_layers=s["num_layers"], hidden_size=s["hidden_size"],
                ffn_hidden_size=s["ffn_hidden_size"], num_attention_heads=s["num_heads"],
                num_key_value_heads=s["num_kv_heads"], head_dim=s["head_dim"],
                vocab_size=s["vocab_size"], tie_word_embeddings=s["tie_embeddings"])


def _batch(n: int, seq: int, vocab: int, seed: int = 0):
    """n sequences of exactly `seq` tokens (a quarter prompt): one full micro-batch."""
    from verl_mcore.engine.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    prompt, resp = seq // 4, seq - seq // 4
    noise = lambda: torch.randn(n, resp, generator=g) * 0.1  # noqa: E731
    return TrainBatch(
        input_ids=torch.randint(0, vocab, (n, seq), generator=g), prompt_lens=torch.full((n,), prompt),
        seq_lens=torch.full((n,), seq), response_mask=torch.ones(n, resp),
        old_log_probs=-12.0 + noise(), ref_log_probs=-12.0 + noise(), advantages=noise() * 10)


if __name__ == "__main__":
    main()
