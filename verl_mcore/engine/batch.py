"""The batch the trainer hands to the engine's roles (actor, reference, critic).

`TrainBatch` holds B samples; each sample is one prompt followed by one sampled response:

    input_ids      [B, S] int64   prompt + response tokens, left-aligned (sample i occupies
                                  input_ids[i, :seq_lens[i]]), anything after is ignored
    prompt_lens    [B]    int64   tokens of the prompt, >= 1
    seq_lens       [B]    int64   prompt + response tokens, prompt_lens < seq_lens <= S
    response_mask  [B, R] float   1 at response tokens that count in losses and metrics, 0 at the
                                  rest (tool-output holes, tokens past the response's end)

Response-aligned per-token tensors use the same [B, R] layout: column j of row i is response token
j of sample i, which sits at input_ids[i, prompt_lens[i] + j] and is predicted by the logits at
position prompt_lens[i] + j - 1. R is at least max(seq_lens - prompt_lens); columns past a sample's
response are padding (mask 0). Optional fields, needed by the role that reads them:

    old_log_probs  [B, R] float   log-probs of the policy that sampled (actor update)
    ref_log_probs  [B, R] float   reference log-probs (actor update with actor.use_kl_loss)
    advantages     [B, R] float   (actor update)
    returns        [B, R] float   value targets (critic update)
    values         [B, R] float   critic values at rollout time, the clip centre (critic update)
    token_rewards  [B, R] float   the step's token rewards (a one-step critic update that computes
                                  the values and returns itself: engine/critic.py)
    is_weights     [B, R] float   importance weights of each token's policy loss (rollout.tis_cap:
                                  algo/policy_loss.truncated_is_weights; rollout.correction.
                                  decoupled: algo/off_policy.decoupled_weights)
    routed_experts [B, R, layers, k] int32   the experts the rollout engine routed the forward
                                  predicting response token j to, per MoE layer (the logits'
                                  position prompt_lens[i] + j - 1; the global layer index on
                                  dim 2); -1: the router's own choice (dense layers, tokens the
                                  engine did not produce, padding). Routing replay forces them
                                  in the actor's and reference's forward passes
                                  (actor.router_replay, models/router_replay.py)

The engine receives the GLOBAL batch, the same on every rank of the data-parallel (DP) group, and
returns global results ([B, R], original sample order) on every rank; it decides itself which DP
rank computes which samples (balanced by tokens, see `packing`).

Where the tensors live (one rule for a whole step). The rollout batch is built on the host from
the engine's outputs and moves to the training device ONCE, when scoring begins
(`Trainer.step`: `rollout.to(device)`, and the scores are put there too). From then on every
tensor a phase produces (log-probs, values, rewards, advantages) and every tensor handed to
`verl_mcore.algo` or to reward placement is on that one device; the `algo` functions check it at
their entry and name the tensors when they differ (`utils.checks.same_device`). The engine's
roles accept a batch on either side: `MegatronEngine.micro_batches` lays micro-batches out on
the host (one copy per call) and moves each to the device when it runs it.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

# Response-aligned optional fields, in the order they are documented above.
RESPONSE_FIELDS = ("old_log_probs", "ref_log_probs", "advantages", "returns", "values", "token_rewards",
                   "is_weights")


@dataclass
class TrainBatch:
    input_ids: Tensor
    prompt_lens: Tensor
    seq_lens: Tensor
    response_mask: Tensor
    old_log_probs: Optional[Tensor] = None
    ref_log_probs: Optional[Tensor] = None
    advantages: Optional[Tensor] = None
    returns: Optional[Tensor] = None
    values: Optional[Tensor] = None
    token_rewards: Optional[Tensor] = None
    is_weights: Optional[Tensor] = None
    routed_experts: Optional[Tensor] = None

    def __post_init__(self):
        self.validate()

    @property
    def num_samples(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_width(self) -> int:
        """R, the width of the response-aligned tensors."""
        return self.response_mask.shape[1]

    @property
    def response_lens(self) -> Tensor:
        return self.seq_lens - self.prompt_lens

    def validate(self) -> None:
        """Shape and range checks; errors name the field and the first offending row."""
        if self.input_ids.dim() != 2:
            raise ValueError(f"TrainBatch.input_ids must be [B, S], got {tuple(self.input_ids.shape)}")
        b, s = self.input_ids.shape
        for name in ("prompt_lens", "seq_lens"):
            t = getattr(self, name)
            if t.shape != (b,):
                raise ValueError(f"TrainBatch.{name} must be [B]=[{b}], got {tuple(t.shape)}")
        if self.response_mask.dim() != 2 or self.response_mask.shape[0] != b:
            raise ValueError(f"TrainBatch.response_mask must be [B, R] with B={b}, got {tuple(self.response_mask.shape)}")
        r = self.response_mask.shape[1]
        bad = (self.prompt_lens < 1) | (self.seq_lens <= self.prompt_lens) | (self.seq_lens > s)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"TrainBatch row {i}: need 1 <= prompt_lens < seq_lens <= S={s}, got prompt_lens="
                f"{int(self.prompt_lens[i])}, seq_lens={int(self.seq_lens[i])}"
            )
        too_long = self.response_lens > r
        if bool(too_long.any()):
            i = int(too_long.nonzero()[0])
            raise ValueError(
                f"TrainBatch row {i}: response of {int(self.response_lens[i])} tokens does not fit the "
                f"response-aligned width R={r}"
            )
        for name in RESPONSE_FIELDS:
            t = getattr(self, name)
            if t is not None and t.shape != (b, r):
                raise ValueError(f"TrainBatch.{name} must be [B, R]=[{b}, {r}], got {tuple(t.shape)}")
        t = self.routed_experts
        if t is not None and (t.dim() != 4 or t.shape[:2] != (b, r)):
            raise ValueError(f"TrainBatch.routed_experts must be [B, R, layers, k] with "
                             f"[B, R]=[{b}, {r}], got {tuple(t.shape)}")

    @classmethod
    def from_sequences(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                       pad_token_id: int) -> "TrainBatch":
        """Samples given as token-id lists. A sample with an empty response gets one `pad_token_id`
        response token (the layout needs one) that is masked out of every loss and metric."""
        prompt_ids, prompt_lens = flatten_token_ids(prompts)
        response_ids, response_lens = flatten_token_ids(responses)
        return cls.from_flat(prompt_ids, prompt_lens, response_ids, response_lens, pad_token_id)

    @classmethod
    def from_flat(cls, prompt_ids: Tensor, prompt_lens: Tensor, response_ids: Tensor,
                  response_lens: Tensor, pad_token_id: int,
                  prompt_of: Optional[Tensor] = None,
                  loss_mask: Optional[Tensor] = None) -> "TrainBatch":
        """Samples given as flat token buffers (what the rollout gather receives), laid out with
        tensor ops only, no Python loop over samples or tokens:

            prompt_ids     [sum(prompt_lens)]    int     the P prompts' tokens, one after another
            prompt_lens    [P]                   int64
            response_ids   [sum(response_lens)]  int     the B responses' tokens, one after another
            response_lens  [B]                   int64
            prompt_of      [B]                   int64   the prompt of each sample (None: sample i
                                                         has prompt i, P = B); samples of one
                                                         prompt share its tokens, sent once
            loss_mask      [sum(response_lens)]  0/1     which response tokens count (0: tokens
                                                         the model did not write, tool output);
                                                         None: all of them

        response_mask is the loss mask inside each response and 0 past its end, so a response
        with a hole has 0s inside. As `from_sequences`: an empty response gets one masked
        `pad_token_id` token."""
        b = response_lens.numel()
        if b == 0:
            raise ValueError("TrainBatch.from_flat: no samples (a batch needs at least one)")
        prompt_of = torch.arange(b) if prompt_of is None else prompt_of.long()
        _check_flat("prompt", prompt_ids, prompt_lens)
        _check_flat("response", response_ids, response_lens)
        p = len(prompt_lens)
        if prompt_of.shape != (b,) or not 0 <= int(prompt_of.min()) <= int(prompt_of.max()) < p:
            raise ValueError(f"TrainBatch.from_flat: prompt_of must be [B]=[{b}] indices into the "
                             f"{p} prompts, got shape {tuple(prompt_of.shape)}")
        sample_prompt_lens = prompt_lens.long()[prompt_of]  # [B]
        filled = response_lens.long().clamp(min=1)  # [B] an empty response keeps one pad token
        seq_lens = sample_prompt_lens + filled
        # Each prompt once, left-aligned [P, max prompt len]; then one row per sample.
        prompts = _left_aligned(prompt_ids, prompt_lens.long(), pad_token_id)
        input_ids = torch.full((b, int(seq_lens.max())), pad_token_id, dtype=torch.int64)
        input_ids[:, :prompts.shape[1]] = prompts[prompt_of]
        # masked_scatter_ fills the True positions in row-major order: sample by sample, token
        # by token, the order of the flat buffer. A [B, S] bool mask, not [T] index tensors.
        cols = torch.arange(input_ids.shape[1])
        starts = sample_prompt_lens[:, None]
        in_response = (cols >= starts) & (cols < starts + response_lens.long()[:, None])
        input_ids.masked_scatter_(in_response, response_ids.long())
        if loss_mask is None:
            loss_mask = torch.ones(response_ids.numel())
        elif loss_mask.shape != response_ids.shape or bool((loss_mask.float() > 1).any()
                                                          | (loss_mask.float() < 0).any()):
            raise ValueError(f"TrainBatch.from_flat: loss_mask must be 0/1, one per response "
                             f"token ({response_ids.numel()}), got shape {tuple(loss_mask.shape)}")
        response_mask = response_aligned(loss_mask.float(), response_lens, int(filled.max()))
        return cls(input_ids=input_ids, prompt_lens=sample_prompt_lens, seq_lens=seq_lens,
                   response_mask=response_mask)

    def select(self, rows: Sequence[int] | Tensor) -> "TrainBatch":
        """The samples at `rows` (in that order), e.g. one mini-batch."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        out = {}
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            out[f.name] = None if t is None else t[idx.to(t.device)]
        return TrainBatch(**out)

    @classmethod
    def concat(cls, batches: Sequence["TrainBatch"], pad_token_id: int) -> "TrainBatch":
        """The samples of `batches`, one batch after another (an experience buffer's batches,
        verl_mcore/api). input_ids are padded with `pad_token_id` to the widest S and the
        response-aligned tensors with 0 (mask 0) to the widest R: the same batch `from_flat`
        lays out from all the samples at once. An optional field must be set in every batch or
        in none."""
        if not batches:
            raise ValueError("TrainBatch.concat: no batches")
        s = max(b.input_ids.shape[1] for b in batches)
        r = max(b.response_width for b in batches)

        def widened(t: Tensor, width: int, fill) -> Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)

        out = {"input_ids": torch.cat([widened(b.input_ids, s, pad_token_id) for b in batches]),
               "prompt_lens": torch.cat([b.prompt_lens for b in batches]),
               "seq_lens": torch.cat([b.seq_lens for b in batches])}
        for name in ("response_mask",) + RESPONSE_FIELDS:
            have = [getattr(b, name) is not None for b in batches]
            if any(have) and not all(have):
                raise ValueError(f"TrainBatch.concat: {name} is set in batches "
                                 f"{[i for i, h in enumerate(have) if h]} but not in the others")
            if all(have):
                out[name] = torch.cat([widened(getattr(b, name), r, 0) for b in batches])
        have = [b.routed_experts is not None for b in batches]
        if any(have) and not all(have):
            raise ValueError(f"TrainBatch.concat: routed_experts is set in batches "
                             f"{[i for i, h in enumerate(have) if h]} but not in the others")
        if all(have):  # padding routes as the router chooses (-1)
            out["routed_experts"] = torch.cat([
                torch.nn.functional.pad(b.routed_experts, (0, 0, 0, 0, 0, r - b.response_width),
                                        value=-1) for b in batches])
        return cls(**out)

    def to(self, device: torch.device | str) -> "TrainBatch":
        """The batch with every tensor on `device` (the same object when all already are)."""
        device = torch.device(device)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if all(t is None or _on(t, device) for t in fields.values()):
            return self
        return TrainBatch(**{k: None if t is None else t.to(device) for k, t in fields.items()})

    def cpu(self) -> "TrainBatch":
        """The batch with every tensor on the host (the same object when all already are)."""
        return self.to("cpu")

    def require(self, *names: str, role: str) -> None:
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"{role}: TrainBatch is missing {missing} (see verl_mcore/engine/batch.py)")

    def response_field_mask(self) -> Tensor:
        """[B, R] bool: columns inside each sample's response (whether or not they count)."""
        cols = torch.arange(self.response_width, device=self.response_mask.device)
        return cols[None, :] < self.response_lens.to(cols.device)[:, None]


def response_aligned(flat: Tensor, response_lens: Tensor, width: int, fill=0) -> Tensor:
    """[B, width, *] of flat's dtype: row i holds the response_lens[i] values of sample i (flat
    [sum(response_lens), *] per-token values, sample after sample) left-aligned, then `fill`."""
    lens = response_lens.long()
    inside = torch.arange(width)[None, :] < lens[:, None]  # [B, width]
    out = torch.full((lens.numel(), width, *flat.shape[1:]), fill, dtype=flat.dtype)
    out[inside] = flat
    return out



def flatten_token_ids(seqs: Sequence[Sequence[int]],
                      dtype: torch.dtype = torch.int64) -> tuple[Tensor, Tensor]:
    """(flat ids [sum len] of `dtype`, lengths [n] int64) of token-id lists, in one pass over the
    ids; an id that does not fit `dtype` raises OverflowError."""
    lengths = [len(x) for x in seqs]
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=_NUMPY_INT[dtype],
                       count=sum(lengths))
    return torch.from_numpy(flat), torch.tensor(lengths, dtype=torch.int64)


_NUMPY_INT = {torch.int32: np.int32, torch.int64: np.int64}


def _check_flat(what: str, ids: Tensor, lens: Tensor) -> None:
    if ids.dim() != 1 or lens.dim() != 1 or int(lens.sum()) != ids.numel():
        raise ValueError(f"TrainBatch.from_flat: {what}_ids {tuple(ids.shape)} must be 1-D and hold "
                         f"sum({what}_lens)={int(lens.sum())} tokens")
    negative = (lens < 0).nonzero()
    if len(negative):
        raise ValueError(f"TrainBatch.from_flat: negative {what}_lens at row {int(negative[0])}")


def _left_aligned(flat: Tensor, lens: Tensor, pad_token_id: int) -> Tensor:
    """[n, max(lens)] int64: row i holds flat's i-th run of lens[i] tokens, then padding."""
    width = int(lens.max()) if lens.numel() else 0
    out = torch.full((lens.numel(), width), pad_token_id, dtype=torch.int64)
    out.masked_scatter_(torch.arange(width)[None, :] < lens[:, None], flat.long())
    return out


def _on(t: Tensor, device: torch.device) -> bool:
    """Whether `t` is on `device`; a CUDA device without an index means the current one."""
    if t.device.type != device.type:
        return False
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device.index is None or t.device.index == device.index
