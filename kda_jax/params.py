"""The weights of one block: the fused layout the forward reads, and random init.

Checkpoint tensors (SPEC §6) are mapped onto this layout by `kda_jax.hf`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from kda_jax.config import KdaConfig

__all__ = ["KdaParams", "NO_WEIGHT_DECAY", "init_params", "in_proj_slices", "weight_decay_mask"]


@struct.dataclass
class KdaParams:
    """One block's weights, torch `[out, in]` layout, matrices in the block's weight dtype.

    Attributes:
      w_in: [3P + 2K + H, D], the input projections fused into one weight so a decode step sweeps
        them once: rows q (P) | k (P) | v (P) | f_a (K) | g_a (K) | b (H).
      f_b: [P, K] forget-gate up-projection; g_b: [P, K] output-gate up-projection.
      conv_w: [3P, W] fp32 depthwise conv taps over q|k|v; column W-1 multiplies the current token.
      a_log: [H] fp32; dt_bias: [P] fp32.
      o_norm_w: [K] fp32 weight of the gated RMSNorm.
      o_proj: [D, P] output projection.
      g_bias: [P] fp32 bias of the output gate (z = g_b g_a x + g_bias, as FLA's layer has), or
        None (Kimi-Linear checkpoints have none).
    """

    w_in: jax.Array
    f_b: jax.Array
    g_b: jax.Array
    conv_w: jax.Array
    a_log: jax.Array
    dt_bias: jax.Array
    o_norm_w: jax.Array
    o_proj: jax.Array
    g_bias: jax.Array | None = None

    @property
    def dtype(self):
        return self.w_in.dtype

    def shapes(self, cfg: KdaConfig) -> dict[str, tuple[int, ...]]:
        """The shape every field must have for `cfg`."""
        p, k, d, h, w = cfg.qkv_dim, cfg.head_dim, cfg.hidden, cfg.heads, cfg.conv_kernel
        return dict(
            w_in=(cfg.in_proj_dim, d),
            f_b=(p, k),
            g_b=(p, k),
            conv_w=(3 * p, w),
            a_log=(h,),
            dt_bias=(p,),
            o_norm_w=(k,),
            o_proj=(d, p),
            **({} if self.g_bias is None else dict(g_bias=(p,))),
        )

    def check(self, cfg: KdaConfig) -> None:
        """Raises ValueError naming the first field whose shape or dtype does not fit `cfg`."""
        for name, shape in self.shapes(cfg).items():
            arr = getattr(self, name)
            if tuple(arr.shape) != shape:
                raise ValueError(f"params.{name} has shape {tuple(arr.shape)}, expected {shape}")
        for name in ("conv_w", "a_log", "dt_bias", "o_norm_w", "g_bias"):
            if getattr(self, name) is not None and getattr(self, name).dtype != jnp.float32:
                raise ValueError(f"params.{name} must be float32, got {getattr(self, name).dtype}")
        for name in ("f_b", "g_b", "o_proj"):
            if getattr(self, name).dtype != self.w_in.dtype:
                raise ValueError(
                    f"params.{name} is {getattr(self, name).dtype} but w_in is {self.w_in.dtype}: "
                    "all matrices share one dtype"
                )

    def astype(self, dtype) -> KdaParams:
        """The matrices cast to `dtype` (the compute dtype of the forward), the fp32 vectors as
        they are. Differentiable: gradients come back in each field's own dtype."""
        cast = lambda a: a.astype(dtype)  # noqa: E731
        return self.replace(
            w_in=cast(self.w_in), f_b=cast(self.f_b), g_b=cast(self.g_b), o_proj=cast(self.o_proj)
        )


# Parameters kept out of weight decay (FLA marks A_log and dt_bias `_no_weight_decay`): the gate's
# log-rates and offsets, the output norm's weight and the output gate's bias.
NO_WEIGHT_DECAY = ("a_log", "dt_bias", "o_norm_w", "g_bias")


def weight_decay_mask(params):
    """The optax mask of which leaves take weight decay: False for every leaf whose path names
    one of `NO_WEIGHT_DECAY`, True elsewhere (e.g. `optax.adamw(..., mask=weight_decay_mask)`).

    Takes any pytree of parameters: a `KdaParams`, or a whole model's `nnx.state(model,
    nnx.Param)`, where the names are the `KimiDeltaAttention` attributes.
    """

    def decays(path, _):
        names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
        return not names & set(NO_WEIGHT_DECAY)

    return jax.tree_util.tree_map_with_path(decays, params)


def in_proj_slices(cfg: KdaConfig) -> dict[str, slice]:
    """Row ranges of the parts of `KdaParams.w_in` (and of its output)."""
    p, k, h = cfg.qkv_dim, cfg.head_dim, cfg.heads
    bounds = dict(q=p, k=p, v=p, f_a=k, g_a=k, b=h)
    out, start = {}, 0
    for name, size in bounds.items():
        out[name] = slice(start, start + size)
        start += size
    return out


def init_params(
    cfg: KdaConfig, key: jax.Array, dtype=jnp.bfloat16, *, gate_bias: bool = False
) -> KdaParams:
    """Random weights at realistic scales (matrices in `dtype`); `gate_bias` adds a small random
    output-gate bias.

    Linear weights are N(0, 1/fan_in), so unit-scale inputs give unit-scale projections; the gate
    parameters spread the per-token decay exp(g) of each channel roughly over [0.5, 0.999] for
    either gate variant.
    """
    cfg.validate()
    p, kd, d, h, w = cfg.qkv_dim, cfg.head_dim, cfg.hidden, cfg.heads, cfg.conv_kernel
    keys = iter(jax.random.split(key, 10))

    def linear(out_dim, in_dim, gain=1.0):
        std = gain / math.sqrt(in_dim)
        return (std * jax.random.normal(next(keys), (out_dim, in_dim), jnp.float32)).astype(dtype)

    w_in = linear(cfg.in_proj_dim, d)
    # Small forget-gate input, so dt_bias sets each channel's decay and f perturbs it.
    f_b = linear(p, kd, gain=0.3)
    g_b = linear(p, kd)
    conv_w = jax.random.uniform(next(keys), (3 * p, w), jnp.float32, -1.0, 1.0) / math.sqrt(w)
    conv_w = conv_w.at[:, -1].add(1.0)  # the current token dominates, as in trained checkpoints
    a_log = jnp.log(jax.random.uniform(next(keys), (h,), jnp.float32, 0.5, 1.5))
    # Target per-token log-decay g in [log 0.5, log 0.999], drawn log-uniformly.
    target = -jnp.exp(
        jax.random.uniform(next(keys), (p,), jnp.float32, math.log(1e-3), math.log(0.69))
    )
    a = jnp.repeat(jnp.exp(a_log), kd)
    if cfg.gate_lower_bound is None:
        dt = -target / a  # softplus(dt_bias) = dt
        dt_bias = dt + jnp.log(-jnp.expm1(-dt))  # inverse softplus
    else:
        frac = target / cfg.gate_lower_bound  # sigmoid(a * dt_bias) = frac
        dt_bias = jnp.log(frac / (1.0 - frac)) / a
    o_norm_w = 1.0 + 0.1 * jax.random.normal(next(keys), (kd,), jnp.float32)
    o_proj = linear(d, p)
    g_bias = None
    if gate_bias:  # its own key: the other draws stay those of a block without one
        g_bias = 0.5 * jax.random.normal(jax.random.fold_in(key, 10), (p,), jnp.float32)
    return KdaParams(
        w_in=w_in,
        f_b=f_b,
        g_b=g_b,
        conv_w=conv_w,
        a_log=a_log,
        dt_bias=dt_bias,
        o_norm_w=o_norm_w,
        o_proj=o_proj,
        g_bias=g_bias,
    )
