"""Gradients through the pallas backend: the kernels run forward and the VJP is the xla
backend's (`forward._xla_vjp`), so every gradient must equal the xla path's within the fp32 bar
(the cotangents are formed from the kernels' outputs, which agree with xla's to rounding), and
the xla path's gradients are held to the token-by-token oracle's in test_forward.py."""

from __future__ import annotations

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import ON_GPU, TOL, assert_close, block_setup
from flax import nnx

import kda_jax as K

FP32_TOL = TOL["fp32_gpu"] if ON_GPU else TOL["fp32_cpu"]  # TF32 dots on a GPU
GATES = ["tiny", "tiny-bounded"]
# The module tests' reference is the fp32 xla path with IEEE dots: on a GPU its default TF32
# projections would add their own round-off to the difference the bar measures.
_PRECISION = dict(pallas="default", xla="highest")


_setup = block_setup


def _loss(y, st, proj):
    """A loss whose cotangents depend on the outputs (not a plain sum) and reach the state.
    y @ proj is scaled to O(1): a saturated tanh's fp32 derivative, 1 - tanh^2, is mostly
    round-off, and the two backends' outputs differ by an ulp."""
    arg = y @ proj / y.shape[-1] ** 0.5
    return jnp.sum(jnp.tanh(arg)) + jnp.sum(st.recurrent**2) + jnp.sum(st.conv**2)


def _assert_grads_match(got, want, what):
    leaves = jax.tree_util.tree_leaves_with_path(got)
    assert leaves, f"{what}: no gradient"
    for (path, g), w in zip(leaves, jax.tree.leaves(want), strict=True):
        assert_close(g, w, FP32_TOL, f"{what}{jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("name", GATES)
def test_prefill_gradients_match_xla_with_lengths_and_poisoned_pads(name, rng):
    """Weights, input and carried state, T off the chunk grid, one row shorter than T whose
    pads hold NaN: the pads' gradient is exactly zero and every other one is the xla path's."""
    cfg, p, s0, key = _setup(name, rng)
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (2, 37, cfg.hidden)).at[1, 21:].set(jnp.nan)
    lengths = jnp.array([37, 21])
    proj = jax.random.normal(kw, (cfg.hidden,))

    def loss(backend, p, x, s):
        return _loss(*K.prefill(p, cfg, x, s, lengths, backend=backend), proj)

    grad = lambda b: jax.jit(jax.grad(functools.partial(loss, b), argnums=(0, 1, 2)))  # noqa: E731
    got = grad("pallas")(p, x, s0)
    want = grad("xla")(p, x, s0)
    np.testing.assert_array_equal(got[1][1, 21:], 0.0)
    _assert_grads_match(got, want, "prefill")


def test_decode_and_verify_gradients_match_xla(rng):
    cfg, p, s0, key = _setup("tiny", rng)
    kx, kw = jax.random.split(key)
    x = jax.random.normal(kx, (2, 3, cfg.hidden))
    proj = jax.random.normal(kw, (cfg.hidden,))

    def dec(backend, p, x, s):
        return _loss(*K.decode(p, cfg, x[:, 0], s, backend=backend), proj)

    def ver(backend, p, x, s):
        y, st, snaps = K.decode_k(p, cfg, x, s, backend=backend)
        return _loss(y, st, proj) + jnp.sum(jnp.sin(snaps.recurrent))

    for fn in (dec, ver):
        got = jax.grad(functools.partial(fn, "pallas"), argnums=(0, 1, 2))(p, x, s0)
        want = jax.grad(functools.partial(fn, "xla"), argnums=(0, 1, 2))(p, x, s0)
        _assert_grads_match(got, want, fn.__name__)


def test_pool_and_packed_gradients_match_xla(rng):
    """Prefill from pool slots (a padding row among them) and a packed stream of three
    sequences: gradients of the pool and of every weight as the xla path gives them."""
    cfg, p, s0, key = _setup("tiny", rng, batch=3)
    kx, kw = jax.random.split(key)
    proj = jax.random.normal(kw, (cfg.hidden,))
    x = jax.random.normal(kx, (2, 19, cfg.hidden))
    slots = jnp.array([2, -1])

    def pooled(backend, p, x, s):
        return _loss(*K.prefill(p, cfg, x, s, slots=slots, backend=backend), proj)

    cu = jnp.array([0, 9, 9, 30])
    xs = jax.random.normal(kx, (33, cfg.hidden))

    def packed(backend, p, x, s):
        return _loss(*K.prefill_packed(p, cfg, x, cu, s, backend=backend), proj)

    for fn, inp in ((pooled, x), (packed, xs)):
        got = jax.grad(functools.partial(fn, "pallas"), argnums=(0, 1, 2))(p, inp, s0)
        want = jax.grad(functools.partial(fn, "xla"), argnums=(0, 1, 2))(p, inp, s0)
        _assert_grads_match(got, want, fn.__name__)


@pytest.mark.slow
def test_module_trains_on_pallas_under_remat_as_on_xla(rng):
    """nnx.grad through the module (pallas), the block wrapped in nnx.remat, and three optax
    SGD steps: the losses and the weight updates follow the xla module's within the fp32 bar.
    (SGD, not Adam: Adam scales a near-zero gradient to a full step, so TF32 round-off in a
    gradient would show as a step-sized weight difference.)"""
    cfg = K.preset("tiny-bounded")
    x = jax.random.normal(rng, (2, 24, cfg.hidden))

    def train(backend):
        blk = K.KimiDeltaAttention(
            cfg, rngs=nnx.Rngs(0), backend=backend, dtype=jnp.float32, precision=_PRECISION[backend]
        )
        start = jax.tree.map(jnp.copy, nnx.state(blk, nnx.Param))
        opt = nnx.Optimizer(blk, optax.sgd(0.5), wrt=nnx.Param)

        @nnx.jit
        def step(m, opt):
            loss, g = nnx.value_and_grad(lambda m: jnp.mean(nnx.remat(lambda m: m(x)[0])(m) ** 2))(
                m
            )
            opt.update(m, g)
            return loss

        losses = [float(step(blk, opt)) for _ in range(3)]
        return losses, jax.tree.map(jnp.subtract, nnx.state(blk, nnx.Param), start)

    got_l, got_d = train("pallas")
    want_l, want_d = train("xla")
    assert got_l[-1] < got_l[0], f"loss did not fall: {got_l}"
    np.testing.assert_allclose(got_l, want_l, rtol=FP32_TOL)
    _assert_grads_match(got_d, want_d, "weight updates after 3 steps")


def test_pallas_backward_runs_the_chunk_kernels_once(rng):
    """The pallas backend's backward (padded prefill) runs the chunked core on `chunk_vjp`'s
    kernels: the score kernel forward (both matrices), the scan twice forward (the kernels
    forward, then the recompute that saves the states), and once each the reverse scan, the
    intra-chunk backward and the scores' backward (no XLA-differentiated kernel)."""
    cfg, p, s0, key = _setup("tiny", rng)
    x = jax.random.normal(key, (2, 37, cfg.hidden))
    jaxpr = jax.make_jaxpr(
        jax.grad(lambda x: K.prefill(p, cfg, x, s0, backend="pallas")[0].astype(jnp.float32).sum())
    )(x)
    names = collections.Counter(re.findall(r"name=(kda_chunk_\w+)", str(jaxpr)))
    want = dict(scores=1, scan=2, scan_bwd=1, local_bwd=1, scores_bwd=1)
    assert {k: names[f"kda_chunk_{k}"] for k in want} == want, names


def test_pallas_stage_dict_refuses_gradients_clearly(rng):
    cfg, p, s0, key = _setup("tiny", rng)
    x = jax.random.normal(key, (2, 9, cfg.hidden))
    with pytest.raises(NotImplementedError, match="return_stages=True"):
        jax.grad(lambda x: K.prefill(p, cfg, x, s0, backend="pallas", return_stages=True)[0].sum())(
            x
        )


def test_layer_stack_under_nnx_scan_gradients_match_xla(rng):
    """Two blocks stacked by nnx.vmap and run by nnx.scan (x + block(x), remat per layer): the
    stacked weights' gradients on the pallas backend are the xla backend's."""
    cfg = K.preset("tiny")
    x = jax.random.normal(rng, (2, 21, cfg.hidden))

    def grads(backend):
        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=0, out_axes=0)
        def make(rngs):
            return K.KimiDeltaAttention(
                cfg, rngs=rngs, backend=backend, dtype=jnp.float32, precision=_PRECISION[backend]
            )

        stack = make(nnx.Rngs(0))

        def loss(stack):
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            @nnx.remat
            def layer(blk, h):
                return h + blk(h)[0]

            return jnp.mean(jnp.tanh(layer(stack, x)))

        return nnx.state(nnx.grad(loss)(stack), nnx.Param)

    got, want = grads("pallas"), grads("xla")
    assert jax.tree.leaves(got)[0].shape[0] == 2, "a stacked layer axis"
    _assert_grads_match(got, want, "stack")
