"""kda_jax.sharding: the multi-device cases run in a child pytest process on 8 CPU devices
(tests/multidevice_sharding.py; JAX fixes the device count when it starts), the rest here."""

from __future__ import annotations

import collections
import difflib
import os
import re
import subprocess
import sys

import jax
import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
import pytest
from conftest import RUN_SEED, lower_for_h200
from jax._src.lib.mlir import ir
from jax.interpreters import mlir
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding, use_abstract_mesh

from kda_jax import forward
from kda_jax import sharding as S
from kda_jax.config import KdaConfig, preset
from kda_jax.params import KdaParams
from kda_jax.state import KdaState

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


def _unescape(m: re.Match) -> bytes:
    g = m.group(1)
    return bytes([int(g, 16)]) if len(g) == 2 else g


def _mosaic_ir(config: str) -> str:
    """A Mosaic GPU call's kernel module as text without locations (which carry the Python
    call stack) and without the per-process counter of its dump name (the n-th lowering of a
    kernel in a process is named `<name>_n`), followed by the rest of its config."""
    m = re.search(r'module = "((?:[^"\\]|\\.)*)"', config)
    raw = re.sub(rb"\\([0-9A-Fa-f]{2}|.)", _unescape, m.group(1).encode("latin1"))
    with mlir.make_ir_context() as ctx, ir.Location.unknown():
        mgpu.dialect.register_dialect(ctx)
        ctx.allow_unregistered_dialects = True  # stable_mosaic_gpu ops print generically
        text = ir.Module.parse(raw).operation.get_asm(enable_debug_info=False)
    text = re.sub(r'(dump_basename = "\w+?_)\d+"', r'\1"', text)
    rest = re.sub(r'kernel_hash = ".*?", ', "", config[: m.start()] + config[m.end() :])
    return text + "\n" + rest


def _ops(text: str) -> tuple[list[tuple[str, str]], collections.Counter]:
    """A lowered module's custom calls (target and whole config: kernel IR, grid, warps,
    aliases) in order, and a count of its other ops."""
    calls = [
        (target, _mosaic_ir(c) if target == "mosaic_gpu_v2" else c)
        for target, c in re.findall(r"custom_call @(\S+?)\(.*?backend_config = (\{.*)$", text, re.M)
    ]
    ops = collections.Counter(re.findall(r"= ((?:stablehlo|sdy)\.\w+)", text))
    return calls, ops


@pytest.mark.parametrize("b_", [1, 8, 64])
def test_one_device_mesh_decode_lowers_to_the_unsharded_kernels(b_):
    """On a (1, 1) mesh the sharded decode (kimi-linear-48b, bf16, cross-lowered for an H200)
    runs the unsharded call's kernels with the same IR, grid, warps and in-place aliases, and
    adds only reshapes (the per-shard conv_w and conv-state views, free) and sharding
    constraints: no copy, transpose or gather of a weight or the state."""
    cfg = preset("kimi-linear-48b")
    dev = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = AbstractMesh(
        (1, 1), (S.DATA, S.MODEL), axis_types=(AxisType.Explicit,) * 2, abstract_device=dev
    )
    p, k, w = cfg.qkv_dim, cfg.head_dim, cfg.conv_kernel
    bf16, f32 = jnp.bfloat16, jnp.float32
    shapes = dict(
        w_in=((cfg.in_proj_dim, cfg.hidden), bf16),
        f_b=((p, k), bf16),
        g_b=((p, k), bf16),
        conv_w=((3, p, w), f32),
        a_log=((cfg.heads,), f32),
        dt_bias=((p,), f32),
        o_norm_w=((k,), f32),
        o_proj=((cfg.hidden, p), bf16),
    )
    params = KdaParams(
        **{
            n: jax.ShapeDtypeStruct(s if n != "conv_w" else (3 * p, w), d)
            for n, (s, d) in shapes.items()
        }
    )
    x = jax.ShapeDtypeStruct((b_, cfg.hidden), bf16)
    state = KdaState(
        recurrent=jax.ShapeDtypeStruct(cfg.recurrent_state_shape(b_), f32),
        conv=jax.ShapeDtypeStruct(cfg.conv_state_shape(b_), f32),
    )
    plain = lower_for_h200(
        lambda p_, x_, s_: forward.decode(p_, cfg, x_, s_, backend="pallas", interpret=False),
        params,
        x,
        state,
        donate_argnums=2,
    )

    def placed(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    specs = S.ShardedParams(**S._SHARDED_SPECS, mesh=mesh)
    sp = specs.replace(**{n: placed(*shapes[n], getattr(specs, n)) for n in shapes})
    st = S.state_specs()
    ss = KdaState(
        recurrent=placed(state.recurrent.shape, f32, st.recurrent),
        conv=placed((b_, w - 1, 3, p), f32, st.conv),
    )
    xs = placed(x.shape, bf16, jax.P(S.DATA))
    # S.decode's checks want a concrete Mesh; its jitted body takes the abstract one.
    fn = lambda p_, x_, s_: S._decode(p_, cfg, x_, s_, backend="pallas", interpret=False)  # noqa: E731
    with use_abstract_mesh(mesh):
        sharded = (
            jax.jit(fn, donate_argnums=2).trace(sp, xs, ss).lower(lowering_platforms=("cuda",))
        )
    calls, ops = _ops(plain)
    got_calls, got_ops = _ops(sharded.as_text())
    assert len(calls) == 5, [c[0] for c in calls]
    assert [c[0] for c in got_calls] == [c[0] for c in calls]
    for i, (a, b) in enumerate(zip(got_calls, calls, strict=True)):
        diff = "\n".join(difflib.unified_diff(b[1].splitlines(), a[1].splitlines(), lineterm=""))
        assert a[1] == b[1], f"kernel {i} ({a[0]}) lowers differently on the mesh:\n{diff[:4000]}"
    extra = {op for op, n in (got_ops - ops).items() if n}
    assert extra <= {"stablehlo.reshape", "sdy.sharding_constraint"}, extra
    donated = re.findall(r"tf\.aliasing_output = (\d+)", sharded.as_text())
    assert donated == ["1", "2"], f"the donated state's outputs: {donated}"
