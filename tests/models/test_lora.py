"""LoRA on megatron-core vs peft's LoRA on the transformers model, same adapter values
(fp32, <= 1e-5 relative): TP=1, TP=2, PP=2; q/v only and all-linear. Sequence parallelism is
not covered: megatron's local spec (no TransformerEngine here or on the GPU image) refuses it. Also the sharding rules of models/lora.py."""
from __future__ import annotations

import pytest
import torch

from tests.models import hf_factory
from tests.models.lora_bodies import lora_cfg, lora_logits_body
from tests.multiproc import run_on_ranks
from verl_mcore.convert_hf.verify import prompts
from verl_mcore.models import lora, lora_targets
from verl_mcore.models.hf_config import read_hf_arch

TOL = 1e-5
SEED = 11


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return hf_factory.save_tiny_model("qwen2", str(tmp_path_factory.mktemp("hf") / "qwen2"), seed=3)


@pytest.fixture(scope="module")
def hf_untied(tmp_path_factory):
    """lm_head as a target needs an output layer of its own (tie_word_embeddings=False)."""
    return hf_factory.save_tiny_model("qwen2_untied", str(tmp_path_factory.mktemp("hf") / "untied"),
                                      seed=3)


def peft_logits(hf_dir, targets, tokens, r=4, alpha=8.0):
    """peft's LoRA model on the HF checkpoint, its adapters set to models/lora.py's initial
    values for the same seed (init_lora_weights=False: A and B both random)."""
    import peft
    import transformers

    arch = read_hf_arch(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    names = list(lora.resolve_targets(targets))
    model = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                                                       target_modules=names))
    state = {}
    modules = [(layer, t) for layer in range(arch.num_layers) for t in names if t != lora.HEAD]
    for layer, t in modules + ([(None, lora.HEAD)] if lora.HEAD in names else []):
        a, b = lora.initial_values(arch, r, False, SEED, layer, t)
        state[lora.peft_key(layer, t, "A").replace(".weight", ".default.weight")] = a
        state[lora.peft_key(layer, t, "B").replace(".weight", ".default.weight")] = b
    own = model.state_dict()
    assert set(state) <= set(own), sorted(set(state) - set(own))[:4]
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        return model(input_ids=tokens).logits


def _rel(ours, ref):
    return ((ours - ref).abs().max() / ref.abs().max()).item()


CASES = [  # (tp, pp, sequence_parallel, targets)
    (1, 1, False, ["q_proj", "v_proj"]),
    (1, 1, False, "all-linear"),
    (2, 1, False, "all-linear"),
    (2, 1, False, ["q_proj", "v_proj"]),
    (2, 1, False, ["k_proj", "o_proj", "gate_proj"]),  # parts of both fused layers, a row layer
    (1, 2, False, "all-linear"),
    (1, 2, False, ["q_proj", "v_proj"]),
    # the output layer (an untied model): B over the padded vocabulary, split over TP
    (1, 1, False, ["all-linear", "lm_head"]),
    (2, 1, False, ["v_proj", "lm_head"]),
    (1, 2, False, ["all-linear", "lm_head"]),
]


@pytest.mark.parametrize("tp,pp,sp,targets", CASES)
def test_logits_equal_peft(request, tp, pp, sp, targets):
    hf_dir = request.getfixturevalue("hf_untied" if "lm_head" in targets else "hf_dir")
    tokens = prompts(hf_factory.COMMON["vocab_size"], batch=2, seq_len=12)
    ref = peft_logits(hf_dir, targets, tokens)
    results = run_on_ranks(lora_logits_body, tp * pp,
                           args=(hf_dir, tp, pp, targets, tokens, SEED, sp), timeout=240)
    out = [r for r in results if r["lora"] is not None]
    assert len(out) == 1
    vocab = ref.shape[-1]
    ours = out[0]["lora"][..., :vocab]
    assert _rel(ours, ref) <= TOL
    # the adapters change the logits; off, the model is the base model
    import transformers
    base_ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(
        input_ids=tokens).logits.detach()
    assert _rel(out[0]["base"][..., :vocab], base_ref) <= 1e-4
    assert _rel(ref, base_ref) > 1e-3
    # only adapters train
    for r in results:
        assert r["trainable"] and all(".lora_" in n for n in r["trainable"])


def test_targets_resolve_and_bad_names_are_named():
    assert lora.resolve_targets("all-linear") == lora_targets.LAYER_TARGETS
    assert "lm_head" not in lora_targets.LAYER_TARGETS  # as peft's all-linear: the output layer is apart
    assert lora.resolve_targets(["lm_head", "all-linear"]) == lora_targets.LAYER_TARGETS + ("lm_head",)
    assert lora.resolve_targets(["v_proj", "q_proj"]) == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match="qproj.*q_proj"):
        lora.resolve_targets(["qproj"])
    with pytest.raises(ValueError, match="all-linear"):
        lora.resolve_targets(["all-linear", "q_proj"])


def test_initial_values_are_peft_style_and_layout_independent(hf_dir):
    arch = read_hf_arch(hf_dir)
    a, b = lora.initial_values(arch, 4, True, SEED, 0, "q_proj")
    assert b.abs().sum() == 0 and a.abs().max() <= 1 / arch.hidden_size ** 0.5 + 1e-6
    a2, _ = lora.initial_values(arch, 4, True, SEED, 0, "q_proj")
    assert torch.equal(a, a2)
    a3, _ = lora.initial_values(arch, 4, True, SEED, 1, "q_proj")
    assert not torch.equal(a, a3)
    assert lora.tp_shard_dim("q_proj", "B") == 0 and lora.tp_shard_dim("q_proj", "A") is None
    assert lora.tp_shard_dim("o_proj", "A") == 1 and lora.tp_shard_dim("down_proj", "B") is None


@pytest.mark.parametrize("variant", [{"use_rslora": True}, {"use_dora": True},
                                     {"alpha_pattern": {"q_proj": 32}}])
def test_peft_variants_with_other_math_are_refused(tmp_path, variant):
    """rsLoRA scales by alpha / sqrt(r), DoRA adds a magnitude vector, a pattern sets other
    r / alpha per module: read as plain LoRA they would give another model silently."""
    import json

    from safetensors.torch import save_file

    cfg = lora.peft_config(lora_cfg("all-linear"), "base")
    with open(tmp_path / "adapter_config.json", "w") as f:
        json.dump({**cfg, **variant}, f)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=sorted(variant)[0]):
        lora.load_peft_dir([], str(tmp_path), lora_cfg("all-linear"))


def test_frozen_linear_input_grad_is_folded_and_unchanged():
    """models/lora.fold_frozen_dgrad: megatron's frozen-weight linear gets the gradient of a
    transposed [b, s, V] output (not foldable by torch.matmul: on CUDA a batched GEMM of one row
    per token); the folded backward gives the same input gradient, in the input's shape."""
    from megatron.core.tensor_parallel import layers

    torch.manual_seed(0)
    x = torch.randn(7, 1, 5, requires_grad=True)
    w = torch.randn(11, 5)
    grad = torch.randn(1, 7, 11).transpose(0, 1)  # strides (11, 77, 1): as the output layer's
    want = torch.einsum("sbo,oi->sbi", grad, w)
    lora.fold_frozen_dgrad()
    assert layers.LinearWithFrozenWeight._verl_mcore_folded
    out = layers.LinearWithFrozenWeight.apply(x, w, None, False, None)
    out.backward(grad)
    assert x.grad.shape == x.shape and torch.allclose(x.grad, want, atol=1e-6)
