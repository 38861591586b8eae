"""Run-to-run determinism: the same inputs give the same bits, call after call.

On a GPU (compiled kernels, Kimi-Linear geometry) this is what a serving engine relies on to
replay a request; on a CPU it checks the xla path and the kernels in interpret mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU

import kda_jax as K

GATES = ["kimi-linear-48b", "kimi-linear-48b-bounded"] if ON_GPU else ["tiny", "tiny-bounded"]
BACKENDS = ["pallas"] if ON_GPU else ["xla", "pallas"]


def _bits_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", GATES)
def test_same_inputs_same_bits(name, backend, rng):
    cfg = K.preset(name)
    b, t, k = (4, 1000, 8) if ON_GPU else (2, 40, 3)
    k1, k2, k3 = jax.random.split(rng, 3)
    p = K.init_params(cfg, k1, jnp.bfloat16)
    x = jax.random.normal(k2, (b, t, cfg.hidden), jnp.bfloat16)
    lengths = jnp.array([t, t - 17, 1, t // 2][:b])
    s0 = K.KdaState.zeros(cfg, b)
    drafts = jax.random.normal(k3, (1, k, cfg.hidden), jnp.bfloat16)

    def run():
        y, s = K.prefill(p, cfg, x, s0, lengths, backend=backend)
        yd, sd = K.decode(p, cfg, x[:, -1], s, backend=backend)
        one = jax.tree.map(lambda a: a[:1], sd)
        yk, sk, snaps = K.decode_k(p, cfg, drafts, one, backend=backend)
        return jax.block_until_ready((y, s, yd, sd, yk, sk, snaps))

    first = run()
    for _ in range(2):
        _bits_equal(run(), first)
