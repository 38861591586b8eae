"""The fp32 numeric oracle (SPEC §4): the block token by token, every stage by its seed name.

Written straight from SPEC §1 and independent of `pallas_kernels.reference`, so each checks the
other. Weights of any dtype are upcast to fp32; all arithmetic is fp32 at HIGHEST precision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kda_jax.config import KdaConfig
from kda_jax.params import KdaParams, in_proj_slices
from kda_jax.state import KdaState

__all__ = ["oracle_forward", "STAGES"]

STAGES = (
    "qkv_proj",
    "conv_out",
    "q",
    "k",
    "v",
    "gate",
    "beta",
    "core",
    "g_raw",
    "out_gate",
    "o_norm_out",
    "final_out",
)
_HI = lax.Precision.HIGHEST


def _mv(w: jax.Array, x: jax.Array) -> jax.Array:
    """w [N, D] (torch layout) times x [B, D] -> [B, N], fp32."""
    return jnp.einsum("nd,bd->bn", w.astype(jnp.float32), x, precision=_HI)


def _token(p: KdaParams, cfg: KdaConfig, carry, x):
    """One token x [B, D] for every sequence; carry = (S [B,H,K,V], window [B, W-1, 3P])."""
    s_prev, window = carry
    h, kd, pdim = cfg.heads, cfg.head_dim, cfg.qkv_dim
    sl = in_proj_slices(cfg)
    w_in = p.w_in.astype(jnp.float32)
    q_raw, k_raw, v_raw = (_mv(w_in[sl[n]], x) for n in ("q", "k", "v"))
    qkv_proj = jnp.concatenate([q_raw, k_raw, v_raw], axis=-1)  # [B, 3P]
    # Causal depthwise conv over (carried window, this token), then SiLU.
    seq = jnp.concatenate([window, qkv_proj[:, None]], axis=1)  # [B, W, 3P]
    conv = jnp.sum(seq * p.conv_w.T[None], axis=1)
    conv_out = conv * jax.nn.sigmoid(conv)
    heads = lambda a: a.reshape(a.shape[0], h, kd)  # noqa: E731

    def l2(a):
        return a / jnp.sqrt(jnp.sum(a * a, axis=-1, keepdims=True) + cfg.l2_eps)

    q = l2(heads(conv_out[:, :pdim]))
    k = l2(heads(conv_out[:, pdim : 2 * pdim]))
    v = heads(conv_out[:, 2 * pdim :])
    g_raw = _mv(p.f_b, _mv(w_in[sl["f_a"]], x))  # [B, P]
    u = heads(g_raw + p.dt_bias)
    a = jnp.exp(p.a_log)[None, :, None]
    if cfg.gate_lower_bound is None:
        gate = -a * jnp.where(u > 20.0, u, jnp.log1p(jnp.exp(jnp.minimum(u, 20.0))))
    else:
        gate = cfg.gate_lower_bound * jax.nn.sigmoid(a * u)
    beta = jax.nn.sigmoid(_mv(w_in[sl["b"]], x))  # [B, H]
    # Delta rule: decay rows, error against the decayed state, rank-1 write, read.
    s = s_prev * jnp.exp(gate)[..., None]
    err = v - jnp.einsum("bhkv,bhk->bhv", s, k, precision=_HI)
    s = s + jnp.einsum("bhk,bhv->bhkv", k, beta[..., None] * err, precision=_HI)
    core = jnp.einsum("bhkv,bhk->bhv", s, cfg.scale * q, precision=_HI)
    out_gate = _mv(p.g_b, _mv(w_in[sl["g_a"]], x))
    if p.g_bias is not None:
        out_gate = out_gate + p.g_bias
    rms = jnp.sqrt(jnp.mean(core * core, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    o_norm_out = (core / rms * p.o_norm_w * jax.nn.sigmoid(heads(out_gate))).reshape(-1, pdim)
    final_out = _mv(p.o_proj, o_norm_out)
    stages = dict(
        qkv_proj=qkv_proj,
        conv_out=conv_out,
        q=q,
        k=k,
        v=v,
        gate=gate,
        beta=beta,
        core=core,
        g_raw=g_raw,
        out_gate=out_gate,
        o_norm_out=o_norm_out,
        final_out=final_out,
    )
    return (s, seq[:, 1:]), stages


@functools.partial(jax.jit, static_argnames=("cfg",))
def oracle_forward(params: KdaParams, cfg: KdaConfig, x: jax.Array, state: KdaState):
    """Runs x [B, T, D] token by token from `state`.

    Returns:
      y [B, T, D] fp32, the new KdaState, and a dict of every stage (STAGES) as [B, T, ...] fp32:
      qkv_proj/conv_out [.., 3P] (conv_out before L2), q/k/v [.., H, K] (q, k after L2, q
      unscaled), gate [.., H, K], beta [.., H], core [.., H, V], g_raw/out_gate/o_norm_out
      [.., P], final_out [.., D].
    """
    p = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    carry = (state.recurrent.astype(jnp.float32), state.conv.astype(jnp.float32))
    xs = jnp.moveaxis(x.astype(jnp.float32), 1, 0)
    (s, window), stages = lax.scan(lambda c, xt: _token(p, cfg, c, xt), carry, xs)
    stages = {n: jnp.moveaxis(a, 0, 1) for n, a in stages.items()}
    return stages["final_out"], KdaState(recurrent=s, conv=window), stages
