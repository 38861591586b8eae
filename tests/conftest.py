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

# Relative-RMS bars from SPEC §8.
TOL = dict(
    fp32_cpu=1e-4,  # fp32 paths on a CPU
    fp32_gpu=1e-3,  # fp32 paths where the GPU uses TF32 dots
    bf16_stage=5e-3,  # one bf16 stage fed the kernel path's own inputs
    bf16_e2e=1e-2,  # bf16 block output and state against the fp32 oracle
    chunk_vs_loop=5e-3,  # chunked prefill vs token loop, T = 4096, unbounded gate
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


def normal(key, shape, dtype=jnp.float32, scale=1.0):
    """Fresh N(0, scale^2) draws (never zeros)."""
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


# Fresh inputs on every run, reproducible on demand: each run draws a seed (printed in pytest's
# header); KDA_TEST_SEED=<that seed> replays the run's inputs exactly.
RUN_SEED = int(os.environ.get("KDA_TEST_SEED") or secrets.randbelow(2**31))


def pytest_report_header(config):
    return f"kda-jax inputs: KDA_TEST_SEED={RUN_SEED} (set it to replay this run's inputs)"


def pytest_terminal_summary(terminalreporter):
    """The seed again at the end, where `-q` runs (CI) show it too."""
    terminalreporter.write_line(f"kda-jax inputs: KDA_TEST_SEED={RUN_SEED}")


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
