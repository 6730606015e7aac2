"""plan.py: a step's plan, from the lengths alone, made once and read by every layer of the step."""
import pytest
import torch
from helpers import make

from qsinkkv import CacheConfig, plan, write
from qsinkkv.layout import WindowLayout

CFG = CacheConfig(sink_tokens=2, recent_tokens=8, block_size=4, bits=4, value_group_size=4)
LAYOUT = WindowLayout(CFG)


def same_write(a: write.WritePlan, b: write.WritePlan) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(vars(a).values(),
                                                                                             vars(b).values()))


def test_a_packed_steps_rows_by_how_they_run():
    held = torch.tensor([0, 5, 3, 9, 1])
    step_plan = plan.packed(LAYOUT, held, [3, 1, 0, 7, 1])
    assert step_plan.packed and step_plan.query_start_loc.tolist() == [0, 3, 4, 4, 11, 12]
    assert step_plan.one == [1, 4] and step_plan.multi == [0, 3] and step_plan.starting == [0]
    assert not step_plan.decoding                       # rows prefill
    assert not step_plan.causal                         # row 3 holds and brings 16 > S + W = 10
    assert step_plan.multi_held                         # row 3 holds tokens
    # the write places each row's tokens where they lie, rows in token order (row 2 brings none)
    assert step_plan.write.rows.tolist() == [0, 1, 3, 4] and step_plan.write.lens.tolist() == [3, 1, 7, 1]
    assert same_write(step_plan.write, write.plan(LAYOUT, (0, 5, 9, 1), (3, 1, 7, 1), (0, 3, 4, 11), (0, 1, 3, 4)))


def test_a_padded_chunk_writes_its_one_token_rows_first_then_the_longer_ones_padded():
    step_plan = plan.padded(LAYOUT, torch.tensor([4, 0, 6]), [1, 3, 2], 5)
    assert not step_plan.packed and step_plan.one == [0] and step_plan.multi == [1, 2]
    assert step_plan.causal and step_plan.multi_held and not step_plan.uniform
    # tokens: row 0's one, then rows 1 and 2 padded to 3 columns each
    assert same_write(step_plan.write, write.plan(LAYOUT, (4, 0, 6), (1, 3, 2), (0, 1, 4), (0, 1, 2)))
    assert plan.padded(LAYOUT, torch.tensor([4, 0, 6]), [5, 5, 5], 5).uniform


@pytest.mark.parametrize("held, decoding", [([2, 7], True), ([1, 7], False), ([0, 0], False)])
def test_a_plain_decode_step_is_one_token_a_row_past_the_sinks(held, decoding):
    assert plan.packed(LAYOUT, torch.tensor(held), [1, 1]).decoding == decoding


def test_every_layer_of_a_caches_step_reads_the_plan_its_first_layer_made_and_none_changes_it():
    layers, B = 4, 3
    cache = make(CFG, layers=layers, B=B, Hkv=2)
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 1, 3])
    for _ in range(3):
        held = cache.seq_lens(0)
        made = plan._plan.cache_info().misses
        q, k, v = (torch.randn(B, h, 5, 8, generator=g) for h in (4, 2, 2))
        for layer in range(layers):
            cache.attend(layer, q, k, v, lengths)
        assert plan._plan.cache_info().misses - made <= 1, "a later layer planned the step again"
        step_plan = plan.padded(cache.layout, held, lengths.tolist(), 5)
        assert torch.equal(step_plan.held, held)  # (shared by the layers: never advanced in place)
        assert torch.equal(cache.seq_lens(0), held + lengths)
