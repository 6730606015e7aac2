"""Rotary position embedding for the ``cache_index`` contract.

Convention: HF's ``rotate_half`` (channel j pairs with j + D/2), angles ``pos * inv_freq``
computed in float64 so large positions keep full precision, cos/sin multiplied by
``attention_scaling`` as transformers does (yarn's attention factor).

Rotation composes: ``R_a R_b = R_{a+b}``, so a key already rotated to position p is moved
to position p + delta by ``rerotate(k, delta)`` (the unscaled rotation).

Only schedules whose frequencies are fixed qualify: the key of a token must rotate the
same way no matter how long the stream is. Length-dependent ones (dynamic NTK,
longrope) are refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

FIXED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


def check_rope_type(rope_type: str) -> None:
    if rope_type in DYNAMIC_ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope_type!r} changes its frequencies with the sequence length, so a cached key's "
            f"rotation would depend on the stream length; positions='cache_index' supports fixed schedules "
            f"only: {', '.join(FIXED_ROPE_TYPES)}. Use positions='absolute' instead.")
    if rope_type not in FIXED_ROPE_TYPES:
        raise ValueError(f"unknown rope_type={rope_type!r}; supported fixed schedules: {', '.join(FIXED_ROPE_TYPES)}")


@dataclass(frozen=True, eq=False)
class Rotary:
    """A fixed rotary schedule.

    inv_freq:          ``[D/2]`` float64 angular frequencies.
    attention_scaling: factor on cos and sin (1.0 except yarn).
    """

    inv_freq: Tensor
    attention_scaling: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.inv_freq, Tensor) or self.inv_freq.ndim != 1 or not self.inv_freq.is_floating_point():
            raise ValueError(f"Rotary.inv_freq must be a 1-D float tensor [head_dim/2], got {self.inv_freq!r}")
        object.__setattr__(self, "inv_freq", self.inv_freq.detach().to("cpu", torch.float64))

    @property
    def head_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    @classmethod
    def from_schedule(cls, head_dim: int, base: float = 10000.0, rope_type: str = "default", **params) -> Rotary:
        """Build from a schedule's parameters (HF ``rope_parameters`` names).

        default: ``1 / base**(2j/D)``; linear: divided by ``factor``; llama3: ``factor``,
        ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``.
        yarn: build from transformers' own init function (see integrations) and pass
        ``inv_freq`` and ``attention_scaling`` to ``Rotary`` directly.
        """
        check_rope_type(rope_type)
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3(inv_freq, **params)
        elif rope_type == "yarn":
            raise ValueError("rope_type='yarn': pass inv_freq and attention_scaling from transformers' "
                             "ROPE_INIT_FUNCTIONS['yarn'] to Rotary(...)")
        return cls(inv_freq)

    def cos_sin(self, positions: Tensor, scaled: bool = True) -> tuple[Tensor, Tensor]:
        """float64 cos, sin of shape ``[*positions.shape, D]``."""
        freqs = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        s = self.attention_scaling if scaled else 1.0
        return emb.cos() * s, emb.sin() * s

    def rotate(self, x: Tensor, positions: Tensor, scaled: bool = True) -> Tensor:
        """Rotate ``x [..., N, D]`` to ``positions`` (broadcastable to ``[..., N]``); returns x's dtype,
        computing in float64 when x is float64 and float32 otherwise."""
        cos, sin = self.cos_sin(positions, scaled)
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(work)
        out = xf * cos.to(work) + _rotate_half(xf) * sin.to(work)
        return out.to(x.dtype)

    def unrotate(self, x_rotated: Tensor, positions: Tensor) -> Tensor:
        """Undo RoPE as a model applies it (scaled by ``attention_scaling``) at ``positions``: the pre-RoPE
        ``x`` that ``positions='cache_index'`` takes (float32 arithmetic, x's dtype). The one un-rotation the
        transformers integration and the eval's replay share."""
        return (self.rotate(x_rotated.float(), -positions, scaled=False) / self.attention_scaling).to(x_rotated.dtype)

    def rerotate(self, x_rotated: Tensor, delta: Tensor) -> Tensor:
        """Move an already-rotated ``x`` by ``delta`` positions: ``R_delta R_p x = R_{p+delta} x``."""
        return self.rotate(x_rotated, delta, scaled=False)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _llama3(inv_freq: Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
            original_max_position_embeddings: int) -> Tensor:
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)
