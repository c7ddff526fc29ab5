"""The native engine's n samples of a prompt are independent draws from the model's distribution.

Thousands of samples of one prompt (temperature 1, a 12-token vocabulary) are counted and compared,
by chi-square tests, with the exact probabilities from full forwards of the same model: the first
token, the second (its marginal, and jointly with the first), pairs of samples of the prompt, and
the top-k / top-p truncated distributions. Each of the six chi-square tests rejects at p < 1e-7,
so a correct engine fails one with probability below 1e-6 over seeds (the seeds here are fixed: a
run is deterministic).
"""
import numpy as np
import pytest
import torch

from tests.multiproc import run_on_ranks
from tests.rollout import engine_bodies as eb

VOCAB = 12
PROMPT = [3, 7, 1, 10]
N = 4000  # samples of the prompt per call
P_MIN = 1e-7
# The random tiny model's logits are ~0.4 apart (nearly uniform); scaling its LM head spreads them
# so that a wrong temperature or truncation moves the counts far.
SHARPEN = 4.0
CUTS = {"top_k": {"top_k": 2}, "top_p": {"top_p": 0.7}}


def _draws_body(rank, world_size, hf_dir: str):
    """Samples of the real engine at temperature 1, and the exact next-token distributions."""
    from verl_mcore.rollout.base import SamplingParams
    from verl_mcore.rollout.native import NativeEngine

    groups = eb.setup(1, 1)
    _, model = eb.generation_model(hf_dir, groups, 1, 1)
    with torch.no_grad():
        model.output_layer.weight.mul_(SHARPEN)
    engine = NativeEngine(model, vocab_size=VOCAB, tp_group=groups.gen_tp, max_num_seqs=N)

    def draws(seed: int, max_new_tokens: int, **cut) -> np.ndarray:
        sp = SamplingParams(n=N, temperature=1.0, max_new_tokens=max_new_tokens, seed=seed, **cut)
        return np.array([o.token_ids for o in engine.generate([PROMPT], sp)])  # [N, max_new]

    res = {"free": draws(1, 2), **{name: draws(2 + i, 1, **cut)[:, 0]
                                   for i, (name, cut) in enumerate(CUTS.items())}}
    model.eval()
    with torch.no_grad():
        def next_token_probs(prefixes: list[list[int]]) -> np.ndarray:
            """p(next | prefix) [b, VOCAB] (float64) for prefixes of one length."""
            tokens = torch.tensor(prefixes)
            logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
            return torch.softmax(logits[:, -1, :VOCAB].double(), dim=-1).numpy()

        res["p_first"] = next_token_probs([PROMPT])[0]
        res["p_second"] = next_token_probs([PROMPT + [t] for t in range(VOCAB)])  # [t1, t2]
    return res


@pytest.fixture(scope="module")
def draws(tmp_path_factory):
    from tests.models.hf_factory import save_tiny_model

    hf_dir = save_tiny_model("qwen2_untied", str(tmp_path_factory.mktemp("stats") / "m"), seed=4,
                             vocab_size=VOCAB)
    [res] = run_on_ranks(_draws_body, 1, args=(hf_dir,), timeout=240)
    return res


def _chi_square_p(counts: np.ndarray, probs: np.ndarray, min_expected: float = 10.0) -> float:
    """p-value of the chi-square goodness-of-fit of counts [k] to probs [k] (summing to 1).

    The cells expected least often are pooled into one, up to the cell that lifts their expected
    count to `min_expected`: the statistic's chi-square law needs no cell expected rarely."""
    n = counts.sum()
    order = np.argsort(probs)
    j = int(np.searchsorted(np.cumsum(n * probs[order]), min_expected)) + 1
    obs = np.append(counts[order[j:]], counts[order[:j]].sum())
    exp = n * np.append(probs[order[j:]], probs[order[:j]].sum())
    stat = ((obs - exp) ** 2 / exp).sum()
    # P(chi2 with df degrees > stat) = Q(df / 2, stat / 2), the regularised upper incomplete gamma
    half_df = torch.tensor((len(exp) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(half_df, torch.tensor(stat / 2, dtype=torch.float64)).item()


def _assert_fits(counts: np.ndarray, probs: np.ndarray, what: str) -> None:
    p = _chi_square_p(counts, probs)
    assert p > P_MIN, (f"{what}: chi-square p = {p:.2e}\ncounts   {counts.tolist()}\n"
                       f"expected {np.round(counts.sum() * probs, 1).tolist()}")


def _counts(tokens: np.ndarray, cells: int) -> np.ndarray:
    return np.bincount(tokens, minlength=cells)


def test_first_token_follows_the_softmax(draws):
    _assert_fits(_counts(draws["free"][:, 0], VOCAB), draws["p_first"], "first token")


def test_second_token_follows_its_marginal_and_the_joint(draws):
    p1, p2 = draws["p_first"], draws["p_second"]
    first, second = draws["free"][:, 0], draws["free"][:, 1]
    # sum over t1 of p(t1 | prompt) p(t2 | prompt, t1)
    _assert_fits(_counts(second, VOCAB), p1 @ p2, "second token's marginal")
    # Jointly: a second draw tied to the first (e.g. the same random number at both steps) shows.
    _assert_fits(_counts(first * VOCAB + second, VOCAB**2), (p1[:, None] * p2).ravel(),
                 "(first, second) tokens")


def test_samples_of_one_prompt_are_independent(draws):
    """Samples 2i and 2i + 1 of the prompt: their first tokens' joint frequencies are the product
    of the model's marginals."""
    p1 = draws["p_first"]
    first = draws["free"][:, 0]
    _assert_fits(_counts(first[0::2] * VOCAB + first[1::2], VOCAB**2), np.outer(p1, p1).ravel(),
                 "first tokens of samples (2i, 2i + 1)")


@pytest.mark.parametrize("name", list(CUTS))
def test_truncated_first_token(draws, name):
    p = draws["p_first"]
    order = np.argsort(-p)
    keep = np.zeros(VOCAB, dtype=bool)
    if name == "top_k":
        keep[order[: CUTS[name]["top_k"]]] = True
    else:
        top_p = CUTS[name]["top_p"]
        before = np.cumsum(p[order]) - p[order]  # mass of the more likely tokens
        assert np.abs(before - top_p).min() > 1e-3  # no token on the edge of float rounding
        keep[order[before < top_p]] = True
    assert 1 < keep.sum() < VOCAB
    counts = _counts(draws[name], VOCAB)
    assert counts[~keep].sum() == 0, (name, counts, keep)
    truncated = p[keep] / p[keep].sum()
    _assert_fits(counts[keep], truncated, f"first token under {name}")
