"""Shared test fixtures: tolerances (SPEC §8), input makers, error metrics, H200 cross-lowering."""

from __future__ import annotations

import os
import secrets
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ON_GPU = jax.default_backend() == "gpu"

# Every tolerance the tests use, named for what it bounds; no test writes its own number and
# none widens one. Floats are relative-RMS bars (`assert_close`); dicts are the arguments of
# np.testing.assert_allclose (`**TOL[name]`); pairs are open (low, high) ranges.
TOL = dict(
    # SPEC §8's relative-RMS bars against the fp32 oracle or a reference.
    fp32_cpu=1e-4,  # fp32 paths on a CPU
    fp32_gpu=1e-3,  # fp32 paths where the GPU uses TF32 dots
    bf16_stage=5e-3,  # one bf16 stage fed the kernel path's own inputs
    bf16_e2e=1e-2,  # bf16 block output and state against the fp32 oracle
    chunk_vs_loop=5e-3,  # chunked prefill vs token loop, T = 4096, unbounded gate
    # One xla code path against itself, cut differently (a prefill in two calls, decodes after a
    # prefill, decode_k's rows vs serial decodes): only the fp32 summation order differs.
    same_path_fp32=1e-5,
    same_path_fp32_tree=dict(rtol=1e-5, atol=1e-6),  # the same, leaf by leaf (chex trees)
    # The block on a mesh against one device, fp32: per head the same arithmetic; o_proj's sum
    # over P is cut into one partial per model shard plus an all-reduce (a summation order).
    sharded_vs_unsharded=1e-5,
    # The conv state holds raw projections: copies of one dot's output, at most computed in another
    # batch shape (a split prefill, a snapshot, the stage's own inputs), so equal to fp32 rounding.
    conv_state_copy=dict(rtol=1e-6, atol=1e-6),
    # The conv state against the oracle's: the same projections from an XLA dot and from the
    # oracle's HIGHEST-precision einsum.
    conv_state_vs_oracle=dict(rtol=1e-5, atol=1e-5),
    # Interpret mode only: results the compiled kernels give with equal bits (one Triton program
    # on the same tile), which XLA's CPU compiler builds per call site and contracts into
    # multiply-adds differently (1-ulp fp32 differences). See `assert_same_program`.
    interpret_same_program=dict(rtol=1e-6, atol=1e-7),
    # q and k heads after the conv kernel's L2 norm are unit vectors up to fp32 rounding.
    kernel_unit_norm=dict(rtol=1e-4),
    # The fp32 oracle against float64 arithmetic by hand (one token from zeros) and a float64 token
    # loop (9 tokens from a carried state): fp32 rounding of a few dots, and of the recurrence.
    f64_projection=dict(rtol=1e-5, atol=1e-5),  # raw projections (D-long dots), the conv window
    f64_elementwise=dict(rtol=1e-5, atol=1e-6),  # SiLU of one tap, the rank-1 state write
    f64_unit_norm=dict(rtol=1e-5),  # the oracle's L2-normalised q heads
    f64_core=dict(rtol=1e-4, atol=1e-6),  # core output, a K-long dot of normalised vectors
    f64_loop=dict(rtol=1e-4, atol=1e-5),  # outputs and state after 9 tokens of the recurrence
    # Two float64 derivatives of one function (a hand-written VJP and autodiff of another
    # algorithm): equal to float64 rounding of C-long sums.
    f64_same_derivative=dict(rtol=1e-10, atol=1e-12),
    # chunk_prepare's inverse on an ill-conditioned chunk, on a CPU, vs a float64 solve: at most
    # this many times fp32 solve_triangular's own error, with a floor where both are tiny.
    solve_vs_fp32_solve=4.0,
    solve_floor=1e-6,
    # Figures as printed, to their last digit: SPEC §9's 78.9 MB of weights and 2.1 MB of state
    # per sequence, and the B = 8 decode-state floor of the benchmarks (33.5 MB at 4.3 TB/s).
    spec_weight_mb=0.1,  # |weight_bytes / 1e6 - 78.9|
    spec_state_mb=0.01,  # |state bytes / 1e6 - 2.1|
    decode_floor_us=(7.8, 8.0),  # 7.8 us
    # init_params' promise (its docstring): per-token decay spread over [0.5, 0.999], and
    # unit-scale projections of unit-scale inputs (16 rows, so a loose band).
    init_decay_min=(0.4, 0.6),
    init_decay_max=(0.995, 1.0),
    init_proj_std=(0.7, 1.3),
)


def rel_rms(got, ref) -> float:
    """||got - ref|| / ||ref|| in float64; NaN/inf in `got` gives inf (never passes)."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if not np.all(np.isfinite(got)):
        return float("inf")
    denom = np.linalg.norm(ref)
    assert denom > 0, "reference is all zeros: the test would prove nothing"
    return float(np.linalg.norm(got - ref) / denom)


def assert_close(got, ref, tol: float, what: str = "") -> float:
    err = rel_rms(got, ref)
    assert err < tol, f"{what}: relative RMS {err:.3e} >= {tol:.1e}"
    return err


def assert_same_program(got, want, what: str = "") -> None:
    """Results of the same kernel program on the same tile: equal bits when compiled (a GPU);
    in interpret mode XLA's CPU compiler builds each call site on its own and may contract
    multiply-adds differently, so there the check is fp32 round-off."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if ON_GPU:
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        np.testing.assert_allclose(got, want, **TOL["interpret_same_program"], err_msg=what)


def block_setup(name, key, batch=2, dtype=jnp.float32, warm=5):
    """A preset's random params and a realistic carried state, the oracle's after `warm` random
    tokens (zeros for warm=0): (cfg, params, state, a fresh key)."""
    import kda_jax as K

    cfg = K.preset(name)
    k1, k2, k3 = jax.random.split(key, 3)
    p = K.init_params(cfg, k1, dtype)
    s = K.KdaState.zeros(cfg, batch)
    if warm:
        _, s, _ = K.oracle_forward(p, cfg, jax.random.normal(k2, (batch, warm, cfg.hidden)), s)
    return cfg, p, s, k3


def normal(key, shape, dtype=jnp.float32, scale=1.0):
    """Fresh N(0, scale^2) draws (never zeros)."""
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


# Fresh inputs on every run, reproducible on demand: each run draws a seed (printed in pytest's
# header); KDA_TEST_SEED=<that seed> replays the run's inputs exactly.
RUN_SEED = int(os.environ.get("KDA_TEST_SEED") or secrets.randbelow(2**31))


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu(reason=...)` marks a test of compiled kernels: on a machine without a GPU
    it is skipped with its stated reason (`-m gpu` selects them on one)."""
    if ON_GPU:
        return
    for item in items:
        if (marker := item.get_closest_marker("gpu")) is not None:
            reason = marker.kwargs.get("reason", "needs a GPU (compiled kernels)")
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_report_header(config):
    return f"kda-jax inputs: KDA_TEST_SEED={RUN_SEED} (set it to replay this run's inputs)"


def pytest_terminal_summary(terminalreporter):
    """The seed again at the end, where `-q` runs (CI) show it too."""
    terminalreporter.write_line(f"kda-jax inputs: KDA_TEST_SEED={RUN_SEED}")


@pytest.fixture(autouse=True, scope="module")
def _fresh_jit_caches():
    """Each test file starts with empty compilation caches: the whole suite in one process
    otherwise holds every program it ever compiled."""
    yield
    jax.clear_caches()


@pytest.fixture
def rng(request):
    """A key from the run's seed and the test's id: each test draws its own inputs, new ones on
    every run, the same ones again under the same KDA_TEST_SEED."""
    seed = (zlib.crc32(request.node.nodeid.encode()) ^ RUN_SEED) % (2**31)
    return jax.random.key(seed)


def lower_for_h200(fn, *args, **kwargs) -> str:
    """Cross-lowers `fn(*args)` for an H200 on any machine and returns the module text.

    Builds the real Triton IR of every pallas_call in `fn` (PALLAS.md, testing without a GPU);
    catches what interpret mode lets through. Does not run ptxas. `fn` must call the kernels
    with `interpret=False`: by default they interpret wherever there is no GPU.
    """
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    dev = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=dev)):
        lowered = jax.jit(fn, **kwargs).trace(*args).lower(lowering_platforms=("cuda",))
        return lowered.as_text()
