import torch

from verl_mcore.reward import place_on_last_token


def test_scalar_goes_on_the_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0, 0],
                         [1, 1, 1, 1, 1],
                         [0, 0, 0, 0, 0],  # empty response: nowhere to put it
                         [1, 0, 1, 0, 0]])  # a gap: the last 1 counts
    rewards = place_on_last_token([0.5, -1.0, 3.0, 2.0], mask)
    expected = torch.zeros(4, 5)
    expected[0, 2], expected[1, 4], expected[3, 2] = 0.5, -1.0, 2.0
    assert rewards.dtype == torch.float32 and torch.equal(rewards, expected)
    assert torch.equal(rewards.sum(1), torch.tensor([0.5, -1.0, 0.0, 2.0]))
