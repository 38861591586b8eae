"""prefill_packed: N sequences back to back in one stream (`cu_seqlens`) against each sequence's
own prefill, on both backends.

Every case packs lengths 0, 1, C - 1, C, C + 1 and one off the chunk grid, from carried states,
with NaN or huge values in the padding past cu_seqlens[N]; the reference is `prefill` of the
same sequences as rows of one padded batch (which test_forward.py holds to the oracle). The
pallas kernels run in interpret mode at the tiny geometry on a CPU; the Kimi-Linear geometry is
cross-lowered for the H200.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    ON_GPU,
    TOL,
    assert_close,
    assert_same_program,
    block_setup,
    lower_for_h200,
    normal,
)

import kda_jax as K
from kda_jax import forward

FP32_TOL = TOL["fp32_gpu"] if ON_GPU else TOL["fp32_cpu"]
CONV_TOL = TOL["conv_state_vs_oracle"]  # raw projections of one dot in another batch shape


_setup = block_setup


def _edge_lengths(cfg):
    c = cfg.chunk
    return [c - 1, 0, 1, 2 * c + 5, c, c + 1]


def _pack(key, cfg, lengths, pad=7, poison=jnp.nan, dtype=jnp.float32):
    """x [T, D] holding the sequences back to back and `pad` poisoned tokens after them."""
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    x = normal(key, (int(cu[-1]) + pad, cfg.hidden))
    return x.at[int(cu[-1]) :].set(poison).astype(dtype), jnp.asarray(cu)


def _bounds(cu):
    """[(start, end)] of each sequence, as ints."""
    cu = [int(v) for v in np.asarray(cu)]
    return list(zip(cu[:-1], cu[1:], strict=True))


def _padded(x, cu):
    """The same sequences as rows of one zero-padded batch, with their lengths."""
    lengths = np.diff(np.asarray(cu))
    t = max(1, int(lengths.max()))
    rows = [jnp.pad(x[a:b], ((0, t - (b - a)), (0, 0))) for a, b in _bounds(cu)]
    return jnp.stack(rows), jnp.asarray(lengths, jnp.int32)


def _rows(state, rows):
    return jax.tree.map(lambda a: a[jnp.asarray(rows)], state)


def _assert_matches_padded(y, s, yp, sp, cu, what=""):
    """Packed outputs and states against the padded batch's, sequence by sequence."""
    for i, (a, b) in enumerate(_bounds(cu)):
        if b > a:
            assert_close(y[a:b], yp[i, : b - a], FP32_TOL, f"{what} sequence {i} y")
    assert_close(s.recurrent, sp.recurrent, FP32_TOL, f"{what} recurrent states")
    np.testing.assert_allclose(s.conv, sp.conv, **CONV_TOL, err_msg=f"{what} conv states")


@pytest.mark.parametrize(
    "backend,name,poison",
    [
        ("xla", "tiny", jnp.nan),
        ("xla", "tiny-bounded", 1e30),
        ("pallas", "tiny-bounded", jnp.nan),
        pytest.param("pallas", "tiny", 1e30, marks=pytest.mark.slow),
    ],
)
def test_packed_equals_each_sequence_prefilled_alone(backend, name, poison, rng):
    """Lengths C - 1, 0, 1, 2C + 5, C, C + 1 from carried states, poisoned padding: each
    sequence's outputs and new state equal its own prefill's; a length-0 sequence keeps its
    state's bits; padding outputs exactly 0 and nothing is NaN."""
    lengths = _edge_lengths(K.preset(name))
    cfg, p, s0, key = _setup(name, rng, len(lengths))
    x, cu = _pack(key, cfg, lengths, poison=poison)
    y, s = K.prefill_packed(p, cfg, x, cu, s0, backend=backend)
    assert y.shape == x.shape and y.dtype == p.dtype
    for leaf in (y, s.recurrent, s.conv):
        assert np.all(np.isfinite(np.asarray(leaf))), "NaN or inf leaked"
    assert not np.asarray(y[int(cu[-1]) :]).any(), "padding outputs must be 0"
    xp, lens = _padded(x, cu)
    yp, sp = K.prefill(p, cfg, xp, s0, lens, backend=backend)
    _assert_matches_padded(y, s, yp, sp, cu)
    empty = lengths.index(0)
    np.testing.assert_array_equal(s.recurrent[empty], s0.recurrent[empty])
    np.testing.assert_array_equal(s.conv[empty], s0.conv[empty])


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_prefix_states_equal_the_states_after_each_prefix(backend, rng):
    """prefix_block = C: row cu[i] + j of the prefix states is sequence i's state after
    (j + 1) C tokens (the prefill of that prefix alone), the offsets count L_i // C rows per
    sequence, rows past them are 0, and y and the new state are those of the plain call."""
    cfg = K.preset("tiny-bounded")
    c = cfg.chunk
    lengths = [2 * c + 5, 0, c, 3 * c]
    _, p, s0, key = _setup("tiny-bounded", rng, len(lengths))
    x, cu = _pack(key, cfg, lengths)
    y, s, pre = K.prefill_packed(p, cfg, x, cu, s0, prefix_block=c, backend=backend)
    y0, s_plain = K.prefill_packed(p, cfg, x, cu, s0, backend=backend)
    assert_close(y, y0, TOL["same_path_fp32"], "y with and without prefix states")
    assert_close(s.recurrent, s_plain.recurrent, TOL["same_path_fp32"], "new states")
    counts = [n // c for n in lengths]
    np.testing.assert_array_equal(pre.cu, np.concatenate([[0], np.cumsum(counts)]))
    m = x.shape[0] // c
    assert pre.states.recurrent.shape == (m, *cfg.recurrent_state_shape(1)[1:])
    assert pre.states.conv.shape == (m, *cfg.conv_state_shape(1)[1:])
    entries = [(i, j) for i, n in enumerate(counts) for j in range(n)]
    prefixes = [x[int(cu[i]) : int(cu[i]) + (j + 1) * c] for i, j in entries]
    xp = jnp.stack([jnp.pad(a, ((0, 3 * c - a.shape[0]), (0, 0))) for a in prefixes])
    lens = jnp.asarray([a.shape[0] for a in prefixes], jnp.int32)
    _, want = K.prefill(p, cfg, xp, _rows(s0, [i for i, _ in entries]), lens, backend=backend)
    held = len(entries)
    assert_close(pre.states.recurrent[:held], want.recurrent, FP32_TOL, "prefix states")
    np.testing.assert_allclose(pre.states.conv[:held], want.conv, **CONV_TOL)
    assert not np.asarray(pre.states.recurrent[held:]).any()
    assert not np.asarray(pre.states.conv[held:]).any()


def test_prefix_block_of_two_chunks_xla(rng):
    """prefix_block = 2C on the xla backend: the state after 2C tokens, none for shorter ones."""
    cfg = K.preset("tiny")
    c = cfg.chunk
    lengths = [4 * c + 1, 2 * c - 1, 2 * c]
    _, p, s0, key = _setup("tiny", rng, len(lengths))
    x, cu = _pack(key, cfg, lengths, pad=0)
    _, _, pre = K.prefill_packed(p, cfg, x, cu, s0, prefix_block=2 * c, backend="xla")
    np.testing.assert_array_equal(pre.cu, [0, 2, 2, 3])
    _, want = K.prefill(p, cfg, x[None, : 4 * c], _rows(s0, [0]), backend="xla")
    assert_close(pre.states.recurrent[1:2], want.recurrent, FP32_TOL, "sequence 0, 4C tokens")
    _, want = K.prefill(p, cfg, x[None, int(cu[2]) : int(cu[3])], _rows(s0, [2]), backend="xla")
    assert_close(pre.states.recurrent[2:3], want.recurrent, FP32_TOL, "sequence 2, 2C tokens")
    assert not np.asarray(pre.states.recurrent[3:]).any()


def _same(got, want, backend, what):
    if backend == "pallas":
        assert_same_program(got, want, what)
    else:
        assert_close(got, want, TOL["same_path_fp32"], what)


@pytest.mark.parametrize("backend", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_packed_from_a_pool(backend, rng):
    """slots [4]: each sequence reads and writes its slot (the pallas scan in place); slot -1 is
    a padding sequence (outputs 0, writes nothing); the other slots keep their bits; the named
    ones equal the dense call's new states."""
    cfg = K.preset("tiny")
    c = cfg.chunk
    lengths = [c + 3, 4, 0, 2 * c]
    _, p, pool, key = _setup("tiny", rng, 7)
    x, cu = _pack(key, cfg, lengths)
    slots = jnp.asarray([5, -1, 2, 0], jnp.int32)
    y, new = K.prefill_packed(p, cfg, x, cu, pool, slots=slots, backend=backend)
    dense = _rows(pool, jnp.maximum(slots, 0))
    yd, nd = K.prefill_packed(p, cfg, x, cu, dense, backend=backend)
    real = [i for i in range(4) if slots[i] >= 0]
    for i in real:
        a, b = int(cu[i]), int(cu[i + 1])
        if b > a:
            _same(y[a:b], yd[a:b], backend, f"sequence {i} y")
        for name in ("recurrent", "conv"):
            got, want = getattr(new, name)[slots[i]], getattr(nd, name)[i]
            _same(got, want, backend, f"sequence {i} {name}")
    assert not np.asarray(y[int(cu[1]) : int(cu[2])]).any(), "a padding sequence outputs 0"
    for row in (1, 3, 4, 6):
        np.testing.assert_array_equal(new.recurrent[row], pool.recurrent[row])
        np.testing.assert_array_equal(new.conv[row], pool.conv[row])


def test_repeated_slot_under_jit_writes_once_and_outputs_nan(rng):
    """Traced slots cannot be checked: the second sequence naming a slot reads and writes
    nothing and outputs NaN; the first is unaffected."""
    cfg = K.preset("tiny")
    _, p, pool, key = _setup("tiny", rng, 4)
    x, cu = _pack(key, cfg, [9, 6], pad=0)
    fn = jax.jit(lambda x, cu, s, sl: K.prefill_packed(p, cfg, x, cu, s, slots=sl, backend="xla"))
    y, new = fn(x, cu, pool, jnp.asarray([3, 3], jnp.int32))
    assert np.isnan(np.asarray(y[9:])).all() and np.isfinite(np.asarray(y[:9])).all()
    y1, n1 = K.prefill_packed(p, cfg, x[:9], cu[:2], _rows(pool, [3]), backend="xla")
    _same(y[:9], y1, "xla", "the first sequence")
    _same(new.recurrent[3], n1.recurrent[0], "xla", "slot 3 holds the first sequence's state")
    np.testing.assert_array_equal(new.recurrent[:3], pool.recurrent[:3])


@pytest.mark.parametrize("backend", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_a_nonfinite_token_or_state_poisons_its_own_sequence_only(backend, rng):
    """A NaN in token 5 of sequence 1: its outputs from there on and its new state are NaN,
    its earlier outputs unchanged. An inf in sequence 2's carried conv state: all its outputs
    and its state are NaN. Sequence 0 and the padding are untouched."""
    cfg = K.preset("tiny")
    c = cfg.chunk
    lengths = [c + 2, 2 * c, c - 3]
    _, p, s0, key = _setup("tiny", rng, 3)
    x, cu = _pack(key, cfg, lengths)
    y0, st0 = K.prefill_packed(p, cfg, x, cu, s0, backend=backend)
    a1 = int(cu[1])
    xb = x.at[a1 + 5, 7].set(jnp.nan)
    sb = s0.replace(conv=s0.conv.at[2, 1, 11].set(jnp.inf))
    y, st = K.prefill_packed(p, cfg, xb, cu, sb, backend=backend)
    assert_close(y[: cu[1]], y0[: cu[1]], FP32_TOL, "sequence 0 y")
    assert_close(st.recurrent[0], st0.recurrent[0], FP32_TOL, "sequence 0 state")
    assert_close(y[a1 : a1 + 5], y0[a1 : a1 + 5], FP32_TOL, "sequence 1 before the NaN")
    assert np.isnan(np.asarray(y[a1 + 5 : cu[3]])).all(), "NaN from the bad token on"
    for leaf in (st.recurrent[1:], st.conv[1:]):
        assert np.isnan(np.asarray(leaf)).all()
    assert not np.asarray(y[int(cu[3]) :]).any(), "padding outputs 0"


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_a_nonfinite_token_poisons_its_own_slot_only(backend, rng):
    """From a pool: a NaN in token 5 of sequence 1 leaves NaN states at its slot only (written by
    the state pass on the kernel path); sequence 0's slot holds its state and the untouched
    slots keep their bits."""
    cfg = K.preset("tiny")
    c = cfg.chunk
    lengths = [c + 2, 2 * c]
    _, p, s0, key = _setup("tiny", rng, 2)
    pool = jax.tree.map(lambda a: jnp.concatenate([a, 2 * a, 3 * a]), s0)  # 6 slots
    slots = jnp.array([4, 1], jnp.int32)
    x, cu = _pack(key, cfg, lengths)
    x = x.at[int(cu[1]) + 5, 3].set(jnp.nan)
    y0, st0 = K.prefill_packed(
        p, cfg, x, cu, jax.tree.map(lambda a: a[slots], pool), backend=backend
    )
    y, st = K.prefill_packed(p, cfg, x, cu, pool, slots=slots, backend=backend)
    for name in ("recurrent", "conv"):
        got, old, want = (np.asarray(getattr(t, name)) for t in (st, pool, st0))
        assert np.isnan(got[1]).all() and np.isnan(want[1]).all(), f"{name} of the bad sequence"
        assert_close(got[4], want[0], FP32_TOL, f"{name} of sequence 0 at its slot")
        np.testing.assert_array_equal(got[[0, 2, 3, 5]], old[[0, 2, 3, 5]], err_msg=name)
    bad = int(cu[1]) + 5
    assert np.isnan(np.asarray(y[bad : cu[2]])).all(), "NaN from the bad token on"
    assert_close(y[:bad], y0[:bad], FP32_TOL, "outputs before it, as from the gathered states")


@pytest.mark.parametrize("name", ["tiny", pytest.param("tiny-bounded", marks=pytest.mark.slow)])
def test_packed_training_gradients(name, rng):
    """jax.grad through the xla packed prefill equals the sum of each sequence's own prefill
    gradients (weights, x, states); a loss on one sequence has exactly zero gradient on every
    other sequence's tokens and states."""
    cfg = K.preset(name)
    c = cfg.chunk
    lengths = [c + 3, 5, 2 * c]
    _, p, s0, key = _setup(name, rng, 3)
    x, cu = _pack(key, cfg, lengths, pad=4, poison=jnp.nan)
    proj = normal(jax.random.fold_in(key, 1), (cfg.hidden,))
    bounds = _bounds(cu)

    def loss_terms(y, st):
        return jnp.sum(jnp.tanh(y @ proj)) + jnp.sum(st.recurrent**2) + jnp.sum(st.conv**2)

    def packed(p, x, s):
        return loss_terms(*K.prefill_packed(p, cfg, x, cu, s, backend="xla"))

    def alone(p, x, s):
        total = 0.0
        for i, (a, b) in enumerate(bounds):
            y, st = K.prefill(p, cfg, x[None, a:b], _rows(s, [i]), backend="xla")
            total += loss_terms(y, st)
        return total

    got = jax.grad(packed, argnums=(0, 1, 2))(p, x, s0)
    want = jax.grad(alone, argnums=(0, 1, 2))(p, x, s0)
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        assert_close(g, w, FP32_TOL, jax.tree_util.keystr(path))
    assert not np.asarray(got[1][int(cu[-1]) :]).any(), "no gradient on the padding"

    def one(x, s):
        y, _ = K.prefill_packed(p, cfg, x, cu, s, backend="xla")
        return jnp.sum(jnp.tanh(y[bounds[1][0] : bounds[1][1]] @ proj))

    gx, gs = jax.grad(one, argnums=(0, 1))(x, s0)
    inside = np.zeros(x.shape[0], bool)
    inside[bounds[1][0] : bounds[1][1]] = True
    assert np.asarray(gx[inside]).any()
    assert not np.asarray(gx[~inside]).any(), "gradient leaked to another sequence's tokens"
    for name_, leaf in (("recurrent", gs.recurrent), ("conv", gs.conv)):
        assert np.asarray(leaf[1]).any(), name_
        assert not np.asarray(leaf[jnp.asarray([0, 2])]).any(), f"{name_} leaked"


def test_bf16_packed_meets_the_bf16_bar_against_the_oracle(rng):
    """bf16 weights and activations, states from the oracle (so the conv state rows are
    projections, exact in bf16): each sequence against the fp32 oracle within SPEC's 1e-2."""
    lengths = [21, 40, 7]
    cfg, p, s0, key = _setup("tiny", rng, 3, jnp.bfloat16)
    x, cu = _pack(key, cfg, lengths, dtype=jnp.bfloat16)
    y, s = K.prefill_packed(p, cfg, x, cu, s0, backend="xla")
    assert y.dtype == jnp.bfloat16
    for i, (a, b) in enumerate(_bounds(cu)):
        y_ref, s_ref, _ = K.oracle_forward(p, cfg, x[None, a:b], _rows(s0, [i]))
        assert_close(y[a:b], y_ref[0], TOL["bf16_e2e"], f"sequence {i} y")
        assert_close(s.recurrent[i], s_ref.recurrent[0], TOL["bf16_e2e"], f"sequence {i} state")


def test_one_compilation_serves_every_cu_seqlens_and_traced_offsets_are_clipped(rng):
    """Under jit cu_seqlens is traced: one program for every offsets vector of N + 1 entries.
    Traced offsets that break the contract are clipped to [0, T] and made non-decreasing:
    [3, 10, 5, 99] acts as [3, 10, 10, 40], tokens before 3 being padding."""
    cfg, p, s0, key = _setup("tiny", rng, 3)
    x = normal(key, (40, cfg.hidden))
    fn = jax.jit(lambda x, cu, s: K.prefill_packed(p, cfg, x, cu, s, backend="xla"))
    for cu in ([0, 10, 10, 40], [0, 1, 30, 33], [0, 0, 0, 40]):
        fn(x, jnp.asarray(cu, jnp.int32), s0)
    assert fn._cache_size() == 1
    y, s = fn(x, jnp.asarray([3, 10, 5, 99], jnp.int32), s0)
    cu_fixed = jnp.asarray([0, 7, 7, 37])
    y_eager, s_eager = K.prefill_packed(p, cfg, x[3:], cu_fixed, s0, backend="xla")
    assert not np.asarray(y[:3]).any()
    assert_close(y[3:], y_eager, TOL["same_path_fp32"], "y")
    assert_close(s.recurrent, s_eager.recurrent, TOL["same_path_fp32"], "states")


def test_no_token_keeps_every_state(rng):
    """N = 0, T = 0, and sequences all of length 0: outputs 0, states as given."""
    cfg, p, s0, key = _setup("tiny", rng, 2)
    x = normal(key, (6, cfg.hidden))
    y, s = K.prefill_packed(p, cfg, x, jnp.asarray([0]), K.KdaState.zeros(cfg, 0))
    assert y.shape == (6, cfg.hidden) and not np.asarray(y).any() and s.recurrent.shape[0] == 0
    y, s = K.prefill_packed(p, cfg, x[:0], jnp.asarray([0, 0, 0]), s0)
    assert y.shape == (0, cfg.hidden)
    np.testing.assert_array_equal(s.recurrent, s0.recurrent)
    y, s, pre = K.prefill_packed(p, cfg, x, jnp.asarray([0, 0, 0]), s0, prefix_block=16)
    assert not np.asarray(y).any() and pre.states.recurrent.shape[0] == 0
    np.testing.assert_array_equal(s.recurrent, s0.recurrent)
    np.testing.assert_array_equal(s.conv, s0.conv)


def test_bad_arguments_raise_before_any_work(rng):
    cfg, p, s0, key = _setup("tiny", rng, 2)
    x = normal(key, (10, cfg.hidden))
    cu = jnp.asarray([0, 4, 10])
    run = functools.partial(K.prefill_packed, p, cfg)
    cases = [
        ((x, jnp.asarray([0.0, 4.0, 10.0]), s0), {}, r"cu_seqlens has shape \(3,\) and dtype f"),
        ((x, jnp.zeros((2, 3), jnp.int32), s0), {}, r"expected \[N \+ 1\] integers"),
        ((x, jnp.zeros((0,), jnp.int32), s0), {}, r"cu_seqlens has shape \(0,\)"),
        ((x, jnp.asarray([1, 4, 10]), s0), {}, "cu_seqlens starts at 1, expected 0"),
        ((x, jnp.asarray([0, 6, 4]), s0), {}, r"decreases at index 2 \(6 -> 4\)"),
        ((x, jnp.asarray([0, 4, 11]), s0), {}, "ends at 11, past the T=10 tokens"),
        ((x[None], cu, s0), {}, r"x has shape \(1, 10, 96\), expected \[T, D\]"),
        ((x, cu, K.KdaState.zeros(cfg, 3)), {}, r"state.recurrent has shape \(3,"),
        ((x, cu, s0), dict(slots=jnp.asarray([0, 1, 2])), r"slots has shape \(3,\)"),
        ((x, cu, s0), dict(slots=jnp.asarray([1, 1])), r"slots \[1\] are named by more"),
    ]
    for bad in (0, 24, True, 16.0):
        cases.append(((x, cu, s0), dict(prefix_block=bad), "positive multiple of chunk=16"))
    for args, kw, msg in cases:
        with pytest.raises((ValueError, TypeError), match=msg):
            run(*args, **kw)


def test_module_prefill_packed_equals_the_functional_core(rng):
    from flax import nnx

    cfg = K.preset("tiny")
    blk = K.KimiDeltaAttention(cfg, rngs=nnx.Rngs(0), backend="xla", dtype=jnp.float32)
    x, cu = _pack(rng, cfg, [5, 0, 18])
    s0 = blk.init_state(3)
    y, s, pre = blk.prefill_packed(x, cu, s0, prefix_block=16)
    kw = dict(backend="xla", precision=blk.precision)  # the module's ("default": TF32 on a GPU)
    want = K.prefill_packed(blk.params(), cfg, x, cu, s0, prefix_block=16, **kw)
    np.testing.assert_array_equal(y, want[0])
    np.testing.assert_array_equal(s.recurrent, want[1].recurrent)
    np.testing.assert_array_equal(pre.states.recurrent, want[2].states.recurrent)
    y, new = blk.prefill_packed(x, cu, blk.init_state(4), slots=jnp.asarray([3, 0, -1]))
    assert new.recurrent.shape[0] == 4
    assert np.asarray(y[:5]).any() and not np.asarray(y[5:]).any(), "slot -1 outputs 0"


@pytest.mark.parametrize("gate", ["", "-bounded"], ids=["unbounded", "bounded"])
@pytest.mark.parametrize("prefix", [None, 256])
def test_pallas_packed_lowers_for_h200(gate, prefix):
    """Kimi-Linear geometry, bf16, a donated pool with slots, 1000 tokens of 4 sequences: the
    packed path's kernels build for the H200 and the pool is updated in place."""
    cfg = K.preset("kimi-linear-48b" + gate)
    p = jax.eval_shape(lambda: K.init_params(cfg, jax.random.key(0), jnp.bfloat16))
    pool = jax.eval_shape(lambda: K.KdaState.zeros(cfg, 8))
    sds = jax.ShapeDtypeStruct
    x, cu, slots = sds((1000, cfg.hidden), jnp.bfloat16), sds((5,), jnp.int32), sds((4,), jnp.int32)

    def fn(s, x, cu, sl, p):
        kw = dict(slots=sl, prefix_block=prefix, backend="pallas", interpret=False)
        return K.prefill_packed(p, cfg, x, cu, s, **kw)

    text = lower_for_h200(fn, pool, x, cu, slots, p, donate_argnums=0)
    for name in ("kda_conv_prefill", "kda_chunk_diag", "kda_chunk_scan", "kda_o_norm"):
        assert name in text, name
    assert text.count("tf.aliasing_output") == 2, "both pool leaves donated to the results"


def test_packed_rows_bound():
    """The stream holds T tokens of N sequences whatever their lengths: a leading chunk, and per
    sequence its tokens plus W-1 rows rounded up to chunks."""
    cfg = K.preset("tiny")
    c, w = cfg.chunk, cfg.conv_kernel
    for t, lengths in ((100, [100]), (100, [0] * 5), (100, [1] * 100), (64, [c - w + 2] * 4)):
        need = c + sum(c * -(-(n + w - 1) // c) for n in lengths)
        assert need <= forward.packed_rows(t, len(lengths), cfg)
