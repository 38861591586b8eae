"""decode_front (conv_decode and the f_b | g_b sweep in one launch) against its reference and
against the two kernels launched apart, bit for bit."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, TOL, assert_close, assert_same_program, lower_for_h200, normal

from pallas_kernels import gemv
from pallas_kernels.conv import conv_decode
from pallas_kernels.front import decode_front
from pallas_kernels.reference import decode_front_reference

# Conv channels C = 3 * H * K (9 head groups on the CPU), low rank L, N projection rows (the
# block's P = H * K; on the CPU 100, a ragged last row tile of the sweep).
B, H, K, W, L = (4, 32, 128, 4, 128) if ON_GPU else (2, 3, 32, 4, 48)
C, QK, P = 3 * H * K, 2 * H * K, H * K
N = P if ON_GPU else 100
KW = dict(qk_channels=QK, head_dim=K, l2_eps=1e-6)
FP32_TOL = TOL["fp32_gpu"] if ON_GPU else TOL["fp32_cpu"]


def _inputs(key, rows):
    kx, ks, kw, ka, kb, kc, kd = jax.random.split(key, 7)
    x = normal(kx, (B, rows, C), jnp.bfloat16)
    state = normal(ks, (B, W - 1, C))
    w = normal(kw, (C, W), scale=0.5).at[:, -1].add(1.0)
    xs = (normal(ka, (B * rows, L), jnp.bfloat16), normal(kb, (B * rows, L), jnp.bfloat16))
    ws = (normal(kc, (N, L), jnp.bfloat16), normal(kd, (N, L), jnp.bfloat16))
    return x, state, w, xs, ws


# 7: three conv programs per tile, one short
@pytest.mark.parametrize(
    "rows", [pytest.param(1, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow), 7]
)
@pytest.mark.parametrize("snapshots", [pytest.param(False, marks=pytest.mark.slow), True])
def test_decode_front_matches_reference_and_the_kernels_apart(rng, rows, snapshots):
    x, state, w, xs, ws = _inputs(rng, rows)
    splits = (P, P, P)
    out, new_state, states, ys = jax.jit(
        lambda *a: decode_front(*a, **KW, splits=splits, snapshots=snapshots)
    )(x, state, w, xs, ws)
    out_r, new_r, states_r, ys_r = decode_front_reference(
        x, state, w, xs, ws, **KW, splits=splits, snapshots=snapshots
    )
    assert len(out) == 3 and all(o.shape == (B, rows, P) for o in out)
    assert len(ys) == 2 and all(y.shape == (B * rows, N) and y.dtype == jnp.bfloat16 for y in ys)
    for i in range(3):
        assert_close(out[i], out_r[i], FP32_TOL, f"conv out {i}")
    np.testing.assert_array_equal(new_state, new_r)  # the conv state is a copy of raw inputs
    if snapshots:
        np.testing.assert_array_equal(states, states_r)
    else:
        assert states is None and states_r is None
    for i in range(2):
        assert_close(ys[i], ys_r[i], TOL["bf16_stage"], f"projection {i}")
    # The same programs as the two launches apart.
    out_a, new_a, states_a = jax.jit(
        lambda *a: conv_decode(*a, **KW, splits=splits, snapshots=snapshots)
    )(x, state, w)
    ys_a = jax.jit(gemv.proj_many)(xs, ws)
    for i in range(3):
        assert_same_program(out[i], out_a[i], f"conv out {i}")
    np.testing.assert_array_equal(new_state, new_a)
    if snapshots:
        np.testing.assert_array_equal(states, states_a)
    for i in range(2):
        assert_same_program(ys[i], ys_a[i], f"projection {i}")


@pytest.mark.parametrize("rows", [1, pytest.param(7, marks=pytest.mark.slow)])
def test_decode_front_updates_the_donated_state_in_place(rng, rows):
    """Decode and verify alike, the kernel's call aliases the new conv state (output 1) to the
    old one (operand 1), so a loop that carries the state needs no copy of it (a verify whose
    new state took a buffer of its own cost 3-8 us a step on the H200)."""
    x, state, w, xs, ws = _inputs(rng, rows)
    want = decode_front_reference(x, state, w, xs, ws, **KW)[1]
    new_state = lambda s, *a, **kw: decode_front(a[0], s, *a[1:], **KW, **kw)[1]  # noqa: E731
    text = lower_for_h200(lambda *a: new_state(*a, interpret=False), state, x, w, xs, ws)
    aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+),", text)
    assert aliases == [("1", "1")], f"the kernel's aliases (output, operand): {aliases}"
    fn = jax.jit(new_state, donate_argnums=0)
    np.testing.assert_array_equal(fn(state + 0.0, x, w, xs, ws), want)


def test_decode_front_refuses_bad_input(rng):
    x, state, w, xs, ws = _inputs(rng, 1)
    with pytest.raises(ValueError, match="as many of each"):
        decode_front(x, state, w, xs, ws[:1], **KW)
    with pytest.raises(ValueError, match="conv_decode: x"):
        decode_front(x, state[:, 1:], w, xs, ws, **KW)
    with pytest.raises(ValueError, match="decode_front: x has shape"):
        decode_front(x, state, w, (xs[0][:, 1:], xs[1][:, 1:]), ws, **KW)
    with pytest.raises(ValueError, match="decode_front: every group needs the same"):
        decode_front(x, state, w, xs, (ws[0], ws[1][:, 1:]), **KW)
    with pytest.raises(ValueError, match="proj_many: x has shape"):  # past 64 rows: apart
        big = jnp.ones((65, L + 1), jnp.bfloat16)
        decode_front(x, state, w, (big, big), ws, **KW)


@pytest.mark.parametrize("batch,rows", [(1, 1), (1, 8), (64, 1)])
def test_decode_front_lowers_for_h200(batch, rows):
    """Kimi-Linear: 12288 conv channels, f_a | g_a [B * R, 128] against f_b | g_b [4096, 128]."""
    m = batch * rows
    x = jnp.ones((batch, rows, 12288), jnp.bfloat16)
    state, w = jnp.ones((batch, 3, 12288)), jnp.ones((12288, 4))
    xs = (jnp.ones((m, 128), jnp.bfloat16),) * 2
    ws = (jnp.ones((4096, 128), jnp.bfloat16),) * 2
    fn = lambda *a: decode_front(  # noqa: E731
        *a,
        qk_channels=8192,
        head_dim=128,
        l2_eps=1e-6,
        splits=(4096,) * 3,
        snapshots=rows > 1,
        interpret=False,
    )
    text = lower_for_h200(fn, x, state, w, xs, ws)
    assert "kda_decode_front" in text and text.count("xla.gpu.triton") == 1


def test_decode_front_adds_a_bias_as_its_reference_does(rng):
    """The output gate's bias (FLA's g_proj.1.bias): added to the fp32 sweep before the one cast,
    on the kernel and in the reference; the other projection has none. Lowers for an H200."""
    x, state, w, xs, ws = _inputs(rng, 2)
    biases = (None, normal(jax.random.fold_in(rng, 1), (N,)))
    run = lambda *a, interpret=None: decode_front(  # noqa: E731
        *a, **KW, biases=biases, interpret=interpret
    )
    _, _, _, ys = jax.jit(run)(x, state, w, xs, ws)
    _, _, _, ys_r = decode_front_reference(x, state, w, xs, ws, **KW, biases=biases)
    _, _, _, ys_nb = decode_front_reference(x, state, w, xs, ws, **KW)
    assert all(y.dtype == jnp.bfloat16 for y in ys)
    for i in range(2):
        assert_close(ys[i], ys_r[i], TOL["bf16_stage"], f"projection {i}")
    np.testing.assert_array_equal(ys_r[0], ys_nb[0])
    assert not np.array_equal(np.asarray(ys_r[1]), np.asarray(ys_nb[1]))
    text = lower_for_h200(lambda *a: run(*a, interpret=False), x, state, w, xs, ws)
    assert "kda_decode_front" in text and text.count("xla.gpu.triton") == 1
