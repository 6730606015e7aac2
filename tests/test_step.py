"""step.py: a step's tokens grouped by row kind, and where each packed token sits in its sequence."""
import torch

from qsinkkv.step import split_packed, token_positions


def test_token_positions_counts_each_rows_tokens_on_from_what_it_held():
    held, lens = torch.tensor([5, 0, 9, 2]), torch.tensor([3, 1, 0, 2])
    expect = [5, 6, 7, 0, 2, 3]                    # row 2 brings nothing
    assert token_positions(held, lens).tolist() == expect
    assert token_positions(torch.tensor([4]), torch.tensor([0])).tolist() == []


def test_split_packed_groups_one_token_rows_and_pads_the_longer_ones():
    g = torch.Generator().manual_seed(0)
    lens = [1, 3, 0, 1, 2]
    qsl = torch.cat((torch.zeros(1, dtype=torch.int64), torch.tensor(lens).cumsum(0)))
    N = int(qsl[-1])
    q, k, v = (torch.randn(N, h, 4, generator=g) for h in (6, 2, 2))
    split = split_packed(q, k, v, qsl, lens)
    assert split.one == [0, 3] and split.multi == [1, 4]
    assert torch.equal(split.k_one, k[[int(qsl[0]), int(qsl[3])]])
    assert split.k_multi is None  # the longer rows stay where they lie until a prefill asks for them padded
    _, k_multi, _ = split.multi_chunk()
    for i, b in enumerate(split.multi):
        t = lens[b]
        assert torch.equal(k_multi[i, :, :t], k[int(qsl[b]):int(qsl[b]) + t].transpose(0, 1))
    assert split.multi_real().tolist() == [[True, True, True], [True, True, False]]
    assert split.multi_tokens().tolist() == [1, 2, 3, 5, 6]  # rows 1 and 4, token by token
