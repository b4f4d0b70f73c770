"""Rotary position embedding, Hugging Face's rotate_half convention, with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, Llama-3 scaled when cfg.rope_scaling is set."""
    # explicit cpu: the model may be built under a meta device context
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device="cpu").float() / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** exponents)
    if cfg.rope_scaling is None:
        return inv_freq
    return _llama3_scale(inv_freq, **cfg.rope_scaling)


def _llama3_scale(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_max_position_embeddings: int) -> torch.Tensor:
    # long wavelengths are divided by `factor`, short ones kept, the band between interpolated
    old_len = original_max_position_embeddings
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin for given positions; inv_freq kept per device (not a module buffer, so meta/to_empty
    construction and `.to()` never leave it uninitialised)."""

    def __init__(self, cfg: ModelConfig):
        self._inv_freq_cpu = rope_inv_freq(cfg)   # [D/2] float32, cpu
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._by_device:
            self._by_device[device] = self._inv_freq_cpu.to(device)
        return self._by_device[device]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> cos, sin: [T, 1, D/2] in dtype (computed in float32)."""
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos, sin: [T, 1, D/2]. Rotates the pairs (i, i + D/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
