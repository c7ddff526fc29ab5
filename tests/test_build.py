"""verl_mcore.build: the generation model pads the vocabulary exactly as the training model does,
for every generation TP dividing the training TP, divisor and vocabulary size (issue 17)."""
from types import SimpleNamespace

import pytest

from verl_mcore.config import Config
from verl_mcore.models.hf_config import HFArch, RopeSpec, padded_vocab_size

VOCABS = (36, 250, 32000, 50257, 128256, 151936)  # tiny, test models, Llama 2, GPT-2, Llama 3, Qwen2.5
DIVISORS = (1, 3, 7, 64, 100, 128)
LAYOUTS = [(tp, tp_g) for tp in (1, 2, 4, 8) for tp_g in (1, 2, 4, 8) if tp % tp_g == 0]


class _Built(Exception):
    """Raised by the stand-in GPTModel with the vocabulary size it was asked to build."""


def _arch(vocab: int) -> HFArch:
    return HFArch(model_type="qwen2", num_layers=2, hidden_size=64, ffn_hidden_size=128,
                  num_heads=8, num_kv_heads=8, head_dim=8, vocab_size=vocab, norm_eps=1e-6,
                  rope=RopeSpec(), qkv_bias=True, qk_norm=False, tie_embeddings=False,
                  max_position_embeddings=64)


def _vocab_built_by(call) -> int:
    with pytest.raises(_Built) as e:
        call()
    return e.value.args[0]


def test_generation_model_pads_the_vocabulary_as_the_training_model(monkeypatch):
    """The sizes the real build paths hand megatron's GPTModel: the actor's engine (TP_t) and the
    generation model (TP_g; PP = 2, so it is a model of its own even when TP_g = TP_t)."""
    import megatron.core.models.gpt as megatron_gpt

    from verl_mcore import build

    def gpt_model(*, config, vocab_size, **kwargs):
        raise _Built(vocab_size)

    monkeypatch.setattr(megatron_gpt, "GPTModel", gpt_model)
    monkeypatch.setattr(build, "MegatronEngine",
                        lambda provider, config, *a, **k: provider(config, True, True, None))
    from verl_mcore.distributed.groups import GroupLayout

    wrong, old_rule_differs = [], 0
    for vocab in VOCABS:
        info = build.ModelInfo(_arch(vocab), tokenizer=None, hf_dir=None, checkpoint=None)
        for divisible_by in DIVISORS:
            for tp, tp_g in LAYOUTS:
                cfg = Config.load(None, [f"parallel.tensor_model_parallel_size={tp}",
                                         "parallel.pipeline_model_parallel_size=2",
                                         f"rollout.tensor_parallel_size={tp_g}",
                                         f"model.make_vocab_size_divisible_by={divisible_by}"])
                groups = SimpleNamespace(train=None, gen=None,
                                         layout=GroupLayout(2 * tp, tp, 2, tp_gen=tp_g))
                train = _vocab_built_by(lambda: build.build_engine(cfg, groups, info, "actor", "fp32"))
                gen = _vocab_built_by(lambda: build.build_generation_model(cfg, groups, info, None))
                if not (gen == train == padded_vocab_size(vocab, tp, divisible_by)):
                    wrong.append((vocab, divisible_by, tp, tp_g, train, gen))
                old_rule_differs += padded_vocab_size(vocab, tp_g, divisible_by * tp // tp_g) != train
    assert wrong == [], f"(vocab, divisible_by, TP_t, TP_g, training, generation): {wrong[:10]}"
    assert old_rule_differs > 50  # the grid holds many cases Megatron's divisible × TP rule gets wrong


def test_a_role_tp_that_does_not_divide_the_run_vocabulary_is_refused():
    """The run pads the vocabulary once, for the actor's TP; a role set at another TP shares
    that size, so its TP must divide it (36 ids at TP_t=1, divisor 1: 36 rows; TP=8 cannot)."""
    from verl_mcore import build

    cfg = Config.load(None, ["model.make_vocab_size_divisible_by=1"])
    assert build.role_padded_vocab(cfg, _arch(36), "critic", 2) == 36
    with pytest.raises(ValueError, match=r"critic's TP=8 does not divide the run's padded "
                                         r"vocabulary of 36 rows"):
        build.role_padded_vocab(cfg, _arch(36), "critic", 8)
