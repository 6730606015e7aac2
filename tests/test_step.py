"""step.py: a step's tokens grouped by row kind as its plan groups the rows."""
import torch

from qsinkkv import plan
from qsinkkv.config import CacheConfig
from qsinkkv.layout import WindowLayout
from qsinkkv.step import split


def test_split_packed_groups_one_token_rows_and_pads_the_longer_ones():
    g = torch.Generator().manual_seed(0)
    lens = [1, 3, 0, 1, 2]
    qsl = torch.cat((torch.zeros(1, dtype=torch.int64), torch.tensor(lens).cumsum(0)))
    N = int(qsl[-1])
    q, k, v = (torch.randn(N, h, 4, generator=g) for h in (6, 2, 2))
    groups = split(plan.packed(WindowLayout(CacheConfig(sink_tokens=2, recent_tokens=8, block_size=4)),
                              torch.zeros(5, dtype=torch.int64), lens), q, k, v)
    assert groups.one == [0, 3] and groups.multi == [1, 4]
    assert torch.equal(groups.k_one, k[[int(qsl[0]), int(qsl[3])]])
    assert groups.k_multi is None  # the longer rows stay where they lie until a prefill asks for them padded
    _, k_multi, _ = groups.multi_chunk()
    for i, b in enumerate(groups.multi):
        t = lens[b]
        assert torch.equal(k_multi[i, :, :t], k[int(qsl[b]):int(qsl[b]) + t].transpose(0, 1))
    assert groups.multi_real().tolist() == [[True, True, True], [True, True, False]]
    assert groups.multi_tokens().tolist() == [1, 2, 3, 5, 6]  # rows 1 and 4, token by token
