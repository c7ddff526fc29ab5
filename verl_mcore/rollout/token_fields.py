"""The samples' per-token fields, declared once: what each response token carries besides its id.

    logprobs    float32  the engine's log-prob of the token (rollout/base.py says which), or
                         nothing when it was not asked for
    loss_mask   uint8    1 where the token counts in the loss: the model wrote it. 0 for tokens put
                         into a response that the model did not write (a tool's output, an
                         observation, a second pass to be masked). Default: every token 1
    versions    int32    the policy version (steps completed) whose weights sampled the token.
                         Default: the batch's version (rollout.batch.Rollout.version); a
                         trajectory sampled over a weight update (partial rollouts) carries its
                         own. The learner reports the age of the tokens that train
                         (Rollout.trajectory_metrics)

Each field is a flat tensor [sum(response_lens), *shape] beside the response token ids (sample
after sample, rollout.batch.Rollout.token_fields). Everything that moves samples iterates
TOKEN_FIELDS: Rollout.from_outputs reads them from the engine's SampleOutputs, the gather and the
broadcast (rollout/gather.py) send them as one flat buffer per dtype, the checkpoint of batches
sampled ahead (Rollout.state) saves them by name. The learner reads them [B, R]
(Rollout.for_learner: the loss mask becomes the batch's response_mask, the log-probs its
engine_log_probs). A field no sample carries costs nothing on the wire or in a checkpoint.
A new field is one more line in TOKEN_FIELDS; an engine or generate function fills it through
SampleOutput.extras. A field whose shape depends on the model is declared when the run is built
(`declare`): MoE routing, `routing_field` (actor.router_replay=rollout, build.py). Every rank
of a run declares the same fields in the same order (the gather names fields by their place in
TOKEN_FIELDS).

A part either carries a field or not. Not carried means every token has the default (or, for a
field without one, that nobody has the values). Samples or replicas that differ are merged by
`merged`: the ones without it get the default; a field without a default is dropped (the
engine's log-probs: only when every replica has them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

# The default of `versions`: not a number the field knows, the version of the weights its batch
# was sampled with, which the sampler knows (rollout.batch.Rollout.version).
BATCH_VERSION = "the batch's version"


# What gloo and NCCL both send (gloo has no int16, uint16, float8).
WIRE_DTYPES = frozenset({torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16,
                         torch.bfloat16, torch.float32, torch.float64})


@dataclass(frozen=True)
class TokenField:
    """One per-token field: its values are [tokens, *shape] of `dtype`.

    default: the value of every token of a sample that does not carry the field (loss_mask: 1);
    None: no default, the field is there only when every sample has it (logprobs);
    BATCH_VERSION: the batch's version, known to the sampler, not here.
    dtype: one that every collective backend sends (gloo has no bool: uint8 for flags)."""

    name: str
    dtype: torch.dtype
    default: Union[int, float, str, None]
    shape: tuple[int, ...] = ()

    def __post_init__(self):
        if self.dtype not in WIRE_DTYPES:
            raise ValueError(f"per-token field {self.name!r}: dtype {self.dtype} does not cross "
                             f"ranks on every backend (gloo has no int16); take one of "
                             f"{sorted(map(str, WIRE_DTYPES))}")
        if self.default is not None and not self.fillable and self.default != BATCH_VERSION:
            raise ValueError(f"per-token field {self.name!r}: default {self.default!r} is none of "
                             f"a number, None, BATCH_VERSION")

    @property
    def width(self) -> int:
        """Values per token."""
        return math.prod(self.shape)

    @property
    def fillable(self) -> bool:
        """Whether samples without the field can be given its default here."""
        return isinstance(self.default, (int, float))

    def fill(self, tokens: int) -> Tensor:
        """[tokens, *shape] of the default (none needed for no tokens)."""
        if not self.fillable and tokens:
            raise ValueError(f"per-token field {self.name!r} has no default value of its own "
                             f"({self.default!r}): pass its values")
        return torch.full((tokens, *self.shape), self.default if tokens else 0, dtype=self.dtype)


TOKEN_FIELDS: dict[str, TokenField] = {f.name: f for f in (
    TokenField("logprobs", torch.float32, None),
    TokenField("loss_mask", torch.uint8, 1),
    TokenField("versions", torch.int32, BATCH_VERSION),
)}
# The declarations above; `declare` adds to them, `retract` removes only what it added.
_BUILT_IN = frozenset(TOKEN_FIELDS)

ROUTED_EXPERTS = "routed_experts"


def routing_field(layers: int, topk: int) -> TokenField:
    """routed_experts  int32 [layers, top_k]: the experts each MoE layer routed the forward that
    produced the token to (the last prompt position's for the first token), as the engine chose
    them (routing replay, models/router_replay.py). Dense layers, and tokens no forward of the
    engine produced (observations), hold -1: the trainer's router then chooses itself."""
    return TokenField(ROUTED_EXPERTS, torch.int32, -1, (layers, topk))


def declare(field: TokenField) -> None:
    """Add a per-token field to TOKEN_FIELDS (after the others). Declaring the same field again
    is a no-op; one of the same name with another dtype, default or shape replaces an earlier
    `declare`'s (a new run in the same process, another model), never a built-in field."""
    if field.name in _BUILT_IN:
        raise ValueError(f"per-token field {field.name!r} is built in (rollout/token_fields.py); "
                         "declare a field of another name")
    if TOKEN_FIELDS.get(field.name) == field:
        return
    TOKEN_FIELDS.pop(field.name, None)
    TOKEN_FIELDS[field.name] = field


def retract(name: str) -> None:
    """Remove a field `declare` added (nothing when it is not declared)."""
    if name in _BUILT_IN:
        raise ValueError(f"per-token field {name!r} is built in and cannot be retracted")
    TOKEN_FIELDS.pop(name, None)


def merged(name: str, carried: Sequence[bool], what: str = "samples",
           tokens: Optional[Sequence[int]] = None) -> bool:
    """Whether a batch made of `what` (samples, replicas) of which `carried` say which carry
    field `name` carries it: all of them, or some when the others can be given the default.
    Some but not all carrying a BATCH_VERSION field is a producer's mistake (the ones without it
    would need a version nobody here knows): ValueError. With their `tokens`, those without a
    token (an empty response, a replica without samples) have no say: nothing of theirs to fill."""
    if tokens is not None:
        carried = [c for c, n in zip(carried, tokens) if n]
    f = TOKEN_FIELDS[name]
    if all(carried):
        return bool(carried)
    if not any(carried) or f.default is None:
        return False
    if not f.fillable:
        have = [i for i, c in enumerate(carried) if c]
        raise ValueError(f"per-token field {name!r}: {what} {have[:8]} carry it and the others "
                         f"do not; whoever sets it (SampleOutput.{name}) sets it on every sample")
    return True


def check(fields: Mapping[str, Tensor], tokens: int, where: str) -> dict[str, Tensor]:
    """`fields` in declaration order, each [tokens, *shape] of its declared dtype (cast);
    ValueError naming `where` and the field for an undeclared name or a wrong size."""
    unknown = sorted(set(fields) - set(TOKEN_FIELDS))
    if unknown:
        raise ValueError(f"{where}: {unknown} are not declared per-token fields "
                         f"(rollout/token_fields.py TOKEN_FIELDS has {list(TOKEN_FIELDS)})")
    out = {}
    for name, f in TOKEN_FIELDS.items():
        if name not in fields:
            continue
        t = fields[name]
        if t.numel() != tokens * f.width:
            raise ValueError(f"{where}: per-token field {name!r} has {t.numel()} values, the "
                             f"responses {tokens} tokens x {f.width} per token")
        out[name] = t.to(f.dtype).reshape(tokens, *f.shape)
    return out


def filled(fields: Mapping[str, Tensor], name: str, tokens: int,
           version: Optional[int] = None) -> Optional[Tensor]:
    """[tokens, *shape]: the field's values, else its default on every token (`version` for a
    BATCH_VERSION field), else None (a field without a default nobody gave)."""
    if name in fields:
        return fields[name]
    f = TOKEN_FIELDS[name]
    if f.default == BATCH_VERSION and version is not None:
        return torch.full((tokens, *f.shape), version, dtype=f.dtype)
    return f.fill(tokens) if f.fillable else None


# ------------------------------------------------------------------ the wire

def carried_bits(fields: Mapping[str, Tensor]) -> int:
    """Bit i set when the i-th declared field is carried (the gather's sizes row holds it)."""
    return sum(1 << i for i, name in enumerate(TOKEN_FIELDS) if name in fields)


def names_of(bits: int) -> list[str]:
    return [name for i, name in enumerate(TOKEN_FIELDS) if bits >> i & 1]


def agreed_names(bits: Sequence[int], tokens: Sequence[int], what: str) -> list[str]:
    """The fields a batch gathered from parts with these carried bits and response tokens
    carries (`merged`)."""
    return [name for i, name in enumerate(TOKEN_FIELDS)
            if merged(name, [bool(b >> i & 1) for b in bits], what, tokens)]


def dtypes_of(names: Sequence[str]) -> list[torch.dtype]:
    """The buffers' dtypes, in the order of first appearance among `names`."""
    return list(dict.fromkeys(TOKEN_FIELDS[n].dtype for n in names))


def buffer_numel(names: Sequence[str], dtype: torch.dtype, tokens: int) -> int:
    return tokens * sum(TOKEN_FIELDS[n].width for n in names if TOKEN_FIELDS[n].dtype == dtype)


def pack(fields: Mapping[str, Tensor], names: Sequence[str], tokens: int,
         dtype: torch.dtype) -> Tensor:
    """[buffer_numel] of `dtype`: the fields `names` of that dtype one after another (the
    default where this part does not carry one: `names` are the whole batch's)."""
    chunks = [(fields[n] if n in fields else TOKEN_FIELDS[n].fill(tokens)).reshape(-1)
              for n in names if TOKEN_FIELDS[n].dtype == dtype]
    return torch.cat(chunks) if chunks else torch.zeros(0, dtype=dtype)


def unpack(buffers: Mapping[torch.dtype, Tensor], names: Sequence[str],
           tokens: int) -> dict[str, Tensor]:
    """The fields `names` cut from their dtype's buffer (views, no copies)."""
    out, offset = {}, dict.fromkeys(buffers, 0)
    for n in names:
        f = TOKEN_FIELDS[n]
        k = tokens * f.width
        out[n] = buffers[f.dtype][offset[f.dtype]:offset[f.dtype] + k].view(tokens, *f.shape)
        offset[f.dtype] += k
    return out
