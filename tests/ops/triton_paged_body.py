"""ops/triton_paged.py under Triton's CPU interpreter (TRITON_INTERPRET=1, set by the caller before
Triton is imported): the kernels against `paged_attention_reference`, printed as one RESULT line.
Run as a script by tests/ops/test_triton_paged.py."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.triton_interpret import use_interpreter  # noqa: E402

use_interpreter()

import torch  # noqa: E402

from tests.ops.triton_cases import cascade_case  # noqa: E402
from verl_mcore.ops import decode, triton_paged  # noqa: E402

# (batch, heads, groups, hd, block size, table width, dtype, splits): GQA 6 and 7 heads a group
# (padded to 16 rows), MHA, one group; blocks of 3 (a key tile spans many blocks), 16, 256 (a
# tile inside one block); splits past the keys a short sequence has (empty shares); the default.
CASES = [(3, 12, 2, 64, 16, 5, torch.float16, 1), (3, 12, 2, 64, 16, 5, torch.float16, 3),
         (4, 4, 4, 32, 3, 40, torch.float32, 4), (2, 16, 1, 128, 256, 2, torch.float16, None),
         (5, 14, 2, 32, 7, 9, torch.float32, 8)]

errors = []
torch.manual_seed(0)
for b, heads, groups, hd, page, width, dtype, splits in CASES:
    kc = torch.randn(b * width + 1, page, groups, hd).to(dtype)
    vc = torch.randn_like(kc)
    kc[0] = vc[0] = 1e4  # the scratch block, in no table: never read
    table = (torch.randperm(b * width) + 1).view(b, width).to(torch.int32)
    lens = torch.randint(1, width * page + 1, (b,), dtype=torch.int32)
    lens[0], lens[1] = 1, width * page
    q = torch.randn(b, heads, hd).to(dtype)
    got = triton_paged.paged_attention(q, kc, vc, table, lens, hd ** -0.5, splits=splits)
    want = decode.paged_attention_reference(q, kc, vc, table, lens, hd ** -0.5)
    errors.append([str(dtype), splits, (got.float() - want.float()).abs().max().item(), got.dtype == dtype])

for dtype in (torch.float32, torch.float16):
    for splits in (1, 3):
        errors.append([str(dtype), f"cascade/{splits}", cascade_case(dtype, splits=splits), True])
# the engine's self-check of the cascade (the GPU runs it before opting in), fp16 here
check = decode._cascade_matches_reference(torch.device("cpu"), 12, 2, 64, torch.float16)
errors.append(["self-check", "cascade", 0.0 if check is None else 1.0, check is None])
print("RESULT " + json.dumps(errors))
