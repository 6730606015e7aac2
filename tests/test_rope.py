import math

import pytest
import torch

from qsinkkv import Rotary


def test_rerotation_identity_float64():
    """Rotating a key already rotated to p by delta equals rotating the raw key to p + delta."""
    rot = Rotary.from_schedule(64, base=10000.0)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 3, 50, 64, generator=g, dtype=torch.float64)
    # angles are pos * inv_freq in float64: at pos ~1e5 the angle itself carries ~1e-11 of
    # rounding, so the 1e-12 identity is checked where float64 angles are that precise
    p = torch.randint(0, 2048, (50,), generator=g)
    delta = torch.randint(-1024, 1024, (50,), generator=g)
    once = rot.rotate(k, p + delta, scaled=False)
    twice = rot.rerotate(rot.rotate(k, p, scaled=False), delta)
    assert (once - twice).abs().max().item() < 1e-12


def test_rotation_preserves_norm_and_scores_are_relative():
    rot = Rotary.from_schedule(32, base=500.0)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 32, generator=g, dtype=torch.float64)
    a = (rot.rotate(q, torch.tensor(7)) * rot.rotate(k, torch.tensor(3))).sum()
    b = (rot.rotate(q, torch.tensor(104)) * rot.rotate(k, torch.tensor(100))).sum()
    assert abs(a - b) < 1e-12
    assert abs(rot.rotate(q, torch.tensor(12345)).norm() - q.norm()) < 1e-12


def test_schedules():
    base = Rotary.from_schedule(8, base=100.0).inv_freq
    assert torch.allclose(base, 1 / 100.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    assert torch.allclose(Rotary.from_schedule(8, base=100.0, rope_type="linear", factor=4.0).inv_freq, base / 4)
    l3 = Rotary.from_schedule(128, base=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=8192).inv_freq
    plain = Rotary.from_schedule(128, base=500000.0).inv_freq
    wavelen = 2 * math.pi / plain
    assert torch.equal(l3[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])     # high freqs kept
    assert torch.allclose(l3[wavelen > 8192], plain[wavelen > 8192] / 8.0)   # low freqs scaled


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_dynamic_schedules_are_refused(rope_type):
    with pytest.raises(ValueError, match=f"rope_type='{rope_type}'.*fixed schedules"):
        Rotary.from_schedule(64, rope_type=rope_type, factor=2.0)


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown rope_type='ntk-by-parts'"):
        Rotary.from_schedule(64, rope_type="ntk-by-parts")
