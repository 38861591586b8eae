"""The fp32 oracle against hand-checked cases and an independent float64 numpy loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOL

import kda_jax as K
from kda_jax.params import in_proj_slices


def _np_block(p, cfg, x, s0, conv0):
    """Float64 numpy loop of SPEC §1, written with explicit per-head loops."""
    p = {n: np.asarray(getattr(p, n), np.float64) for n in p.__dataclass_fields__}
    sl = in_proj_slices(cfg)
    h_, kd, pd = cfg.heads, cfg.head_dim, cfg.qkv_dim
    s = np.array(s0, np.float64)
    window = np.array(conv0, np.float64)  # [W-1, 3P]
    ys = []
    for xt in np.asarray(x, np.float64):
        proj = {n: p["w_in"][sl[n]] @ xt for n in sl}
        raw = np.concatenate([proj["q"], proj["k"], proj["v"]])
        seq = np.concatenate([window, raw[None]])
        conv = (seq * p["conv_w"].T).sum(0)
        conv = conv / (1 + np.exp(-conv))
        window = seq[1:]
        f = p["f_b"] @ proj["f_a"]
        z = p["g_b"] @ proj["g_a"]
        beta = 1 / (1 + np.exp(-proj["b"]))
        y = np.zeros(pd)
        for hh in range(h_):
            c = slice(hh * kd, (hh + 1) * kd)
            q = conv[c] / np.sqrt((conv[c] ** 2).sum() + cfg.l2_eps)
            k = conv[pd:][c] / np.sqrt((conv[pd:][c] ** 2).sum() + cfg.l2_eps)
            v = conv[2 * pd :][c]
            u = f[c] + p["dt_bias"][c]
            a = np.exp(p["a_log"][hh])
            if cfg.gate_lower_bound is None:
                g = -a * np.where(u > 20, u, np.log1p(np.exp(np.minimum(u, 20))))
            else:
                g = cfg.gate_lower_bound / (1 + np.exp(-a * u))
            sd = s[hh] * np.exp(g)[:, None]
            delta = beta[hh] * (v - sd.T @ k)
            s[hh] = sd + np.outer(k, delta)
            o = s[hh].T @ (cfg.scale * q)
            o = o / np.sqrt((o**2).mean() + cfg.rms_norm_eps) * p["o_norm_w"]
            y[c] = o / (1 + np.exp(-z[c]))
        ys.append(p["o_proj"] @ y)
    return np.stack(ys), s, window


def test_single_token_from_zero_state_by_hand():
    """T = 1 from zeros: S = beta k^ v^T and core = beta (s q^.k^) v, per head."""
    cfg = K.preset("tiny")
    p = K.init_params(cfg, jax.random.key(0), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (1, 1, cfg.hidden))
    _, state, st = K.oracle_forward(p, cfg, x, K.KdaState.zeros(cfg, 1))
    w_in = np.asarray(p.w_in, np.float64)
    xv = np.asarray(x[0, 0], np.float64)
    raw = w_in[: cfg.conv_dim] @ xv
    np.testing.assert_allclose(st["qkv_proj"][0, 0], raw, **TOL["f64_projection"])
    pre = np.asarray(p.conv_w, np.float64)[:, -1] * raw  # only the current tap sees data
    silu = pre / (1 + np.exp(-pre))
    np.testing.assert_allclose(st["conv_out"][0, 0], silu, **TOL["f64_elementwise"])
    q, k, v = (np.asarray(st[n][0, 0], np.float64) for n in "qkv")
    beta = np.asarray(st["beta"][0, 0], np.float64)
    for hh in range(cfg.heads):
        np.testing.assert_allclose(np.linalg.norm(q[hh]), 1.0, **TOL["f64_unit_norm"])
        want_s = beta[hh] * np.outer(k[hh], v[hh])
        np.testing.assert_allclose(state.recurrent[0, hh], want_s, **TOL["f64_elementwise"])
        want_o = beta[hh] * cfg.scale * (q[hh] @ k[hh]) * v[hh]
        np.testing.assert_allclose(st["core"][0, 0, hh], want_o, **TOL["f64_core"])
    np.testing.assert_array_equal(state.conv[0, -1], st["qkv_proj"][0, 0])


@pytest.mark.parametrize("name", ["tiny", "tiny-bounded"])
def test_oracle_matches_float64_loop_with_carried_state(name):
    cfg = K.preset(name)
    p = K.init_params(cfg, jax.random.key(2), jnp.float32)
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (1, 9, cfg.hidden))
    s0 = K.KdaState(
        recurrent=0.3 * jax.random.normal(keys[1], cfg.recurrent_state_shape(1)),
        conv=jax.random.normal(keys[2], cfg.conv_state_shape(1)),
    )
    y, state, st = K.oracle_forward(p, cfg, x, s0)
    y64, s64, w64 = _np_block(p, cfg, x[0], s0.recurrent[0], s0.conv[0])
    np.testing.assert_allclose(np.asarray(y[0]), y64, **TOL["f64_loop"])
    np.testing.assert_allclose(np.asarray(state.recurrent[0]), s64, **TOL["f64_loop"])
    np.testing.assert_allclose(np.asarray(state.conv[0]), w64, **TOL["f64_projection"])
    assert set(st) == set(K.STAGES)
    assert float(jnp.max(st["gate"])) < 0
