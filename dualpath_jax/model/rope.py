"""Rotary position embeddings (RoPE): default and yarn frequencies, rotate-half and
interleaved pairs."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from dualpath_jax.config import ModelConfig

Array = jax.Array


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """Yarn's magnitude correction for a context `factor` times the original: 1 + 0.1 mscale
    ln(factor), 1 for factor <= 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class Rope:
    """RoPE over `dim` features per head (`ModelConfig.rope_*`): default or yarn inverse
    frequencies, cos/sin scaled by `attention_factor`."""

    dim: int
    theta: float
    yarn: bool = False
    factor: float = 1.0
    original_max_len: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    @classmethod
    def for_model(cls, cfg: ModelConfig, dim: int) -> Rope:
        if cfg.rope_type == "default":
            return cls(dim, cfg.rope_theta)
        if cfg.rope_type != "yarn":
            raise ValueError(f"rope_type must be 'default' or 'yarn', got {cfg.rope_type!r}")
        factor = cfg.rope_factor
        if cfg.rope_attention_factor:
            attention_factor = cfg.rope_attention_factor
        elif cfg.rope_mscale and cfg.rope_mscale_all_dim:
            attention_factor = yarn_mscale(factor, cfg.rope_mscale) / yarn_mscale(
                factor, cfg.rope_mscale_all_dim
            )
        else:
            attention_factor = yarn_mscale(factor)
        return cls(
            dim,
            cfg.rope_theta,
            True,
            factor,
            cfg.rope_original_max_len,
            cfg.rope_beta_fast or 32.0,  # 0 (absent): transformers' defaults
            cfg.rope_beta_slow or 1.0,
            cfg.rope_truncate,
            attention_factor,
        )

    def inv_freq(self) -> Array:
        """Inverse frequencies `[dim // 2]` float32. Yarn keeps the original frequencies of the
        dimensions that turn more than `beta_fast` times in `original_max_len` positions, divides
        those turning fewer than `beta_slow` times by `factor`, and blends linearly between."""
        d = self.dim
        wavelengths = self.theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)  # / 2 pi
        original = 1.0 / wavelengths
        if not self.yarn:
            return original
        interpolated = 1.0 / (self.factor * wavelengths)

        def dim_of(rotations: float) -> float:  # the dimension turning `rotations` times
            wavelength = self.original_max_len / (rotations * 2 * math.pi)
            return d * math.log(wavelength) / (2 * math.log(self.theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # a band of width 0 would divide by 0
        ramp = jnp.clip((jnp.arange(d // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # the weight of the original frequency
        return interpolated * (1 - keep) + original * keep

    def angles(self, positions: Array) -> tuple[Array, Array]:
        """cos/sin of the angles: positions `[B, T]` -> two `[B, T, dim // 2]` float32 arrays."""
        ang = positions.astype(jnp.float32)[..., None] * self.inv_freq()
        cos, sin = jnp.cos(ang), jnp.sin(ang)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin


def apply_rope(x: Array, cos: Array, sin: Array, interleave: bool) -> Array:
    """Rotates `x` `[B, T, H, d]` (cos/sin `[B, T, d/2]`).

    `interleave=False` is the rotate-half form (pairs `(i, i + d/2)`); `interleave=True` rotates
    pairs `(2i, 2i + 1)` and returns them de-interleaved (evens then odds), as DeepSeek does.
    """
    cos = cos[:, :, None, :].astype(jnp.float32)
    sin = sin[:, :, None, :].astype(jnp.float32)
    xf = x.astype(jnp.float32)
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
