"""verl_mcore/ops/decode.py on the CPU: the paged-attention kernel's split-K choice (a pure function
of shapes) and flash="kernel" where the kernel cannot run (the reference answers)."""
import pytest
import torch

from verl_mcore.ops import decode


@pytest.mark.parametrize("batch,heads,groups", [(1, 12, 2), (8, 28, 4), (64, 12, 2), (1, 64, 1), (3, 8, 8)])
@pytest.mark.parametrize("max_len", [16, 256, 1024, 4096, 32768, 1 << 20])
def test_kernel_splits_fill_the_sms_without_tiny_shares(batch, heads, groups, max_len):
    sms = 132
    splits = decode.paged_kernel_splits(batch, heads, groups, max_len, sms)
    ctas = batch * groups * -(-(heads // groups) // 8)  # CTAs a split: (sequence, group, <= 8 heads)
    assert 1 <= splits <= 64
    assert splits == 1 or max_len // splits >= 256  # each share of the longest sequence >= 256 keys
    if ctas >= sms:
        assert splits == 1  # a wave already
    elif max_len >= 64 * 256:
        assert ctas * splits >= 2 * sms or splits == 64  # long sequences: two CTAs an SM


def test_kernel_splits_one_when_the_batch_fills_the_gpu():
    assert decode.paged_kernel_splits(128, 12, 2, 4096, 132) == 1
    assert decode.paged_kernel_splits(16, 12, 2, 8192, 132) == 9  # 32 CTAs -> 288 >= 2 x 132


def test_kernel_mode_off_the_gpu_is_the_reference():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 16, generator=g)
    kc, vc = (torch.randn(7, 4, 2, 16, generator=g) for _ in range(2))
    table = torch.tensor([[3, 1], [2, 6], [5, 4]], dtype=torch.int32)
    lens = torch.tensor([1, 5, 8], dtype=torch.int32)
    want = decode.paged_attention_reference(q, kc, vc, table, lens, 0.25)
    assert torch.equal(decode.paged_attention(q, kc, vc, table, lens, 0.25, flash="kernel"), want)
    assert decode.paged_kernel_supported(torch.device("cpu")) == "not a CUDA device"
