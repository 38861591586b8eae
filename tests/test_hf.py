"""Checkpoint loading (SPEC §6) from generated safetensors in every shape variant, and the
loader's errors on broken checkpoints: each names the file, the tensor, what it found and what it
expected."""

from __future__ import annotations

import json
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU, TOL, assert_close, normal, rel_rms
from safetensors.numpy import load_file, save_file

import kda_jax as K
from kda_jax.config import DEFAULT_CHUNK
from kda_jax.hf import INDEX, PREFIX, CheckpointError, load_hf_params, save_hf_checkpoint


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(
    "conv_layout,a_log_shape,shards",
    [("split3d", "kimi", 1), ("split2d", "flat", 1), ("fused", "kimi", 3), ("split3d", "flat", 2)],
)
@pytest.mark.parametrize("name", ["tiny", "tiny-bounded"])
def test_roundtrip_every_variant(tmp_path, name, conv_layout, a_log_shape, shards, dtype):
    cfg = K.preset(name)
    params = K.init_params(cfg, jax.random.key(3), dtype)
    save_hf_checkpoint(
        tmp_path,
        cfg,
        params,
        layer_idx=2,
        conv_layout=conv_layout,
        a_log_shape=a_log_shape,
        shards=shards,
    )
    got_cfg, got = load_hf_params(tmp_path, 2, dtype=dtype)
    assert got_cfg == cfg.replace(chunk=DEFAULT_CHUNK)  # not a checkpoint key: the default
    chex.assert_trees_all_equal(got, params)
    for leaf in ("conv_w", "a_log", "dt_bias", "o_norm_w"):
        assert getattr(got, leaf).dtype == jnp.float32


def test_load_hf_layer_runs_and_matches(tmp_path):
    cfg = K.preset("tiny")
    params = K.init_params(cfg, jax.random.key(4), jnp.float32)
    save_hf_checkpoint(tmp_path, cfg, params, layer_idx=0)
    blk = K.load_hf_layer(tmp_path, 0, cfg, dtype=jnp.float32, backend="xla")
    assert blk.cfg == cfg
    x = jax.random.normal(jax.random.key(5), (1, 7, cfg.hidden))
    y, _ = blk(x)
    y_ref, _ = K.prefill(params, cfg, x, K.KdaState.zeros(cfg, 1), backend="xla")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))


def test_bf16_file_is_stored_in_fp32_where_spec_says(tmp_path):
    """A checkpoint holding conv/A_log/dt_bias in bf16 still loads them as fp32."""
    cfg = K.preset("tiny")
    params = K.init_params(cfg, jax.random.key(6), jnp.bfloat16)
    save_hf_checkpoint(tmp_path, cfg, params)
    fn = os.path.join(tmp_path, "model.safetensors")
    t = load_file(fn)
    pre = PREFIX.format(i=0)
    for n in ("A_log", "dt_bias", "q_conv1d.weight"):
        t[pre + n] = np.asarray(jnp.asarray(t[pre + n]).astype(jnp.bfloat16))
    save_file(t, fn)
    _, got = load_hf_params(tmp_path, 0)
    assert got.a_log.dtype == got.dt_bias.dtype == got.conv_w.dtype == jnp.float32


def test_missing_gate_lower_bound_means_unbounded(tmp_path):
    cfg = K.preset("tiny-bounded")
    save_hf_checkpoint(tmp_path, cfg, K.init_params(cfg, jax.random.key(0)))
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    assert K.KdaConfig.from_hf_config(hf).gate_lower_bound == -5.0
    del hf["linear_attn_config"]["gate_lower_bound"]
    assert K.KdaConfig.from_hf_config(hf).gate_lower_bound is None


# Fuzzing: one small checkpoint, broken one way per test.

PRE = PREFIX.format(i=0)
SPLIT = [
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "f_a_proj.weight",
    "f_b_proj.weight",
    "g_a_proj.weight",
    "g_b_proj.weight",
    "b_proj.weight",
    "A_log",
    "dt_bias",
    "o_norm.weight",
    "o_proj.weight",
    "q_conv1d.weight",
    "k_conv1d.weight",
    "v_conv1d.weight",
]
# (conv layout, tensor): every tensor of the split layout, and the fused conv of the other.
EVERY_TENSOR = [("split3d", n) for n in SPLIT] + [("fused", "qkv_conv1d.weight")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """conv layout -> (config.json text, {name: array}) of a tiny fp32 layer 0."""
    cfg = K.preset("tiny")
    params = K.init_params(cfg, jax.random.key(0), jnp.float32)
    out = {}
    for layout in ("split3d", "fused"):
        d = tmp_path_factory.mktemp(layout)
        save_hf_checkpoint(d, cfg, params, conv_layout=layout)
        out[layout] = ((d / "config.json").read_text(), load_file(d / "model.safetensors"))
    return out


def write(path, saved, layout="split3d", files=None, config=None):
    """A checkpoint at `path`: config.json and `files` ({file name: tensors}; default the saved
    tensors in model.safetensors)."""
    text, tensors = saved[layout]
    (path / "config.json").write_text(text if config is None else json.dumps(config))
    for fn, t in ({"model.safetensors": tensors} if files is None else files).items():
        save_file(t, path / fn)
    return dict(tensors)


def load_error(path, match=None) -> str:
    with pytest.raises(CheckpointError, match=match) as e:
        load_hf_params(path, 0)
    return str(e.value)


@pytest.mark.parametrize("layout,tensor", EVERY_TENSOR)
def test_missing_tensor_names_tensor_layer_and_directory(tmp_path, saved, layout, tensor):
    t = dict(saved[layout][1])
    del t[PRE + tensor]
    write(tmp_path, saved, layout, {"model.safetensors": t})
    msg = load_error(tmp_path, "missing")
    assert PRE + tensor in msg and "layer 0" in msg and str(tmp_path) in msg, msg


@pytest.mark.parametrize("layout,tensor", EVERY_TENSOR)
def test_misshaped_tensor_names_file_expected_and_found(tmp_path, saved, layout, tensor):
    t = dict(saved[layout][1])
    good = t[PRE + tensor].shape
    bad = (*good[:-1], good[-1] + 1)
    t[PRE + tensor] = np.ones(bad, np.float32)
    write(tmp_path, saved, layout, {"model.safetensors": t})
    msg = load_error(tmp_path, "expected")
    assert PRE + tensor in msg and "model.safetensors" in msg, msg
    assert f"shape {bad}" in msg and str(good) in msg, msg


@pytest.mark.parametrize(
    "bad_dtype,shown", [(np.int32, "I32"), (np.bool_, "BOOL"), (np.float64, "F64")]
)
@pytest.mark.parametrize("layout,tensor", EVERY_TENSOR)
def test_non_floating_dtype_is_refused(tmp_path, saved, layout, tensor, bad_dtype, shown):
    """An int32 q_proj once loaded as zeros, a bool one as ones: only bf16, fp16, fp32 load."""
    t = dict(saved[layout][1])
    t[PRE + tensor] = np.ones(t[PRE + tensor].shape, bad_dtype)
    write(tmp_path, saved, layout, {"model.safetensors": t})
    msg = load_error(tmp_path, "floating")
    assert PRE + tensor in msg and "model.safetensors" in msg and shown in msg, msg


@pytest.mark.parametrize("tensor", SPLIT)
def test_tensor_in_two_unindexed_files_names_both(tmp_path, saved, tensor):
    t = dict(saved["split3d"][1])
    extra = {PRE + tensor: t[PRE + tensor] + 1.0}
    write(tmp_path, saved, files={"model.safetensors": t, "extra.safetensors": extra})
    msg = load_error(tmp_path, "two files")
    assert PRE + tensor in msg and "model.safetensors" in msg and "extra.safetensors" in msg


def test_floating_dtypes_load_and_index_decides_between_duplicates(tmp_path, saved):
    """bf16, fp16 and fp32 tensors all load; with an index, a stray copy elsewhere is ignored."""
    t = write(tmp_path, saved)
    t[PRE + "q_proj.weight"] = t[PRE + "q_proj.weight"].astype(np.float16)
    t[PRE + "k_proj.weight"] = np.asarray(jnp.asarray(t[PRE + "k_proj.weight"], jnp.bfloat16))
    save_file(t, tmp_path / "model.safetensors")
    save_file({PRE + "v_proj.weight": t[PRE + "v_proj.weight"] + 1.0}, tmp_path / "x.safetensors")
    with open(tmp_path / INDEX, "w") as f:
        json.dump({"weight_map": {n: "model.safetensors" for n in t}}, f)
    cfg, got = load_hf_params(tmp_path, np.int64(0), dtype=jnp.float32)
    np.testing.assert_array_equal(got.w_in[: cfg.qkv_dim], t[PRE + "q_proj.weight"])
    v = got.w_in[2 * cfg.qkv_dim : 3 * cfg.qkv_dim]
    np.testing.assert_array_equal(v, t[PRE + "v_proj.weight"])


def _header_end(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


# Ways a safetensors file arrives broken: cut short anywhere, or not safetensors at all.
BREAKS = {
    "empty": lambda d: b"",
    "cut in the length": lambda d: d[:5],
    "cut in the header": lambda d: d[: _header_end(d) // 2],
    "cut after the header": lambda d: d[: _header_end(d)],
    "cut in the data": lambda d: d[: (_header_end(d) + len(d)) // 2],
    "one byte short": lambda d: d[:-1],
    "text": lambda d: b"not a safetensors file, just text" * 4,
    "huge header length": lambda d: (2**40).to_bytes(8, "little") + d[8:],
}


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "indexed"])
@pytest.mark.parametrize("how", list(BREAKS))
def test_truncated_or_garbage_file_is_named(tmp_path, saved, how, sharded):
    t = write(tmp_path, saved, files={})
    if sharded:  # the layer split over two files and an index; the second file is broken
        names = sorted(t)
        parts = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
        for fn, part in parts.items():
            save_file({n: t[n] for n in part}, tmp_path / fn)
        wmap = {n: fn for fn, part in parts.items() for n in part}
        (tmp_path / INDEX).write_text(json.dumps({"weight_map": wmap}))
        fn = tmp_path / "b.safetensors"
    else:
        fn = tmp_path / "model.safetensors"
        save_file(t, fn)
    fn.write_bytes(BREAKS[how](fn.read_bytes()))
    msg = load_error(tmp_path, "not a readable safetensors file")
    assert str(fn) in msg, msg


# model.safetensors.index.json broken one way each: (its text given the good weight_map, the
# error's words). q_proj's entry is the one spoiled where a single entry is.
Q = PRE + "q_proj.weight"
BAD_INDEXES = {
    "not json": (lambda w: "{not json", "not a readable JSON index"),
    "not utf-8": (lambda w: "\udcff", "not a readable JSON index"),
    "a list": (lambda w: [w], "no 'weight_map'"),
    "no weight_map": (lambda w: {"metadata": {}}, "no 'weight_map'"),
    "weight_map a list": (lambda w: {"weight_map": list(w)}, "no 'weight_map'"),
    "file not a string": (lambda w: {"weight_map": {**w, Q: 3}}, "must map tensor names"),
    "missing file": (
        lambda w: {"weight_map": {**w, Q: "model-00009-of-00009.safetensors"}},
        "does not exist",
    ),
    "file without the tensor": (
        lambda w: {"weight_map": {**w, Q: "other.safetensors"}},
        "holds no such tensor",
    ),
    "tensor not listed": (
        lambda w: {"weight_map": {n: f for n, f in w.items() if n != Q}},
        "missing from the weight_map",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INDEXES))
def test_bad_index_is_named(tmp_path, saved, case):
    t = write(tmp_path, saved)
    save_file({"unrelated": np.ones(2, np.float32)}, tmp_path / "other.safetensors")
    make, pattern = BAD_INDEXES[case]
    doc = make({n: "model.safetensors" for n in t})
    text = doc if isinstance(doc, str) else json.dumps(doc)
    (tmp_path / INDEX).write_bytes(text.encode("utf-8", "surrogateescape"))
    msg = load_error(tmp_path, pattern)
    assert INDEX in msg, msg
    if "file" in case or "tensor" in case:
        assert Q in msg, msg


def test_not_a_kda_layer_lists_the_kda_layers(tmp_path, saved):
    cfg = K.preset("tiny")
    save_hf_checkpoint(tmp_path, cfg, K.init_params(cfg, jax.random.key(0)), layer_idx=1)
    msg = load_error(tmp_path, "not a KDA layer")
    assert "kda_layers (1-based) [2]" in msg and "in [1]" in msg, msg
    with pytest.raises(ValueError, match="layer_idx=5"):
        load_hf_params(tmp_path, 5)
    with pytest.raises(TypeError, match="layer_idx"):
        load_hf_params(tmp_path, 1.0)


def test_full_attention_layer_without_kda_layers(tmp_path, saved):
    """A full-attention (MLA) layer in a config listing no kda_layers: not a KeyError on
    q_conv1d, but which tensors it has and what is missing."""
    text, tensors = saved["split3d"]
    hf = json.loads(text)
    del hf["linear_attn_config"]["kda_layers"]
    mla = {PRE + n: tensors[PRE + n] for n in ("q_proj.weight", "o_proj.weight")}
    mla[PRE + "kv_a_proj_with_mqa.weight"] = np.ones((8, 96), np.float32)
    write(tmp_path, saved, files={"model.safetensors": mla}, config=hf)
    msg = load_error(tmp_path, "not a KDA layer")
    assert "kv_a_proj_with_mqa.weight" in msg and "lists no kda_layers" in msg, msg


@pytest.mark.parametrize("kda_layers", ["1", [0], [1.5], [True]])
def test_bad_kda_layers_is_named(tmp_path, saved, kda_layers):
    hf = json.loads(saved["split3d"][0])
    hf["linear_attn_config"]["kda_layers"] = kda_layers
    write(tmp_path, saved, config=hf)
    msg = load_error(tmp_path, "kda_layers")
    assert "config.json" in msg, msg


def test_bad_directories_and_configs(tmp_path, saved):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_params(tmp_path / "nowhere", 0)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_params(tmp_path, 0)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="config.json' is not readable JSON"):
        load_hf_params(tmp_path, 0)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(CheckpointError, match="config.json.*linear_attn_config"):
        load_hf_params(tmp_path, 0)
    write(tmp_path, saved, files={})
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        load_hf_params(tmp_path, 0)
    with pytest.raises(ValueError, match="linear_attn_config"):
        K.KdaConfig.from_hf_config({"hidden_size": 8})


def test_fused_and_split_conv_together_is_ambiguous(tmp_path, saved):
    t = dict(saved["split3d"][1])
    t[PRE + "qkv_conv1d.weight"] = saved["fused"][1][PRE + "qkv_conv1d.weight"]
    write(tmp_path, saved, files={"model.safetensors": t})
    load_error(tmp_path, "both a fused conv")


def test_save_takes_numpy_integers(tmp_path):
    cfg = K.preset("tiny")
    params = K.init_params(cfg, jax.random.key(1), jnp.float32)
    save_hf_checkpoint(tmp_path, cfg, params, layer_idx=np.int64(1), shards=np.int32(2))
    _, got = load_hf_params(tmp_path, np.int64(1), dtype=jnp.float32)
    chex.assert_trees_all_equal(got, params)
    shutil.rmtree(tmp_path)


# FLA layer checkpoints: fla.layers.kda.KimiDeltaAttention's state_dict names, written here from
# FLA's layout (not by the loader's own code), then loaded and run against the oracle.


def write_fla(path, cfg, params, prefix=""):
    """FLA's layer as safetensors: q/k/v_proj, q/k/v_conv1d [P, 1, W], f_proj.0/1, b_proj,
    A_log [H], dt_bias [P], g_proj.0/1 (+ g_proj.1.bias when params has a gate bias), o_norm,
    o_proj."""
    from kda_jax.params import in_proj_slices

    sl, p = in_proj_slices(cfg), cfg.qkv_dim
    w_in, conv = np.asarray(params.w_in), np.asarray(params.conv_w)
    t = {
        "q_proj.weight": w_in[sl["q"]],
        "k_proj.weight": w_in[sl["k"]],
        "v_proj.weight": w_in[sl["v"]],
        "f_proj.0.weight": w_in[sl["f_a"]],
        "f_proj.1.weight": np.asarray(params.f_b),
        "g_proj.0.weight": w_in[sl["g_a"]],
        "g_proj.1.weight": np.asarray(params.g_b),
        "b_proj.weight": w_in[sl["b"]],
        "A_log": np.asarray(params.a_log),
        "dt_bias": np.asarray(params.dt_bias),
        "o_norm.weight": np.asarray(params.o_norm_w),
        "o_proj.weight": np.asarray(params.o_proj),
    }
    for i, n in enumerate("qkv"):
        t[f"{n}_conv1d.weight"] = conv[i * p : (i + 1) * p, None, :]
    if params.g_bias is not None:
        t["g_proj.1.bias"] = np.asarray(params.g_bias)
    fn = os.path.join(path, "layer.safetensors")
    save_file({prefix + k: np.ascontiguousarray(v) for k, v in t.items()}, fn)
    return fn


@pytest.mark.parametrize("gate_bias", [False, True])
@pytest.mark.parametrize("name", ["tiny", "tiny-bounded"])
def test_fla_checkpoint_loads_and_matches_the_oracle(tmp_path, rng, name, gate_bias):
    cfg = K.preset(name)
    params = K.init_params(cfg, jax.random.key(7), jnp.float32, gate_bias=gate_bias)
    prefix = "model.layers.3.attn."
    fn = write_fla(tmp_path, cfg, params, prefix)
    got = K.load_fla_params(fn, cfg, prefix=prefix, dtype=jnp.float32)
    chex.assert_trees_all_equal(got, params)
    assert (got.g_bias is not None) == gate_bias
    blk = K.load_fla_layer(tmp_path, cfg, prefix=prefix, dtype=jnp.float32, backend="xla")
    x = normal(rng, (2, 23, cfg.hidden))
    s0 = K.KdaState.zeros(cfg, 2)
    y_ref, s_ref, stages = K.oracle_forward(params, cfg, x, s0)  # the weights as written
    y, s = blk(x)
    assert_close(y, y_ref, TOL["fp32_cpu"], "prefill y")
    assert_close(s.recurrent, s_ref.recurrent, TOL["fp32_cpu"], "prefill state")
    yd, _ = blk.decode(x[:, 0], s0)
    assert_close(yd, y_ref[:, 0], TOL["fp32_cpu"], "decode y")
    if gate_bias:  # the bias reaches the output: without it the block computes another layer
        y_nb, _, _ = K.oracle_forward(params.replace(g_bias=None), cfg, x, s0)
        assert rel_rms(y_nb, y_ref) > 100 * TOL["fp32_cpu"]


@pytest.mark.slow
def test_fla_gate_bias_on_the_pallas_backend(tmp_path, rng):
    cfg = K.preset("tiny")
    params = K.init_params(cfg, jax.random.key(8), jnp.float32, gate_bias=True)
    fn = write_fla(tmp_path, cfg, params)
    blk = K.load_fla_layer(fn, cfg, dtype=jnp.float32, backend="pallas")
    x = normal(rng, (1, 20, cfg.hidden))
    s0 = K.KdaState.zeros(cfg, 1)
    y_ref, _, _ = K.oracle_forward(params, cfg, x, s0)
    bar = TOL["fp32_gpu"] if ON_GPU else TOL["fp32_cpu"]
    y, _ = blk(x)
    assert_close(y, y_ref, bar, "pallas prefill")
    yd, _ = blk.decode(x[:, 0], s0)
    assert_close(yd, y_ref[:, 0], bar, "pallas decode")
    yk, _, _ = blk.decode_k(x[:, :3], s0)
    assert_close(yk, y_ref[:, :3], bar, "pallas decode_k")


@pytest.fixture
def fla_file(tmp_path):
    cfg = K.preset("tiny")
    params = K.init_params(cfg, jax.random.key(9), jnp.float32, gate_bias=True)
    fn = write_fla(tmp_path, cfg, params)
    return cfg, fn, load_file(fn)


def fla_error(cfg, fn, tensors, match, **kw) -> str:
    save_file(tensors, fn)
    with pytest.raises(CheckpointError, match=match) as e:
        K.load_fla_params(fn, cfg, **kw)
    return str(e.value)


@pytest.mark.parametrize("tensor", ["f_proj.1.weight", "q_conv1d.weight", "A_log"])
def test_fla_errors_name_file_tensor_found_and_expected(fla_file, tensor):
    cfg, fn, t = fla_file
    missing = dict(t)
    del missing[tensor]
    msg = fla_error(cfg, fn, missing, "missing")
    assert tensor in msg and fn in msg, msg
    bad = dict(t)
    bad[tensor] = np.zeros((3, 5), np.float32)
    msg = fla_error(cfg, fn, bad, "shape")
    assert tensor in msg and fn in msg and "(3, 5)" in msg and str(t[tensor].shape) in msg, msg


def test_fla_refuses_tensors_the_block_has_no_place_for(fla_file):
    cfg, fn, t = fla_file
    extra = dict(t, **{"q_conv1d.bias": np.zeros(cfg.qkv_dim, np.float32)})
    msg = fla_error(cfg, fn, extra, "unexpected")
    assert "q_conv1d.bias" in msg and fn in msg, msg
    # A model's file read without the layer's prefix: every name is unexpected or missing.
    save_file({"model.layers.0.attn." + k: v for k, v in t.items()}, fn)
    with pytest.raises(CheckpointError, match="missing"):
        K.load_fla_params(fn, cfg)
