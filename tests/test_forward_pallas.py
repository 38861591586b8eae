"""The block on the pallas backend against the oracle, stage by stage, and decode_k == serial
decode bit for bit (compiled; within fp32 round-off in interpret mode, see conftest). On a CPU
the kernels run in interpret mode at the tiny geometry; on a GPU the same tests run compiled at
the Kimi-Linear geometry in bf16."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, TOL, assert_close, assert_same_program, block_setup

import kda_jax as K
from kda_jax.params import in_proj_slices
from pallas_kernels import reference as ref

GATES = ["kimi-linear-48b", "kimi-linear-48b-bounded"] if ON_GPU else ["tiny", "tiny-bounded"]
DTYPE = jnp.bfloat16


_setup = functools.partial(block_setup, dtype=DTYPE, warm=3)


def _isolated_stages(p, cfg, x2d, conv_fn, core_fn, st):
    """Each stage of the reference fed the pallas path's own inputs (its residual alone)."""
    sl = in_proj_slices(cfg)
    h = ref.gemv_reference(x2d.astype(p.dtype), p.w_in, out_dtype=jnp.float32)
    want = dict(
        qkv_proj=h[:, : cfg.conv_dim],
        g_raw=ref.gemv_reference(h[:, sl["f_a"]].astype(p.dtype), p.f_b, out_dtype=jnp.float32),
        out_gate=ref.gemv_reference(h[:, sl["g_a"]].astype(p.dtype), p.g_b, out_dtype=jnp.float32),
        final_out=ref.gemv_reference(
            st["o_norm_out"].reshape(-1, cfg.qkv_dim), p.o_proj, out_dtype=jnp.float32
        ),
    )
    want.update(conv_fn(st["qkv_proj"]))
    want.update(core_fn(h[:, sl["b"]], h[:, sl["g_a"]].astype(p.dtype)))  # as the kernels read it
    return want


def _flat(a, n):
    return a.reshape(n, -1)


@pytest.mark.parametrize("name", [pytest.param(GATES[0], marks=pytest.mark.slow), GATES[1]])
@pytest.mark.parametrize("b,k", [(2, 3), pytest.param(4, 4, marks=pytest.mark.slow)])
def test_pallas_decode_and_verify_stage_by_stage(name, b, k, rng):
    """6 projection rows (the M <= 8 GEMV) and 16 (the 9..64-row tiling)."""
    cfg, p, s0, key = _setup(name, rng, b)
    x = jax.random.normal(key, (b, k, cfg.hidden)).astype(DTYPE)
    y, s_last, snaps, st = K.decode_k(p, cfg, x, s0, backend="pallas", return_stages=True)
    hk = dict(qk_channels=cfg.qk_channels, head_dim=cfg.head_dim, l2_eps=cfg.l2_eps)

    def conv_fn(qkv):
        out, new_state, states = ref.conv_decode_reference(
            qkv, s0.conv, p.conv_w, **hk, snapshots=True
        )
        ref_out.update(states=states, conv=new_state)
        q, kk, v = (out[..., i * cfg.qkv_dim : (i + 1) * cfg.qkv_dim] for i in range(3))
        shape = (b, k, cfg.heads, cfg.head_dim)
        return dict(q=q.reshape(shape), k=kk.reshape(shape), v=v.reshape(shape))

    def core_fn(b_raw, _g_a):
        y_ref, s_ref, snaps_ref = ref.decode_core_reference(
            st["q"],
            st["k"],
            st["v"],
            st["g_raw"],
            b_raw.reshape(b, k, cfg.heads),
            st["out_gate"],
            s0.recurrent,
            p.a_log,
            p.dt_bias,
            p.o_norm_w,
            scale=cfg.scale,
            lower_bound=cfg.gate_lower_bound,
            eps=cfg.rms_norm_eps,
            snapshots=True,
            out_dtype=jnp.float32,
        )
        ref_out.update(state=s_ref, snaps=snaps_ref)
        return dict(o_norm_out=y_ref)

    ref_out = {}
    want = _isolated_stages(p, cfg, x.reshape(b * k, -1), conv_fn, core_fn, st)
    for n, w in want.items():
        assert_close(_flat(st[n], b * k), _flat(w, b * k), TOL["bf16_stage"], f"stage {n}")
    assert_close(snaps.recurrent, ref_out["snaps"], TOL["bf16_stage"], "snapshots")
    assert_close(s_last.recurrent, ref_out["state"], TOL["bf16_stage"], "state")
    np.testing.assert_array_equal(snaps.conv, ref_out["states"])
    np.testing.assert_array_equal(s_last.conv, ref_out["conv"])
    # End to end against the fp32 oracle fed the same weights and input.
    y_o, s_o, _ = K.oracle_forward(p, cfg, x, s0)
    assert_close(y, y_o, TOL["bf16_e2e"], "verify y vs oracle")
    assert_close(s_last.recurrent, s_o.recurrent, TOL["bf16_e2e"], "verify state vs oracle")


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 5, 8] if ON_GPU else [2, 4])
def test_pallas_decode_k_equals_serial_decode_bit_for_bit(k, rng):
    cfg, p, s0, key = _setup(GATES[0], rng, 1)
    x = jax.random.normal(key, (1, k, cfg.hidden)).astype(DTYPE)
    y, s_last, snaps = K.decode_k(p, cfg, x, s0, backend="pallas")
    st = s0
    for i in range(k):
        yi, st = K.decode(p, cfg, x[:, i], st, backend="pallas")
        assert_same_program(y[:, i], yi, f"row {i} y")
        assert_same_program(snaps.recurrent[:, i], st.recurrent, f"snap {i}")
        assert_same_program(snaps.conv[:, i], st.conv, f"conv snap {i}")
    np.testing.assert_array_equal(s_last.recurrent, snaps.recurrent[:, -1])
    np.testing.assert_array_equal(s_last.conv, snaps.conv[:, -1])
    assert_same_program(s_last.recurrent, st.recurrent, "last state")


@pytest.mark.parametrize("name", [GATES[0], pytest.param(GATES[1], marks=pytest.mark.slow)])
def test_pallas_prefill_stage_by_stage_with_padding(name, rng):
    b = 2
    t = 4096 if ON_GPU else 40
    lengths = jnp.array([t, t - (t // 3) - 5])  # neither a chunk multiple
    cfg, p, s0, key = _setup(name, rng, b)
    x = jax.random.normal(key, (b, t, cfg.hidden)).astype(DTYPE)
    pad = jnp.arange(t)[None, :, None] >= lengths[:, None, None]
    xp = jnp.where(pad, jnp.nan, x).astype(DTYPE)
    y, s, st = K.prefill(p, cfg, xp, s0, lengths, backend="pallas", return_stages=True)
    assert np.all(np.isfinite(np.asarray(y, np.float32))), "NaN/inf in prefill output"
    assert np.all(np.isfinite(s.recurrent)) and np.all(np.isfinite(s.conv))
    assert float(jnp.max(jnp.abs(jnp.where(pad, y, 0).astype(jnp.float32)))) == 0.0
    valid = ~pad[..., 0]
    hk = dict(qk_channels=cfg.qk_channels, head_dim=cfg.head_dim, l2_eps=cfg.l2_eps)
    extra = {}

    def conv_fn(qkv):
        out, new_conv = ref.conv_prefill_reference(qkv, s0.conv, p.conv_w, lengths, **hk)
        extra.update(conv=new_conv)
        shape = (b, t, cfg.heads, cfg.head_dim)
        return {
            n: out[..., i * cfg.qkv_dim : (i + 1) * cfg.qkv_dim].reshape(shape)
            for i, n in enumerate("qkv")
        }

    def core_fn(b_raw, g_a):
        y_ref, s_ref = ref.prefill_core_reference(
            st["q"],
            st["k"],
            st["v"],
            st["g_raw"],
            b_raw.reshape(b, t, cfg.heads),
            g_a.reshape(b, t, -1),
            p.g_b,
            s0.recurrent,
            lengths,
            p.a_log,
            p.dt_bias,
            p.o_norm_w,
            scale=cfg.scale,
            chunk=cfg.chunk,
            lower_bound=cfg.gate_lower_bound,
            eps=cfg.rms_norm_eps,
            out_dtype=jnp.float32,
        )
        extra.update(state=s_ref)
        return dict(o_norm_out=y_ref)

    want = _isolated_stages(p, cfg, xp.reshape(b * t, -1), conv_fn, core_fn, st)
    for n, w in want.items():
        got = jnp.where(valid.reshape(-1, 1), _flat(st[n], b * t).astype(jnp.float32), 0.0)
        w = jnp.where(valid.reshape(-1, 1), _flat(w, b * t), 0.0)
        assert_close(got, w, TOL["bf16_stage"], f"stage {n}")
    assert_close(s.recurrent, extra["state"], TOL["bf16_stage"], "state")
    np.testing.assert_allclose(s.conv, extra["conv"], **TOL["conv_state_copy"])
    # End to end, row by row, against the oracle over each row's real tokens.
    for r in range(b):
        n = int(lengths[r])
        sr = jax.tree.map(lambda a, r=r: a[r : r + 1], s0)
        y_o, s_o, _ = K.oracle_forward(p, cfg, x[r : r + 1, :n], sr)
        assert_close(y[r : r + 1, :n], y_o, TOL["bf16_e2e"], f"row {r} y vs oracle")
        assert_close(s.recurrent[r : r + 1], s_o.recurrent, TOL["bf16_e2e"], f"row {r} S")


def _xla_eqns(jaxpr):
    """The equations XLA runs: through jit calls and the pallas backend's custom VJP (whose
    forward is the kernels), not into kernel bodies (whose in-kernel value slices are not
    copies)."""
    for e in jaxpr.eqns:
        if e.primitive.name in ("pjit", "jit", "closed_call"):
            yield from _xla_eqns(e.params["jaxpr"].jaxpr)
        elif e.primitive.name == "custom_vjp_call":
            yield from _xla_eqns(e.params["call_jaxpr"].jaxpr)
        else:
            yield e


@pytest.mark.parametrize("batch,rows", [(1, 1), (1, 4), (64, 1)])
def test_decode_step_launches_five_kernels_and_copies_nothing(batch, rows):
    """One decode (or k-row verify) step on the kernel path is five Pallas launches (w_in with its
    four outputs, conv with f_b | g_b beside it, recurrence, RMSNorm, o_proj) and slices no
    projection or conv output (each kernel writes the arrays the next one reads): every extra
    XLA op between them was a ~1 us kernel on the H200 (docs/performance.md). Up to 16
    projection rows w_in is the Mosaic GPU kernel (`gemv_mgpu`), the other four Triton; at
    B = 64 (64 projection rows) all five are Triton."""
    cfg = K.preset("kimi-linear-48b")
    p = jax.eval_shape(lambda: K.init_params(cfg, jax.random.key(0), DTYPE))
    s = jax.eval_shape(lambda: K.KdaState.zeros(cfg, batch))
    x = jax.ShapeDtypeStruct((batch, rows, cfg.hidden), DTYPE)
    jaxpr = jax.make_jaxpr(lambda p, x, s: K.decode_k(p, cfg, x, s, backend="pallas"))(p, x, s)
    text = str(jaxpr)
    mosaic = int(batch * rows <= 16)
    assert text.count("kda_gemv_mgpu") == text.count("mpmd_map") == mosaic, "w_in's kernel"
    assert text.count("pallas_call[") == 5 - mosaic, text.count("pallas_call[")
    # The only slices left are o_proj's split-D partial sums (fused into their sum by XLA); the
    # conv kernel writes the new conv state apart from a verify's snapshots.
    sliced = [str(e.outvars[0].aval) for e in _xla_eqns(jaxpr.jaxpr) if e.primitive.name == "slice"]
    assert sliced, "o_proj's split-D partial sums are expected"
    assert all(a == f"float32[1,{batch * rows},2304]" for a in sliced), sliced


def test_prefill_slices_no_activation():
    """Prefill on the kernel path copies no activation: conv_prefill writes q, k and v apart,
    and w_in's product (XLA's dot for T > 64 rows) runs one dot per contiguous row block of the
    weight (q|k|v, f_a, g_a, b), so no column block of a [T, 12576] product is copied (122 us
    at T = 8192 on the H200)."""
    cfg = K.preset("kimi-linear-48b")
    p = jax.eval_shape(lambda: K.init_params(cfg, jax.random.key(0), DTYPE))
    s = jax.eval_shape(lambda: K.KdaState.zeros(cfg, 1))
    x = jax.ShapeDtypeStruct((1, 128, cfg.hidden), DTYPE)
    text = str(jax.make_jaxpr(lambda p, x, s: K.prefill(p, cfg, x, s, backend="pallas"))(p, x, s))
    sliced = [ln.strip() for ln in text.splitlines() if "slice[" in ln]
    shapes = [ln.split(" = ")[0].split(":")[1] for ln in sliced]
    want = [f"bf16[{n},{cfg.hidden}]" for n in (cfg.conv_dim, cfg.head_dim, cfg.head_dim)]
    assert shapes == [*want, f"bf16[{cfg.heads},{cfg.hidden}]"], sliced
