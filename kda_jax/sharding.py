"""The block on many devices: batch over a mesh axis 'data', heads over an axis 'model'.

A naive head split of `KdaParams` does not exist: `w_in` fuses q | k | v | f_a | g_a | b rows, so
a row split of it would cut across parts, and XLA would compile the block to many collectives.
`shard_params` re-lays the weights out once, so that model shard `i` holds exactly the weights of
its heads as a valid `KdaParams` of the per-shard config (`local_config`: `heads // model`):

- `w_in [model * (3P/m + 2K + H/m), D]`, split by rows: shard i's block is its heads' q, k, v
  rows, then the whole f_a and g_a (replicated: every head reads them), then its heads' b rows;
- `conv_w [3, P, W]`, `f_b`, `g_b [P, K]`, `a_log [H]`, `dt_bias [P]`: split by head;
- `o_norm_w [K]` replicated; `o_proj [D, P]` split along P (its input).

The state keeps its canonical layout except that `conv` is `[B, W-1, 3, P]` (a free reshape of
`[B, W-1, 3P]`: `shard_state` / `unshard_state`), so the channel axis splits by head; `recurrent
[B, H, K, V]` splits B over 'data' and H over 'model'. A sharded state is refused by the
unsharded entry points (its conv shape differs), and vice versa.

`prefill`, `decode` and `decode_k` here run the unsharded forward (`kda_jax.forward`) per shard
inside one `jax.shard_map` on the per-shard config, either backend (the Pallas kernels have no
partitioning rule, so they must run per shard); each shard's o_proj gives a partial sum of the
output, and one all-reduce over 'model' (in fp32, cast once) completes it. Nothing else crosses
devices: no state is gathered, the conv windows and the recurrence are per head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kda_jax import backends, forward
from kda_jax.config import KdaConfig
from kda_jax.params import KdaParams, in_proj_slices
from kda_jax.state import KdaState

__all__ = [
    "PARAM_AXES",
    "ShardedParams",
    "local_config",
    "shard_params",
    "shard_state",
    "unshard_state",
    "state_specs",
    "prefill",
    "decode",
    "decode_k",
    "load_hf_sharded",
]

DATA, MODEL = "data", "model"

# Partition axes of the canonical `KdaParams` layout (the NNX module's annotations). w_in and
# conv_w interleave q, k, v across any row split, so in this layout they stay whole on every
# device; `shard_params` gives the layout that splits them by head.
PARAM_AXES = dict(
    w_in=(None, None),
    f_b=(MODEL, None),
    g_b=(MODEL, None),
    conv_w=(None, None),
    a_log=(MODEL,),
    dt_bias=(MODEL,),
    o_norm_w=(None,),
    o_proj=(None, MODEL),
    g_bias=(MODEL,),
)

# The sharded layout's specs, field by field (see the module docstring).
_SHARDED_SPECS = dict(
    w_in=P(MODEL, None),
    f_b=P(MODEL, None),
    g_b=P(MODEL, None),
    conv_w=P(None, MODEL, None),
    a_log=P(MODEL),
    dt_bias=P(MODEL),
    o_norm_w=P(),
    o_proj=P(None, MODEL),
)


@struct.dataclass
class ShardedParams:
    """One block's weights in the per-shard layout (module docstring), placed on `mesh`.

    Attributes: the fields of `KdaParams`, with `w_in [m * (3P/m + 2K + H/m), D]` and
    `conv_w [3, P, W]` (m = the mesh's 'model' size); `mesh` (static) the mesh they live on.
    Build with `shard_params` or `load_hf_sharded`.
    """

    w_in: jax.Array
    f_b: jax.Array
    g_b: jax.Array
    conv_w: jax.Array
    a_log: jax.Array
    dt_bias: jax.Array
    o_norm_w: jax.Array
    o_proj: jax.Array
    mesh: Mesh = struct.field(pytree_node=False)
    g_bias: jax.Array | None = None  # the output gate's optional bias [P], split by head

    @property
    def dtype(self):
        return self.w_in.dtype

    def specs(self) -> ShardedParams:
        """The PartitionSpec of every field, as a ShardedParams on the same mesh."""
        bias = None if self.g_bias is None else P(MODEL)
        return ShardedParams(**_SHARDED_SPECS, mesh=self.mesh, g_bias=bias)

    def local(self) -> KdaParams:
        """Inside `shard_map`: this shard's blocks as the KdaParams of `local_config`."""
        c = self.conv_w
        return KdaParams(
            w_in=self.w_in,
            f_b=self.f_b,
            g_b=self.g_b,
            conv_w=c.reshape(3 * c.shape[1], c.shape[2]),
            a_log=self.a_log,
            dt_bias=self.dt_bias,
            o_norm_w=self.o_norm_w,
            o_proj=self.o_proj,
            g_bias=self.g_bias,
        )


def _model_size(mesh, what: str) -> int:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{what}: mesh is a {type(mesh).__name__}, expected a jax.sharding.Mesh")
    names = tuple(mesh.axis_names)
    if DATA not in names or MODEL not in names:
        raise ValueError(
            f"{what}: the mesh has axes {names}; expected axes named {(DATA, MODEL)} "
            "(batch over 'data', heads over 'model')"
        )
    return int(mesh.shape[MODEL])


def local_config(cfg: KdaConfig, model: int) -> KdaConfig:
    """The config one model shard runs: `heads // model` heads, everything else as `cfg`."""
    if cfg.heads % model:
        raise ValueError(
            f"heads={cfg.heads} is not divisible by the mesh's 'model' axis size {model}: "
            "each model shard holds whole heads"
        )
    return cfg.replace(heads=cfg.heads // model)


def w_in_rows(cfg: KdaConfig, model: int) -> np.ndarray:
    """Rows of the canonical w_in, in the order of the sharded w_in (f_a, g_a once per shard)."""
    local_config(cfg, model)
    sl = in_proj_slices(cfg)
    pl, hl = cfg.qkv_dim // model, cfg.heads // model
    rows = []
    for i in range(model):
        for part in ("q", "k", "v"):
            rows.append(np.arange(sl[part].start + i * pl, sl[part].start + (i + 1) * pl))
        rows.append(np.arange(sl["f_a"].start, sl["g_a"].stop))
        rows.append(np.arange(sl["b"].start + i * hl, sl["b"].start + (i + 1) * hl))
    return np.concatenate(rows)


def shard_params(params: KdaParams, cfg: KdaConfig, mesh: Mesh) -> ShardedParams:
    """Re-lays `params` out per model shard and places it on `mesh` (module docstring).

    Raises ValueError when `cfg.heads` is not divisible by the 'model' axis size, or when the
    mesh lacks the axes 'data' and 'model'.
    """
    model = _model_size(mesh, "shard_params")
    params.check(cfg)
    rows = w_in_rows(cfg, model)
    fields = dict(
        w_in=jnp.take(params.w_in, jnp.asarray(rows), axis=0),
        f_b=params.f_b,
        g_b=params.g_b,
        conv_w=params.conv_w.reshape(3, cfg.qkv_dim, cfg.conv_kernel),
        a_log=params.a_log,
        dt_bias=params.dt_bias,
        o_norm_w=params.o_norm_w,
        o_proj=params.o_proj,
    )
    placed = {
        n: jax.device_put(a, NamedSharding(mesh, _SHARDED_SPECS[n])) for n, a in fields.items()
    }
    bias = params.g_bias
    if bias is not None:
        bias = jax.device_put(bias, NamedSharding(mesh, P(MODEL)))
    return ShardedParams(**placed, mesh=mesh, g_bias=bias)


def state_specs(snapshots: bool = False) -> KdaState:
    """PartitionSpecs of a sharded state (with a row axis after B for decode_k's snapshots)."""
    row = (None,) if snapshots else ()
    return KdaState(
        recurrent=P(DATA, *row, MODEL, None, None), conv=P(DATA, *row, None, None, MODEL)
    )


def shard_state(state: KdaState, cfg: KdaConfig, mesh: Mesh) -> KdaState:
    """A canonical state [B, ...] in the sharded layout (conv [B, W-1, 3, P]), placed on mesh."""
    model = _model_size(mesh, "shard_state")
    local_config(cfg, model)
    b_ = state.recurrent.shape[0]
    state.check(cfg, b_)
    _check_batch(b_, mesh, "shard_state")
    st = KdaState(recurrent=state.recurrent, conv=state.conv.reshape(b_, -1, 3, cfg.qkv_dim))
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), st, state_specs())


def unshard_state(state: KdaState, cfg: KdaConfig) -> KdaState:
    """The canonical layout (conv [B, W-1, 3P]) of a sharded state or of its snapshots.

    The conv state is gathered over 'model' first (its q | k | v channels interleave across the
    head split); the recurrent state keeps its placement.
    """
    conv = state.conv
    sh = getattr(conv, "sharding", None)
    if isinstance(sh, NamedSharding):
        conv = _place(conv, sh.mesh, P(*sh.spec[:1]))
    return KdaState(recurrent=state.recurrent, conv=conv.reshape(*conv.shape[:-2], cfg.conv_dim))


def _check_batch(b_: int, mesh: Mesh, what: str) -> None:
    data = int(mesh.shape[DATA])
    if b_ % data:
        raise ValueError(
            f"{what}: batch B={b_} is not divisible by the mesh's 'data' axis size {data}"
        )


def _check(sp, cfg, x, state, rank: int, what: str) -> KdaConfig:
    """Every check before any work; returns the per-shard config."""
    if not isinstance(sp, ShardedParams):
        raise TypeError(
            f"{what}: params is a {type(sp).__name__}, expected a ShardedParams (shard_params)"
        )
    if not isinstance(cfg, KdaConfig):
        raise TypeError(f"{what}: cfg is a {type(cfg).__name__}, expected a KdaConfig")
    model = _model_size(sp.mesh, what)
    lcfg = local_config(cfg, model)
    want = dict(
        w_in=(model * lcfg.in_proj_dim, cfg.hidden),
        conv_w=(3, cfg.qkv_dim, cfg.conv_kernel),
    )
    for name, shape in want.items():
        if tuple(getattr(sp, name).shape) != shape:
            raise ValueError(
                f"{what}: params.{name} has shape {tuple(getattr(sp, name).shape)}, expected "
                f"{shape} for this cfg on a 'model' axis of {model}"
            )
    if x.ndim != rank or x.shape[-1] != cfg.hidden:
        raise ValueError(
            f"{what}: x has shape {tuple(x.shape)}, expected rank {rank} with D = {cfg.hidden}"
        )
    b_ = x.shape[0]
    _check_batch(b_, sp.mesh, what)
    if not isinstance(state, KdaState):
        raise TypeError(f"{what}: state is a {type(state).__name__}, expected a KdaState")
    for name, arr, shape in (
        ("recurrent", state.recurrent, cfg.recurrent_state_shape(b_)),
        ("conv", state.conv, (b_, cfg.conv_kernel - 1, 3, cfg.qkv_dim)),
    ):
        if tuple(arr.shape) != shape:
            raise ValueError(
                f"{what}: state.{name} has shape {tuple(arr.shape)}, expected {shape} "
                "(a sharded state: shard_state)"
            )
    return lcfg


def _local_state(s: KdaState) -> KdaState:
    c = s.conv
    return KdaState(recurrent=s.recurrent, conv=c.reshape(*c.shape[:-2], -1))


def _sharded_state(s: KdaState) -> KdaState:
    c = s.conv
    return KdaState(recurrent=s.recurrent, conv=c.reshape(*c.shape[:-1], 3, -1))


def _reduce(y: jax.Array, model: int) -> jax.Array:
    """The one collective: the sum of the shards' o_proj partials, in fp32, cast once (none on
    a 'model' axis of 1, where the partial is the whole)."""
    if model == 1:
        return y
    return jax.lax.psum(y.astype(jnp.float32), MODEL).astype(y.dtype)


def _shard_map(body, sp: ShardedParams, in_specs, out_specs, backend: str):
    """`body` per shard; the arguments are first placed as `in_specs` say (a no-op for inputs
    already laid out so: a caller's arrays elsewhere are moved, never computed wrongly).

    On the xla backend shard_map checks that y is replicated over 'model' (the psum makes it
    so); the check is off for the pallas backend (its pallas_calls' output shapes carry no
    varying-axis types) and on a 'model' axis of 1 (no psum runs there to prove it).
    """
    specs = (sp.specs(), *in_specs)
    run = jax.shard_map(
        body,
        mesh=sp.mesh,
        in_specs=specs,
        out_specs=out_specs,
        check_vma=backend == "xla" and sp.mesh.shape[MODEL] > 1,
    )

    def placed(*args):
        return run(*jax.tree.map(lambda a, s: _place(a, sp.mesh, s), args, specs))

    return placed


def _place(a: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    """`a` laid out as `spec` on `mesh`, under jit, for a mesh of Explicit or Auto axes."""
    sharding = NamedSharding(mesh, spec)
    if all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(a, sharding)
    return jax.lax.with_sharding_constraint(a, sharding)


_STATIC = ("cfg", "backend", "interpret")


def prefill(
    params: ShardedParams,
    cfg: KdaConfig,
    x: jax.Array,
    state: KdaState,
    lengths: jax.Array | None = None,
    *,
    backend: str | None = None,
    interpret: bool | None = None,
):
    """`forward.prefill` on the mesh of `params`: x [B, T, D] (B over 'data'), a sharded state.

    Returns (y [B, T, D] sharded over 'data', the new sharded state). Lengths as in
    `forward.prefill` ([B], over 'data'); one all-reduce over 'model'.
    """
    _check(params, cfg, x, state, 3, "prefill")
    b_, t, _ = x.shape
    lengths = forward._check_lengths(lengths, b_, t)
    if lengths is None:
        lengths = jnp.full((b_,), t, jnp.int32)
    return _prefill(
        params, cfg, x, state, lengths, backend=backends.resolve(backend), interpret=interpret
    )


@functools.partial(jax.jit, static_argnames=_STATIC)
def _prefill(sp, cfg, x, state, lengths, *, backend, interpret):
    model = int(sp.mesh.shape[MODEL])
    lcfg = local_config(cfg, model)

    def body(p, x, s, lengths):
        y, s = forward.prefill(
            p.local(), lcfg, x, _local_state(s), lengths, backend=backend, interpret=interpret
        )
        return _reduce(y, model), _sharded_state(s)

    specs = state_specs()
    run = _shard_map(body, sp, (P(DATA), specs, P(DATA)), (P(DATA), specs), backend)
    return run(sp, x, state, lengths)


def decode(
    params: ShardedParams,
    cfg: KdaConfig,
    x: jax.Array,
    state: KdaState,
    *,
    backend: str | None = None,
    interpret: bool | None = None,
):
    """`forward.decode` on the mesh of `params`: x [B, D] -> (y [B, D], new sharded state)."""
    _check(params, cfg, x, state, 2, "decode")
    return _decode(params, cfg, x, state, backend=backends.resolve(backend), interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode(sp, cfg, x, state, *, backend, interpret):
    model = int(sp.mesh.shape[MODEL])
    lcfg = local_config(cfg, model)

    def body(p, x, s):
        y, s = forward.decode(
            p.local(), lcfg, x, _local_state(s), backend=backend, interpret=interpret
        )
        return _reduce(y, model), _sharded_state(s)

    specs = state_specs()
    return _shard_map(body, sp, (P(DATA), specs), (P(DATA), specs), backend)(sp, x, state)


def decode_k(
    params: ShardedParams,
    cfg: KdaConfig,
    x: jax.Array,
    state: KdaState,
    *,
    backend: str | None = None,
    interpret: bool | None = None,
):
    """`forward.decode_k` on the mesh of `params`: x [B, k, D] -> (y [B, k, D], the sharded
    state after the last row, sharded snapshots [B, k, ...]); `select_snapshot` takes them."""
    _check(params, cfg, x, state, 3, "decode_k")
    k = x.shape[1]
    if not 1 <= k <= cfg.max_verify:
        raise ValueError(f"decode_k: k={k} rows, expected 1 <= k <= max_verify={cfg.max_verify}")
    return _decode_k(params, cfg, x, state, backend=backends.resolve(backend), interpret=interpret)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode_k(sp, cfg, x, state, *, backend, interpret):
    model = int(sp.mesh.shape[MODEL])
    lcfg = local_config(cfg, model)

    def body(p, x, s):
        y, s, snaps = forward.decode_k(
            p.local(), lcfg, x, _local_state(s), backend=backend, interpret=interpret
        )
        return _reduce(y, model), _sharded_state(s), _sharded_state(snaps)

    specs = state_specs()
    out = (P(DATA), specs, state_specs(snapshots=True))
    return _shard_map(body, sp, (P(DATA), specs), out, backend)(sp, x, state)


def load_hf_sharded(
    path, layer_idx: int, mesh: Mesh, cfg: KdaConfig | None = None, *, dtype=jnp.bfloat16
) -> tuple[KdaConfig, ShardedParams]:
    """Layer `layer_idx` of a Hugging Face checkpoint straight into the sharded layout.

    Each device's blocks are read from the safetensors files alone (`get_slice`): no device and
    no host holds a whole matrix of another shard. Checks and errors as `load_hf_params`.
    Returns (cfg, params on `mesh`); the values equal `shard_params(load_hf_params(...))`.
    """
    from kda_jax.hf import checked_layer

    model = _model_size(mesh, "load_hf_sharded")
    cfg, ckpt, prefix, conv_names = checked_layer(path, layer_idx, cfg)
    lcfg = local_config(cfg, model)
    p, h, w, d = cfg.qkv_dim, cfg.heads, cfg.conv_kernel, cfg.hidden
    pl, hl = lcfg.qkv_dim, lcfg.heads
    all_ = slice(None)

    def read(short, *index):
        return np.asarray(ckpt.read_slice(prefix + short, index), np.float32)

    def w_in(index):
        i = index[0].start // lcfg.in_proj_dim if index[0].start else 0
        rows = [read(f"{n}_proj.weight", slice(i * pl, (i + 1) * pl)) for n in "qkv"]
        rows += [read("f_a_proj.weight", all_), read("g_a_proj.weight", all_)]
        rows.append(read("b_proj.weight", slice(i * hl, (i + 1) * hl)))
        return np.concatenate(rows)[:, index[1]]

    def conv_w(index):
        ch = index[1]
        a, b = ch.start or 0, p if ch.stop is None else ch.stop
        if len(conv_names) == 1:  # one fused [3P, (1,) W] tensor
            parts = [read(conv_names[0], slice(j * p + a, j * p + b)) for j in range(3)]
        else:
            parts = [read(f"{n}_conv1d.weight", slice(a, b)) for n in "qkv"]
        return np.stack([q.reshape(b - a, w) for q in parts])[index[0]][..., index[2]]

    def small(short, n):  # [H] / [1, 1, H, 1] / [H, K] tensors: a few floats, read whole
        return lambda index: read(short, all_).reshape(n)[index]

    readers = dict(
        w_in=(w_in, (model * lcfg.in_proj_dim, d), dtype),
        f_b=(lambda ix: read("f_b_proj.weight", *ix), (p, cfg.head_dim), dtype),
        g_b=(lambda ix: read("g_b_proj.weight", *ix), (p, cfg.head_dim), dtype),
        conv_w=(conv_w, (3, p, w), jnp.float32),
        a_log=(small("A_log", h), (h,), jnp.float32),
        dt_bias=(small("dt_bias", p), (p,), jnp.float32),
        o_norm_w=(lambda ix: read("o_norm.weight", *ix), (cfg.head_dim,), jnp.float32),
        o_proj=(lambda ix: read("o_proj.weight", *ix), (d, p), dtype),
    )
    fields = {}
    for name, (reader, shape, dt) in readers.items():
        sharding = NamedSharding(mesh, _SHARDED_SPECS[name])
        fields[name] = jax.make_array_from_callback(
            shape, sharding, lambda ix, r=reader, dt=dt: r(ix).astype(jnp.dtype(dt))
        )
    return cfg, ShardedParams(**fields, mesh=mesh)
