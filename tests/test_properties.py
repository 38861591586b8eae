"""Property-based tests (hypothesis): the block's invariants over random configs and inputs.

Each example draws a config within the validated envelope, B, T, per-row lengths (0, 1, C - 1,
C, C + 1, T), a carried state, either gate, a decay strength from weak to -240 nats per token,
and weights and inputs at realistic scales. Configs and shapes come from small pools so the
compiled functions are reused across examples.

Example counts come from a hypothesis profile: `ci` (the default, a few examples per property,
so the fast tier stays fast) or `nightly` (KDA_HYPOTHESIS_PROFILE=nightly, many more).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, TOL, assert_close, assert_same_program
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kda_jax as K

FP32_TOL = TOL["fp32_gpu"] if ON_GPU else TOL["fp32_cpu"]  # TF32 dots on a GPU

_COMMON = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
settings.register_profile("ci", max_examples=4, **_COMMON)
settings.register_profile("nightly", max_examples=150, **_COMMON)
settings.load_profile(os.environ.get("KDA_HYPOTHESIS_PROFILE", "ci"))
# The pallas backend runs in interpret mode on a CPU: a third of the examples.
PALLAS_EXAMPLES = max(2, settings.default.max_examples // 3)

CONFIGS = [
    K.preset("tiny"),
    K.preset("tiny-bounded"),
    K.KdaConfig(hidden=24, heads=1, head_dim=16, conv_kernel=2, chunk=16, gate_lower_bound=-240.0),
    K.KdaConfig(hidden=40, heads=3, head_dim=16, conv_kernel=3, chunk=32),
]
LENGTHS = [1, 15, 16, 17, 33, 40]  # padded T
STRENGTHS = [0.01, 1.0, 20.0, 240.0]  # typical per-token decay, nats


@dataclasses.dataclass(frozen=True)
class Case:
    cfg: K.KdaConfig
    params: K.KdaParams
    state: K.KdaState
    x: jax.Array  # [B, T, D] fp32
    lengths: np.ndarray  # [B] int32

    def __repr__(self):  # what hypothesis prints for a failing example, instead of arrays
        return (
            f"Case(cfg={self.cfg}, x={tuple(self.x.shape)}, lengths={self.lengths.tolist()}, "
            f"a_log={np.asarray(self.params.a_log).round(2).tolist()})"
        )


def _decay(cfg: K.KdaConfig, p: K.KdaParams, strength: float, key) -> K.KdaParams:
    """Sets the gate parameters so the typical per-token log-decay is about -strength."""
    jitter = 0.3 * jax.random.normal(key, p.dt_bias.shape)
    if cfg.gate_lower_bound is None:  # g = -exp(A_log) softplus(f + dt_bias), softplus ~ 1
        return p.replace(a_log=jnp.full_like(p.a_log, np.log(strength)), dt_bias=0.5 + jitter)
    frac = min(strength / -cfg.gate_lower_bound, 0.99)  # g = lb sigmoid(exp(A_log)(f + dt))
    return p.replace(a_log=jnp.zeros_like(p.a_log), dt_bias=np.log(frac / (1 - frac)) + jitter)


@st.composite
def cases(draw, max_batch: int = 3) -> Case:
    cfg = draw(st.sampled_from(CONFIGS))
    t = draw(st.sampled_from(LENGTHS))
    b = draw(st.integers(1, max_batch))
    c = cfg.chunk
    pool = sorted({n for n in (0, 1, c - 1, c, c + 1, t) if 0 <= n <= t})
    lengths = np.array([draw(st.sampled_from(pool)) for _ in range(b)], np.int32)
    seed = draw(st.integers(0, 2**31 - 1))
    strength = draw(st.sampled_from(STRENGTHS))
    carried = draw(st.booleans())
    k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
    p = _decay(cfg, K.init_params(cfg, k1, jnp.float32), strength, k2)
    s = K.KdaState.zeros(cfg, b)
    if carried:  # the oracle's state after a few random tokens
        _, s, _ = K.oracle_forward(p, cfg, jax.random.normal(k3, (b, 5, cfg.hidden)), s)
    x = jax.random.normal(k4, (b, t, cfg.hidden))
    return Case(cfg, p, s, x, lengths)


def _poison_pads(case: Case, value: float) -> jax.Array:
    pads = np.arange(case.x.shape[1])[None, :] >= case.lengths[:, None]
    return jnp.where(pads[..., None], value, case.x)


@pytest.mark.parametrize(
    "backend",
    ["xla", pytest.param("pallas", marks=pytest.mark.slow)],
)
def test_forward_equals_token_oracle(backend):
    """Every row's real tokens: prefill == the fp32 token-by-token oracle (SPEC §8)."""

    @settings(
        max_examples=PALLAS_EXAMPLES if backend == "pallas" else settings.default.max_examples
    )
    @given(cases())
    def check(case):
        cfg, p, s0 = case.cfg, case.params, case.state
        x = _poison_pads(case, np.nan)
        y, s = K.prefill(p, cfg, x, s0, jnp.asarray(case.lengths), backend=backend)
        for row, n in enumerate(case.lengths):
            s0_row = jax.tree.map(lambda a, r=row: a[r : r + 1], s0)
            y_ref, s_ref, _ = K.oracle_forward(p, cfg, case.x[row : row + 1, :n], s0_row)
            np.testing.assert_array_equal(y[row, n:], 0.0)
            if n == 0:  # an empty row keeps its state exactly
                np.testing.assert_array_equal(s.recurrent[row], s0.recurrent[row])
                np.testing.assert_array_equal(s.conv[row], s0.conv[row])
                continue
            assert_close(y[row, :n], y_ref[0], FP32_TOL, f"row {row} output")
            assert_close(s.recurrent[row], s_ref.recurrent[0], FP32_TOL, "state")
            assert_close(s.conv[row], s_ref.conv[0], FP32_TOL, "conv state")

    check()


@given(cases(), st.data())
def test_split_prefill_equals_whole(case, data):
    cfg, p, s0, x = case.cfg, case.params, case.state, case.x
    t = x.shape[1]
    cut = data.draw(st.integers(0, t), label="cut")
    y, s = K.prefill(p, cfg, x, s0, backend="xla")
    y1, s1 = K.prefill(p, cfg, x[:, :cut], s0, backend="xla")
    y2, s2 = K.prefill(p, cfg, x[:, cut:], s1, backend="xla")
    assert_close(jnp.concatenate([y1, y2], 1), y, FP32_TOL, "output")
    assert_close(s2.recurrent, s.recurrent, FP32_TOL, "state")
    assert_close(s2.conv, s.conv, FP32_TOL, "conv state")


@given(cases(), st.integers(1, 4))
def test_prefill_then_decodes_equals_one_prefill(case, n):
    cfg, p, s0, x = case.cfg, case.params, case.state, case.x
    t = x.shape[1]
    n = min(n, t)
    y, s = K.prefill(p, cfg, x, s0, backend="xla")
    ys, state = [], K.prefill(p, cfg, x[:, : t - n], s0, backend="xla")[1]
    for i in range(t - n, t):
        yi, state = K.decode(p, cfg, x[:, i], state, backend="xla")
        ys.append(yi)
    assert_close(jnp.stack(ys, 1), y[:, t - n :], FP32_TOL, "decoded outputs")
    assert_close(state.recurrent, s.recurrent, FP32_TOL, "state")
    assert_close(state.conv, s.conv, FP32_TOL, "conv state")


@pytest.mark.parametrize("backend", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_decode_k_equals_serial_decode(backend):
    """decode_k == k serial decodes; on the kernel path while B*k <= 8 rows the same program on
    the same tile: equal bits compiled, fp32 round-off in interpret mode (`assert_same_program`)."""

    @settings(
        max_examples=PALLAS_EXAMPLES if backend == "pallas" else settings.default.max_examples
    )
    @given(cases(max_batch=2), st.integers(1, 4))
    def check(case, k):
        cfg, p, s0 = case.cfg, case.params, case.state
        drafts = case.x[:, :k] if case.x.shape[1] >= k else jnp.tile(case.x[:, :1], (1, k, 1))
        y, s_last, snaps = K.decode_k(p, cfg, drafts, s0, backend=backend)
        state = s0
        for i in range(k):
            yi, state = K.decode(p, cfg, drafts[:, i], state, backend=backend)
            pairs = ((y[:, i], yi), (snaps.recurrent[:, i], state.recurrent))
            pairs += ((snaps.conv[:, i], state.conv),)
            for got, want in pairs:
                if backend == "pallas":
                    assert_same_program(got, want, f"row {i}")
                else:  # XLA's dot may sum B*k rows in another order than B rows
                    assert_close(got, want, FP32_TOL, f"row {i}")
        np.testing.assert_array_equal(s_last.recurrent, snaps.recurrent[:, -1])

    check()


@given(cases(), st.data())
def test_causality(case, data):
    """Perturbing token t changes no output before t (bit for bit)."""
    cfg, p, s0, x = case.cfg, case.params, case.state, case.x
    t = data.draw(st.integers(0, x.shape[1] - 1), label="t")
    y, _ = K.prefill(p, cfg, x, s0, backend="xla")
    y2, _ = K.prefill(p, cfg, x.at[:, t].multiply(-3.0), s0, backend="xla")
    np.testing.assert_array_equal(y2[:, :t], y[:, :t])


@given(cases(), st.sampled_from([np.nan, np.inf, -np.inf, 1e30]))
def test_pads_change_nothing_values_and_gradients(case, poison):
    cfg, p, s0 = case.cfg, case.params, case.state
    lengths = jnp.asarray(case.lengths)

    def loss(p, x, s):
        y, st_ = K.prefill(p, cfg, x, s, lengths, backend="xla")
        return jnp.sum(y**2) + jnp.sum(st_.recurrent**2) + jnp.sum(st_.conv**2), (y, st_)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    g_clean, (y_clean, s_clean) = grad(p, case.x, s0)
    g_dirty, (y_dirty, s_dirty) = grad(p, _poison_pads(case, poison), s0)
    np.testing.assert_array_equal(y_dirty, y_clean)
    np.testing.assert_array_equal(s_dirty.recurrent, s_clean.recurrent)
    np.testing.assert_array_equal(s_dirty.conv, s_clean.conv)
    for a, b in zip(jax.tree.leaves(g_dirty), jax.tree.leaves(g_clean), strict=True):
        np.testing.assert_array_equal(a, b)


@given(cases(), st.data(), st.sampled_from([np.nan, np.inf]))
def test_nonfinite_real_token_is_causal(case, data, poison):
    """A non-finite real token: earlier outputs as without it, later ones and the state NaN."""
    cfg, p, s0, x = case.cfg, case.params, case.state, case.x
    t_pad = x.shape[1]
    row = data.draw(st.integers(0, x.shape[0] - 1), label="row")
    t = data.draw(st.integers(0, t_pad - 1), label="t")
    lengths = jnp.asarray(case.lengths)
    y, s = K.prefill(p, cfg, x, s0, lengths, backend="xla")
    y2, s2 = K.prefill(p, cfg, x.at[row, t, 0].set(poison), s0, lengths, backend="xla")
    np.testing.assert_array_equal(y2[row, :t], y[row, :t])
    others = np.arange(x.shape[0]) != row
    np.testing.assert_array_equal(y2[others], y[others])
    np.testing.assert_array_equal(s2.recurrent[others], s.recurrent[others])
    if t < case.lengths[row]:  # a real token
        assert bool(jnp.isnan(y2[row, t : case.lengths[row]]).all())
        assert bool(jnp.isnan(s2.recurrent[row]).all())
    else:  # a pad: nothing changes
        np.testing.assert_array_equal(y2[row], y[row])
        np.testing.assert_array_equal(s2.recurrent[row], s.recurrent[row])
