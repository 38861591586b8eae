"""kda_jax.sharding: the multi-device cases run in a child pytest process on 8 CPU devices
(tests/multidevice_sharding.py; JAX fixes the device count when it starts), the rest here."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest
from conftest import RUN_SEED

from kda_jax import sharding as S
from kda_jax.config import KdaConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_multidevice(marker: str) -> None:
    env = dict(
        os.environ,
        XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"),
        JAX_PLATFORMS="cpu",
        KDA_TEST_SEED=str(RUN_SEED),
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker]
    cmd.append(os.path.join("tests", "multidevice_sharding.py"))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_multidevice_cases():
    """Mesh (2, 4): prefill with lengths, decode, decode_k equal one device; shardings kept;
    one all-reduce per call in the compiled HLO."""
    _run_multidevice("not slow")


@pytest.mark.slow
def test_multidevice_slow_cases():
    """Meshes (8, 1) and (1, 8), and the pallas kernels per shard."""
    _run_multidevice("slow")


def test_heads_not_divisible_by_model_axis_is_refused():
    cfg = KdaConfig(hidden=32, heads=6, head_dim=16)
    with pytest.raises(
        ValueError, match="heads=6 is not divisible by the mesh's 'model' axis size 4"
    ):
        S.local_config(cfg, 4)
    assert S.local_config(cfg, 3) == cfg.replace(heads=2)


def test_mesh_without_data_and_model_axes_is_refused():
    mesh = jax.make_mesh((1,), ("x",))
    cfg = KdaConfig(hidden=32, heads=2, head_dim=16)
    with pytest.raises(ValueError, match=r"axes \('x',\); expected axes named \('data', 'model'\)"):
        S.shard_state(None, cfg, mesh)


def test_w_in_rows_hold_each_shards_heads_then_f_a_g_a():
    cfg = KdaConfig(hidden=32, heads=4, head_dim=16)
    rows = S.w_in_rows(cfg, 2)
    lcfg = S.local_config(cfg, 2)
    assert rows.shape == (2 * lcfg.in_proj_dim,)
    p, k = cfg.qkv_dim, cfg.head_dim
    first = rows[: lcfg.in_proj_dim].tolist()
    want = [*range(0, 32), *range(p, p + 32), *range(2 * p, 2 * p + 32)]
    want += [*range(3 * p, 3 * p + 2 * k), 3 * p + 2 * k, 3 * p + 2 * k + 1]
    assert first == want
