"""The rollout gather before the tensor one (Sampler.generate and TrainBatch.from_sequences at
commit c1ad090): the oracle of tests/rollout/test_gather.py and the baseline of
bench/bench_rollout_gather.py."""
from __future__ import annotations

import torch

from verl_mcore.engine.batch import TrainBatch


def old_from_sequences(prompts, responses, pad_token_id):
    """TrainBatch.from_sequences before the flat constructor: one row at a time."""
    b = len(prompts)
    filled = [list(r) if len(r) else [pad_token_id] for r in responses]
    prompt_lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    resp_lens = torch.tensor([len(r) for r in filled], dtype=torch.int64)
    seq_lens = prompt_lens + resp_lens
    input_ids = torch.full((b, int(seq_lens.max())), pad_token_id, dtype=torch.int64)
    response_mask = torch.zeros(b, int(resp_lens.max()), dtype=torch.float32)
    for i, (p, r, original) in enumerate(zip(prompts, filled, responses)):
        input_ids[i, :len(p)] = torch.as_tensor(list(p), dtype=torch.int64)
        input_ids[i, len(p):len(p) + len(r)] = torch.as_tensor(r, dtype=torch.int64)
        if len(original):
            response_mask[i, :len(r)] = 1.0
    return TrainBatch(input_ids=input_ids, prompt_lens=prompt_lens, seq_lens=seq_lens,
                      response_mask=response_mask)


def object_gather(groups, world, prompts, outputs):
    """Sampler.generate's gather: all_gather_object of Python lists from TP_g rank 0 of each
    replica -> ([(prompt ids, row, response ids, finish reason)] in global order, group ids)."""
    import torch.distributed as dist

    mine = None
    if groups.gen_tp_rank == 0:
        mine = [(o.prompt_index, o.sample_index, prompts.input_ids[o.prompt_index],
                 prompts.rows[o.prompt_index], list(o.token_ids), o.finish_reason) for o in outputs]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (groups.gen_dp_rank, mine))
    samples, group_ids, base = [], [], 0
    for _, part in sorted((g for g in gathered if g[1] is not None), key=lambda g: g[0]):
        part = sorted(part, key=lambda o: (o[0], o[1]))
        for prompt_index, _, prompt_ids, row, response, finish in part:
            samples.append((prompt_ids, row, response, finish))
            group_ids.append(base + prompt_index)
        base += 1 + max((o[0] for o in part), default=-1)
    return samples, group_ids
