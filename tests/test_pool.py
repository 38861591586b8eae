"""decode, decode_k and prefill from a slot-indexed state pool, and decode at any batch size.

A pool call must equal the dense call on the gathered rows (the pallas kernels read and write
the pool in place; the xla backend gathers and scatters), leave every other slot's bits alone,
skip padding rows (slot -1) and refuse bad slots: with a ValueError when they are concrete, by
writing nothing and returning NaN for that row under jit. The kernels run in interpret mode at
the tiny geometry on a CPU; the Kimi-Linear geometry is cross-lowered for the H200.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, TOL, assert_close, assert_same_program, lower_for_h200

import kda_jax as K
from kda_jax import forward

BACKENDS = ["xla", "pallas"]
FP32_TOL = TOL["fp32_gpu"] if ON_GPU else TOL["fp32_cpu"]


def _pool(cfg, key, n):
    """A pool of n carried (random, non-zero) states."""
    k1, k2 = jax.random.split(key)
    return K.KdaState(
        recurrent=0.1 * jax.random.normal(k1, cfg.recurrent_state_shape(n)),
        conv=jax.random.normal(k2, cfg.conv_state_shape(n)),
    )


def _setup(key, b, n, pad=1, dtype=jnp.float32):
    """tiny params, a pool of n, and B shuffled distinct slots with `pad` padding rows."""
    cfg = K.preset("tiny")
    kp, ks, kx, kperm = jax.random.split(key, 4)
    p = K.init_params(cfg, kp, dtype)
    slots = np.array(jax.random.permutation(kperm, n)[:b], np.int32)
    slots[: b - 1 : max(1, b // max(pad, 1))][:pad] = -1
    return cfg, p, _pool(cfg, ks, n), jnp.asarray(slots), kx


def _gather(pool, slots):
    return jax.tree.map(lambda a: a[jnp.maximum(slots, 0)], pool)


def _same(got, want, backend, what):
    """Bitwise where the path and tiling are the same program (pallas compiled); fp32 round-off
    of one code path cut differently otherwise (interpret mode, the xla backend)."""
    if backend == "pallas":
        assert_same_program(got, want, what)
    elif np.any(np.asarray(want)):
        assert_close(got, want, TOL["same_path_fp32"], what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def _check_pool(new, pool, dense_new, slots, backend):
    """Named slots hold the dense call's new state; every other slot keeps its bits."""
    s = np.asarray(slots)
    for name in ("recurrent", "conv"):
        got, old, want = (np.asarray(getattr(t, name)) for t in (new, pool, dense_new))
        real = s >= 0
        _same(got[s[real]], want[real], backend, f"{name} at the named slots")
        untouched = np.setdiff1d(np.arange(old.shape[0]), s[real])
        np.testing.assert_array_equal(got[untouched], old[untouched], err_msg=f"{name} untouched")


def _poison_pads(x, real):
    """NaN in every padding row's x: a padding row outputs 0 whatever its x holds."""
    return jnp.where(jnp.asarray(real).reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.nan)


def _run(backend, b, n, entry, rng, k=3, t=20):
    cfg, p, pool, slots, kx = _setup(rng, b, n)
    real = np.asarray(slots) >= 0
    dense = _gather(pool, slots)
    if entry == "decode":
        x = _poison_pads(jax.random.normal(kx, (b, cfg.hidden)), real)
        y, new = K.decode(p, cfg, x, pool, slots=slots, backend=backend)
        yd, nd = K.decode(p, cfg, x, dense, backend=backend)
    elif entry == "decode_k":
        x = _poison_pads(jax.random.normal(kx, (b, k, cfg.hidden)), real)
        y, new, snaps = K.decode_k(p, cfg, x, pool, slots=slots, backend=backend)
        yd, nd, snd = K.decode_k(p, cfg, x, dense, backend=backend)
        for name in ("recurrent", "conv"):
            got, want = np.asarray(getattr(snaps, name)), np.asarray(getattr(snd, name))
            _same(got[real], want[real], backend, f"{name} snapshots")
            np.testing.assert_array_equal(got[~real], 0, err_msg="padding row snapshots")
    else:
        x = _poison_pads(jax.random.normal(kx, (b, t, cfg.hidden)), real)
        lengths = jax.random.randint(kx, (b,), 1, t + 1)
        y, new = K.prefill(p, cfg, x, pool, lengths, slots=slots, backend=backend)
        yd, nd = K.prefill(p, cfg, x, dense, lengths, backend=backend)
    y, yd = np.asarray(y), np.asarray(yd)
    _same(y[real], yd[real], backend, f"{entry} y")
    np.testing.assert_array_equal(y[~real], 0, err_msg="padding rows output 0")
    _check_pool(new, pool, nd, slots, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "entry", ["decode", "decode_k", pytest.param("prefill", marks=pytest.mark.slow)]
)
def test_pool_equals_dense_on_the_gathered_rows(backend, entry, rng):
    _run(backend, 3, 7, entry, rng)


def test_xla_prefill_pool_equals_dense(rng):
    """The fast tier's prefill case (pallas prefill from a pool: the slow tier, and the refused
    rows' test below)."""
    _run("xla", 3, 7, "prefill", rng)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entry,b", [("decode", 72), ("decode_k", 24)])
def test_pool_past_64_rows(backend, entry, b, rng):
    """B = 72 decode rows and 24 x 3 verify rows: past the decode kernels' row tile, the
    projections are XLA's dots and the conv runs in its own launch."""
    _run(backend, b, 2 * b, entry, rng)


@pytest.mark.slow
def test_pallas_dense_decode_past_64_rows_matches_xla(rng):
    """No pool: 65 decode rows and 9 x 8 verify rows on the pallas backend, against xla."""
    cfg, p, _, _, kx = _setup(rng, 1, 1)
    s0 = _pool(cfg, kx, 65)
    x = jax.random.normal(kx, (65, cfg.hidden))
    y, s = K.decode(p, cfg, x, s0, backend="pallas")
    y_x, s_x = K.decode(p, cfg, x, s0, backend="xla")
    assert_close(y, y_x, TOL["fp32_cpu"], "decode y")
    assert_close(s.recurrent, s_x.recurrent, TOL["fp32_cpu"], "decode state")
    xk = jax.random.normal(kx, (9, 8, cfg.hidden))
    s9 = jax.tree.map(lambda a: a[:9], s0)
    y, s, _ = K.decode_k(p, cfg, xk, s9, backend="pallas")
    y_x, s_x, _ = K.decode_k(p, cfg, xk, s9, backend="xla")
    assert_close(y, y_x, TOL["fp32_cpu"], "decode_k y")
    assert_close(s.recurrent, s_x.recurrent, TOL["fp32_cpu"], "decode_k state")


def test_xla_4096_rows_and_the_sorted_repeat_check(rng):
    """4096 decode rows from a pool of 8192 (the xla backend; tiny geometry). Under jit the
    repeats of 4096 rows are found by a sort: a repeated slot's later row writes nothing and
    outputs NaN, the first row naming it goes through."""
    b = 4096
    assert b > forward._PAIRWISE_ROWS
    cfg, p, pool, slots, kx = _setup(rng, b, 2 * b, pad=3)
    x = jax.random.normal(kx, (b, cfg.hidden))
    y, new = K.decode(p, cfg, x, pool, slots=slots, backend="xla")
    yd, nd = K.decode(p, cfg, x, _gather(pool, slots), backend="xla")
    real = np.asarray(slots) >= 0
    _same(np.asarray(y)[real], np.asarray(yd)[real], "xla", "y")
    _check_pool(new, pool, nd, slots, "xla")
    first = int(np.flatnonzero(real)[0])
    dup = slots.at[-1].set(slots[first])
    fn = jax.jit(lambda p, x, s, sl: K.decode(p, cfg, x, s, slots=sl, backend="xla"))
    y2, new2 = fn(p, x, pool, dup)
    assert np.isnan(np.asarray(y2[-1])).all()
    _same(y2[first], y[first], "xla", "the first row naming the slot")
    _same(new2.recurrent[slots[first]], new.recurrent[slots[first]], "xla", "its state")
    np.testing.assert_array_equal(new2.recurrent[slots[-1]], pool.recurrent[slots[-1]])


@pytest.mark.parametrize("backend", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_bad_slots_under_jit_write_nothing_and_output_nan(backend, rng):
    """Traced slots cannot be checked: a repeat (after its first row) or a slot outside
    [-1, N) writes nothing and its outputs, snapshots included, are NaN."""
    cfg, p, pool, _, kx = _setup(rng, 4, 6)
    slots = jnp.array([2, 2, 9, -5], jnp.int32)
    x = jax.random.normal(kx, (4, 2, cfg.hidden))
    fn = jax.jit(lambda p, x, s, sl: K.decode_k(p, cfg, x, s, slots=sl, backend=backend))
    y, new, snaps = fn(p, x, pool, slots)
    assert np.isnan(np.asarray(y[1:])).all() and not np.isnan(np.asarray(y[0])).any()
    assert np.isnan(np.asarray(snaps.recurrent[1:])).all()
    # The dense call of the same B (same tiling); its rows are independent of each other.
    first = lambda t: jax.tree.map(lambda a: a[:1], t)  # noqa: E731
    yd, nd, _ = K.decode_k(p, cfg, x, _gather(pool, slots), backend=backend)
    _same(y[:1], yd[:1], backend, "the first row naming slot 2")
    _check_pool(new, pool, first(nd), slots[:1], backend)
    fp = jax.jit(lambda p, x, s, sl: K.prefill(p, cfg, x, s, slots=sl, backend=backend))
    yp, newp = fp(p, x, pool, slots)
    assert np.isnan(np.asarray(yp[1:])).all()
    ypd, npd = K.prefill(p, cfg, x, _gather(pool, slots), backend=backend)
    _same(yp[:1], ypd[:1], backend, "prefill: the first row naming slot 2")
    _check_pool(newp, pool, first(npd), slots[:1], backend)


def test_concrete_slots_are_checked_before_work(rng):
    cfg, p, pool, _, kx = _setup(rng, 3, 4)
    x = jax.random.normal(kx, (3, cfg.hidden))
    with pytest.raises(ValueError, match=r"decode: slots \[1\] are named by more than one row"):
        K.decode(p, cfg, x, pool, slots=jnp.array([1, 1, -1]))
    with pytest.raises(ValueError, match=r"slots hold \[4, -2\], expected values in \[-1, N=4\)"):
        K.decode_k(p, cfg, x[:, None], pool, slots=np.array([4, 0, -2]))
    with pytest.raises(ValueError, match=r"prefill: slots has shape \(2,\) .* expected \[3\]"):
        K.prefill(p, cfg, x[:, None], pool, slots=jnp.array([0, 1]))
    with pytest.raises(ValueError, match=r"slots has shape \(3,\) and dtype float32"):
        K.decode(p, cfg, x, pool, slots=jnp.array([0.0, 1.0, 2.0]))
    empty = jax.tree.map(lambda a: a[:0], pool)
    with pytest.raises(ValueError, match=r"state pool has shape \(0, .* N >= 1"):
        K.decode(p, cfg, x, empty, slots=jnp.array([-1, -1, -1]))


def test_slots_none_keeps_the_dense_meaning(rng):
    cfg, p, pool, _, kx = _setup(rng, 3, 3)
    x = jax.random.normal(kx, (3, cfg.hidden))
    y, new = K.decode(p, cfg, x, pool, backend="xla")
    y2, new2 = K.decode(p, cfg, x, pool, slots=jnp.arange(3), backend="xla")
    _same(y2, y, "xla", "y")
    _same(new2.recurrent, new.recurrent, "xla", "state")


def test_donated_pool_is_updated_in_place_xla(rng):
    """With the pool donated, the xla backend's scatter writes into it: the compiled program
    aliases the pool to the new pool, and the results hold."""
    cfg, p, pool, slots, kx = _setup(rng, 3, 8)
    x = jax.random.normal(kx, (3, cfg.hidden))
    want = K.decode(p, cfg, x, pool, slots=slots, backend="xla")
    fn = jax.jit(lambda s, sl: K.decode(p, cfg, x, s, slots=sl, backend="xla"), donate_argnums=0)
    hlo = fn.lower(pool, slots).compile().as_text()
    assert "input_output_alias" in hlo
    got = fn(jax.tree.map(jnp.copy, pool), slots)
    _same(got[0], want[0], "xla", "y")
    _same(got[1].recurrent, want[1].recurrent, "xla", "pool")


def test_pallas_pool_donation_lowers_to_in_place_kernels():
    """Cross-lowered for the H200 (Kimi-Linear): the recurrent kernel and decode_front alias
    the pools they are given (operand -> output), and the jit hands the donated pools to the
    results (`tf.aliasing_output`), so no copy of the [N, H, K, V] pool is needed."""
    cfg = K.preset("kimi-linear-48b")
    p = jax.eval_shape(lambda: K.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    b, n = 8, 16
    pool = jax.eval_shape(lambda: K.KdaState.zeros(cfg, n))
    x = jax.ShapeDtypeStruct((b, cfg.hidden), jnp.bfloat16)
    slots = jax.ShapeDtypeStruct((b,), jnp.int32)
    fn = lambda s, sl, x, p: K.decode(p, cfg, x, s, slots=sl, backend="pallas", interpret=False)  # noqa: E731
    text = lower_for_h200(fn, pool, slots, x, p, donate_argnums=0)
    assert text.count("tf.aliasing_output") == 2, "both pool leaves donated to the results"
    for name in ("kda_recurrent", "kda_decode_front"):
        assert name in text
    assert len(re.findall(r"output_operand_aliases", text)) >= 2


@pytest.mark.parametrize(
    "b,k,n",
    [(1, 1, 2), (64, 1, 128), (64, 4, 128), (256, 1, 512), (4096, 1, 8192), (1024, 4, 2048)],
)
def test_pallas_decode_lowers_for_h200_at_any_batch(b, k, n):
    """Kimi-Linear decode (k = 1) and verify from a pool, up to 4096 rows: each size takes its
    own path (the fused front up to 64 rows, XLA's GEMMs and a conv launch above)."""
    cfg = K.preset("kimi-linear-48b")
    p = jax.eval_shape(lambda: K.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    pool = jax.eval_shape(lambda: K.KdaState.zeros(cfg, n))
    slots = jax.ShapeDtypeStruct((b,), jnp.int32)
    kw = dict(backend="pallas", interpret=False)
    if k == 1:
        x = jax.ShapeDtypeStruct((b, cfg.hidden), jnp.bfloat16)
        fn = lambda s, sl, x, p: K.decode(p, cfg, x, s, slots=sl, **kw)  # noqa: E731
    else:
        x = jax.ShapeDtypeStruct((b, k, cfg.hidden), jnp.bfloat16)
        fn = lambda s, sl, x, p: K.decode_k(p, cfg, x, s, slots=sl, **kw)  # noqa: E731
    text = lower_for_h200(fn, pool, slots, x, p)
    assert "kda_recurrent" in text
    front = "kda_decode_front" if b * k <= 64 else "kda_conv_decode"
    assert front in text


def test_pallas_prefill_pool_lowers_for_h200():
    cfg = K.preset("kimi-linear-48b")
    p = jax.eval_shape(lambda: K.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    pool = jax.eval_shape(lambda: K.KdaState.zeros(cfg, 8))
    x = jax.ShapeDtypeStruct((2, 128, cfg.hidden), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    slots = jax.ShapeDtypeStruct((2,), jnp.int32)
    fn = lambda s, x, ln, sl, p: K.prefill(  # noqa: E731
        p, cfg, x, s, ln, slots=sl, backend="pallas", interpret=False
    )
    text = lower_for_h200(fn, pool, x, lengths, slots, p, donate_argnums=0)
    assert "kda_chunk_scan" in text and text.count("tf.aliasing_output") == 2


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4])
def test_pallas_pool_decode_k_equals_serial_pool_decode(k, rng):
    """decode_k from a pool equals k serial pool decodes (bit for bit compiled, B * k <= 8)."""
    cfg, p, pool, slots, kx = _setup(rng, 2, 5, pad=0)
    x = jax.random.normal(kx, (2, k, cfg.hidden))
    y, last, snaps = K.decode_k(p, cfg, x, pool, slots=slots, backend="pallas")
    st = pool
    for i in range(k):
        yi, st = K.decode(p, cfg, x[:, i], st, slots=slots, backend="pallas")
        assert_same_program(y[:, i], yi, f"row {i} y")
        assert_same_program(snaps.recurrent[:, i], st.recurrent[slots], f"snap {i}")
    assert_same_program(last.recurrent, st.recurrent, "pool after the last row")
    assert_same_program(last.conv, st.conv, "conv pool after the last row")


def test_module_takes_slots(rng):
    from flax import nnx

    cfg = K.preset("tiny")
    blk = K.KimiDeltaAttention(cfg, rngs=nnx.Rngs(0), backend="xla", dtype=jnp.float32)
    pool = _pool(cfg, rng, 5)
    slots = jnp.array([3, -1], jnp.int32)
    x = jax.random.normal(rng, (2, 4, cfg.hidden))
    y, new = blk.prefill(x, pool, slots=slots)
    y1, new1 = blk.decode(x[:, 0], new, slots=slots)
    yk, newk, _ = blk.decode_k(x[:, :2], new1, slots=slots)
    want = K.decode_k(  # at the module's precision ("default": TF32 on a GPU)
        blk.params(), cfg, x[:, :2], new1, slots=slots, backend="xla", precision=blk.precision
    )
    np.testing.assert_array_equal(yk, want[0])
    np.testing.assert_array_equal(newk.recurrent, want[1].recurrent)
    assert newk.recurrent.shape[0] == 5 and not np.asarray(y[1]).any()


@pytest.mark.gpu(reason="compiled kernels: the pool path's bits against the dense path's")
@pytest.mark.parametrize("entry", ["decode", "decode_k", "prefill"])
def test_compiled_pool_equals_dense_bit_for_bit(entry, rng):
    assert ON_GPU
    _run("pallas", 8, 32, entry, rng, k=4, t=200)


def _core_args(key, b, r, n, h=2, kd=32):
    ks = jax.random.split(key, 10)
    unit = lambda a: a / jnp.linalg.norm(a, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (b, r, h, kd)))
    k = unit(jax.random.normal(ks[1], (b, r, h, kd)))
    v = jax.random.normal(ks[2], (b, r, h, kd))
    f, z = (jax.random.normal(ks[i], (b, r, h * kd)) for i in (3, 4))
    beta = jax.random.normal(ks[5], (b, r, h))
    pool = 0.1 * jax.random.normal(ks[6], (n, h, kd, kd))
    a_log = 0.1 * jax.random.normal(ks[7], (h,))
    dt = jax.random.normal(ks[8], (h * kd,))
    w = 1.0 + 0.1 * jax.random.normal(ks[9], (kd,))
    return (q, k, v, f, beta, z, pool, a_log, dt, w)


@pytest.mark.parametrize("block_v", [32, 16], ids=["fused-norm", "o_norm-after"])
def test_decode_core_pool_matches_reference(block_v, rng):
    """The recurrent kernel on a pool, both epilogues (the o_norm kernel after it takes the
    padding and refused rows' fill as its `keep`)."""
    from pallas_kernels.recurrent import RecurrentBlockSizes, decode_core
    from pallas_kernels.reference import decode_core_reference

    args = _core_args(rng, 4, 2, 6)
    slots = jnp.array([5, -1, 0, -2], jnp.int32)
    kw = dict(scale=32**-0.5, lower_bound=None, eps=1e-5, snapshots=True, out_dtype=jnp.float32)
    blk = RecurrentBlockSizes.with_block_v(32, block_v)
    got = decode_core(*args, **kw, slots=slots, block_sizes=blk)
    want = decode_core_reference(*args, **kw, slots=slots)
    for g, w, name in ((got[0], want[0], "y"), (got[2], want[2], "snaps")):
        assert_close(g[jnp.array([0, 2])], w[jnp.array([0, 2])], FP32_TOL, name)
        assert np.isnan(np.asarray(g[3])).all() and not np.asarray(g[1]).any(), name
    assert_close(got[1], want[1], FP32_TOL, "pool")
    np.testing.assert_array_equal(got[1][1:5], args[6][1:5], err_msg="untouched slots")


def test_conv_decode_pool_with_several_programs_per_tile(rng):
    """R = 5 rows (two programs per channel tile, the second not reading the state) on a pool."""
    from pallas_kernels.conv import conv_decode
    from pallas_kernels.reference import conv_decode_reference

    kx, ks, kw_ = jax.random.split(rng, 3)
    x = jax.random.normal(kx, (3, 5, 192))
    pool = jax.random.normal(ks, (4, 3, 192))
    w = jax.random.normal(kw_, (192, 4))
    slots = jnp.array([3, -1, 1], jnp.int32)
    kw = dict(qk_channels=128, head_dim=32, l2_eps=1e-6, snapshots=True, slots=slots)
    got = conv_decode(x, pool, w, **kw)
    want = conv_decode_reference(x, pool, w, **kw)
    real = jnp.array([0, 2])
    assert_close(got[0][real], want[0][real], FP32_TOL, "out")
    assert not np.asarray(got[0][1]).any() and not np.asarray(got[2][1]).any()
    np.testing.assert_array_equal(got[1], want[1])  # raw inputs copied: exact
    np.testing.assert_array_equal(got[2], want[2])


def test_pool_kernels_lower_for_h200():
    """The pool paths of the recurrent kernel (both epilogues, a verify's snapshots) and of
    conv_decode (several programs per tile) in the Kimi-Linear geometry."""
    from pallas_kernels.conv import conv_decode
    from pallas_kernels.recurrent import RecurrentBlockSizes, decode_core

    sds = jax.ShapeDtypeStruct
    b, r, n, h, kd = 4, 8, 9, 32, 128
    f32 = jnp.float32
    core = (
        *(sds((b, r, h, kd), f32) for _ in range(3)),
        sds((b, r, h * kd), f32),
        sds((b, r, h), f32),
        sds((b, r, h * kd), f32),
        sds((n, h, kd, kd), f32),
        sds((h,), f32),
        sds((h * kd,), f32),
        sds((kd,), f32),
        sds((b,), jnp.int32),
    )
    for bv in (128, 32):

        def fn(*a, bv=bv):
            blk = RecurrentBlockSizes.with_block_v(kd, bv)
            kw = dict(scale=kd**-0.5, lower_bound=-5.0, eps=1e-5, snapshots=True)
            return decode_core(*a[:-1], **kw, slots=a[-1], block_sizes=blk, interpret=False)

        assert "kda_recurrent" in lower_for_h200(fn, *core)
    conv = (sds((b, r, 12288), jnp.bfloat16), sds((n, 3, 12288), f32), sds((12288, 4), f32))
    fn = lambda x, s, w, sl: conv_decode(  # noqa: E731
        x,
        s,
        w,
        qk_channels=8192,
        head_dim=128,
        l2_eps=1e-6,
        splits=(4096,) * 3,
        snapshots=True,
        slots=sl,
        interpret=False,
    )
    assert "kda_conv_decode" in lower_for_h200(fn, *conv, sds((b,), jnp.int32))
