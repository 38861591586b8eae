"""kda_jax.sharding on 8 CPU devices; run by tests/test_sharding.py in its own process with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (the device count is fixed at JAX's start)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOL, assert_close, normal
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kda_jax import forward
from kda_jax import sharding as S
from kda_jax.config import KdaConfig
from kda_jax.params import init_params
from kda_jax.state import KdaState, select_snapshot

assert len(jax.devices()) == 8, (
    f"this file needs 8 devices, found {len(jax.devices())}: run it through test_sharding.py"
)

# Heads divisible by every model-axis size tried; small enough for interpret-mode kernels.
CFG = KdaConfig(hidden=32, heads=8, head_dim=16, conv_kernel=4, chunk=16)
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def collectives(fn, *args) -> dict[str, int]:
    """How many of each collective the compiled HLO of `fn(*args)` holds."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    return {c: len(re.findall(rf"\b{c}(-start)?\(", text)) for c in COLLECTIVES}


def inputs(key, b_, t, cfg=CFG):
    ks = jax.random.split(key, 5)
    params = init_params(cfg, ks[0], jnp.float32)
    x = normal(ks[1], (b_, t, cfg.hidden))
    state = KdaState(
        recurrent=normal(ks[2], cfg.recurrent_state_shape(b_), scale=0.1),
        conv=normal(ks[3], cfg.conv_state_shape(b_)),
    )
    lengths = jax.random.randint(ks[4], (b_,), 0, t + 1).at[0].set(t)
    return params, x, state, lengths


def assert_sharded_like(a, mesh, spec, what):
    want = NamedSharding(mesh, spec)
    assert a.sharding.is_equivalent_to(want, a.ndim), f"{what}: {a.sharding} is not {want}"


def assert_state_close(got, want, what):
    got = S.unshard_state(got, CFG)
    assert_close(got.recurrent, want.recurrent, TOL["sharded_vs_unsharded"], f"{what} recurrent")
    assert_close(got.conv, want.conv, TOL["sharded_vs_unsharded"], f"{what} conv")


MESHES = [
    (2, 4),
    pytest.param((8, 1), marks=pytest.mark.slow),
    pytest.param((1, 8), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_entry_points_equal_unsharded_with_one_all_reduce(shape, rng):
    mesh = jax.make_mesh(shape, ("data", "model"))
    b_, t = 8, 19  # T not a chunk multiple; B over up to 8 data shards
    params, x, state, lengths = inputs(rng, b_, t)
    sp = S.shard_params(params, CFG, mesh)
    ss = S.shard_state(state, CFG, mesh)
    st_spec, snap_spec = S.state_specs(), S.state_specs(snapshots=True)
    want_coll = dict.fromkeys(COLLECTIVES, 0) | {"all-reduce": int(shape[1] > 1)}

    y_ref, s_ref = forward.prefill(params, CFG, x, state, lengths, backend="xla")
    y, s = S.prefill(sp, CFG, x, ss, lengths, backend="xla")
    assert_close(y, y_ref, TOL["sharded_vs_unsharded"], "prefill y")
    assert_state_close(s, s_ref, "prefill")
    assert_sharded_like(y, mesh, P("data"), "prefill y")
    for name in ("recurrent", "conv"):
        assert_sharded_like(getattr(s, name), mesh, getattr(st_spec, name), f"prefill {name}")
    fn = lambda sp, x, s, n: S.prefill(sp, CFG, x, s, n, backend="xla")  # noqa: E731
    assert collectives(fn, sp, x, ss, lengths) == want_coll

    yd_ref, sd_ref = forward.decode(params, CFG, x[:, 0], s_ref, backend="xla")
    yd, sd = S.decode(sp, CFG, x[:, 0], s, backend="xla")
    assert_close(yd, yd_ref, TOL["sharded_vs_unsharded"], "decode y")
    assert_state_close(sd, sd_ref, "decode")
    assert_sharded_like(yd, mesh, P("data"), "decode y")
    assert_sharded_like(sd.recurrent, mesh, st_spec.recurrent, "decode recurrent")
    fn = lambda sp, x, s: S.decode(sp, CFG, x, s, backend="xla")  # noqa: E731
    assert collectives(fn, sp, x[:, 0], s) == want_coll

    yk_ref, sk_ref, snaps_ref = forward.decode_k(params, CFG, x[:, :3], sd_ref, backend="xla")
    yk, sk, snaps = S.decode_k(sp, CFG, x[:, :3], sd, backend="xla")
    assert_close(yk, yk_ref, TOL["sharded_vs_unsharded"], "decode_k y")
    assert_state_close(sk, sk_ref, "decode_k")
    assert_state_close(snaps, snaps_ref, "decode_k snapshots")
    for name in ("recurrent", "conv"):
        assert_sharded_like(getattr(sk, name), mesh, getattr(st_spec, name), f"decode_k {name}")
        assert_sharded_like(getattr(snaps, name), mesh, getattr(snap_spec, name), f"snap {name}")
    idx = jnp.arange(b_) % 4 - 1  # -1 (no token accepted) to 2
    picked = select_snapshot(snaps, idx, before=sd)
    assert_state_close(picked, select_snapshot(snaps_ref, idx, before=sd_ref), "select_snapshot")
    assert_sharded_like(picked.conv, mesh, st_spec.conv, "select_snapshot conv")
    fn = lambda sp, x, s: S.decode_k(sp, CFG, x, s, backend="xla")  # noqa: E731
    assert collectives(fn, sp, x[:, :3], sd) == want_coll


def test_gate_bias_is_split_by_head(rng):
    """The output gate's optional bias (FLA's layer has one) travels with its heads."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    params, x, state, lengths = inputs(rng, 4, 11)
    params = params.replace(g_bias=normal(jax.random.fold_in(rng, 1), (CFG.qkv_dim,)))
    sp = S.shard_params(params, CFG, mesh)
    assert_sharded_like(sp.g_bias, mesh, P("model"), "g_bias")
    ss = S.shard_state(state, CFG, mesh)
    y_ref, s_ref = forward.prefill(params, CFG, x, state, lengths, backend="xla")
    y, s = S.prefill(sp, CFG, x, ss, lengths, backend="xla")
    assert_close(y, y_ref, TOL["sharded_vs_unsharded"], "prefill y, gate bias")
    yd_ref, _ = forward.decode(params, CFG, x[:, 0], s_ref, backend="xla")
    yd, _ = S.decode(sp, CFG, x[:, 0], s, backend="xla")
    assert_close(yd, yd_ref, TOL["sharded_vs_unsharded"], "decode y, gate bias")


@pytest.mark.slow
def test_pallas_kernels_run_per_shard(rng):
    """The pallas backend (interpret mode on a CPU) inside shard_map: one small case."""
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    params, x, state, lengths = inputs(rng, 2, 17)
    sp, ss = S.shard_params(params, CFG, mesh), S.shard_state(state, CFG, mesh)
    y_ref, s_ref = forward.prefill(params, CFG, x, state, lengths, backend="xla")
    y, s = S.prefill(sp, CFG, x, ss, lengths, backend="pallas")
    assert_close(y, y_ref, TOL["sharded_vs_unsharded"], "pallas prefill y")
    assert_state_close(s, s_ref, "pallas prefill")
    yd_ref, sd_ref = forward.decode(params, CFG, x[:, 0], s_ref, backend="xla")
    yd, sd = S.decode(sp, CFG, x[:, 0], s, backend="pallas")
    assert_close(yd, yd_ref, TOL["sharded_vs_unsharded"], "pallas decode y")
    assert_state_close(sd, sd_ref, "pallas decode")


def test_batch_not_divisible_by_data_axis_is_refused(rng):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    params, x, state, _ = inputs(rng, 6, 5)
    sp = S.shard_params(params, CFG, mesh)
    with pytest.raises(ValueError, match="B=6 is not divisible by the mesh's 'data' axis size 4"):
        S.shard_state(state, CFG, mesh)
    with pytest.raises(ValueError, match="state.conv has shape"):
        S.decode(sp, CFG, x[:4, 0], KdaState.zeros(CFG, 4))  # a canonical, unsharded state


@pytest.mark.parametrize("conv_layout,shards", [("split3d", 1), ("fused", 3)])
def test_load_hf_sharded_reads_slices_and_equals_shard_params(
    conv_layout, shards, rng, tmp_path, monkeypatch
):
    from kda_jax import hf

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    params = init_params(CFG, rng, jnp.float32)
    hf.save_hf_checkpoint(tmp_path, CFG, params, conv_layout=conv_layout, shards=shards)
    want = S.shard_params(params, CFG, mesh)

    def whole(*_):
        raise AssertionError("load_hf_sharded read a whole tensor")

    monkeypatch.setattr(hf._Checkpoint, "read", whole)
    cfg, got = S.load_hf_sharded(tmp_path, 0, mesh, dtype=jnp.float32)
    assert cfg == CFG.replace(chunk=cfg.chunk)  # config.json has no chunk
    assert got.g_bias is None and want.g_bias is None  # Hugging Face layers have no gate bias
    for name in S.PARAM_AXES.keys() - {"g_bias"}:
        a, b = getattr(got, name), getattr(want, name)
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), name
        np.testing.assert_array_equal(a, b, err_msg=name)
    rows = S.local_config(CFG, 4).in_proj_dim
    assert {sh.data.shape for sh in got.w_in.addressable_shards} == {(rows, CFG.hidden)}
