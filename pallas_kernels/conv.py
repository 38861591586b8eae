"""Short causal depthwise conv + SiLU + per-head L2 of q and k (SPEC §1), decode and prefill.

`y[t, c] = SiLU(sum_{j<W} w[c, j] * x[t-W+1+j, c])`, then every head_dim group of the first
`qk_channels` channels (q and k) is scaled by `rsqrt(sum y^2 + l2_eps)`; v passes unnormalised.

Channels are viewed as `C/K` head groups of `K = head_dim` lanes (`c = group*K + d`, a free
reshape), and a program owns `block_heads` whole groups, so the L2 reduction never leaves it.
Groups `< qk_channels / K` are q or k heads; a tile may straddle the q|k|v boundaries. A row's
output depends on the last W raw inputs only: conv_decode gives every W-1 rows of a verify a
program of their own per (sequence, channel tile), the first of which alone reads the carried
state; conv_prefill computes an interior time tile as one tile from W shifted loads of x, and
walks the rows of the first tile (which reads the carried state) and of a short last one.
Every row is summed in `_conv_row`'s order, the one place the arithmetic order is fixed, so R
rows of one `conv_decode` call give the bits of R serial 1-row calls.

conv_decode and conv_prefill can hand their output back as separate channel ranges (`splits`:
q, k, v, each written by the programs whose tiles fall in it, so the block never copies slices
of it). conv_decode writes the new conv state over the old one (`input_output_aliases`: only the
program of the first W-1 rows reads its tile of the old state; it passes a barrier, then writes
the same tile), which spares a decode or verify loop the copy of its carried state; the per-row
states a verify keeps are a separate output (`snapshots`), so the new state is never a slice
copied out of them.
conv_decode's launch is laid out once as a `DecodePlan` (`plan_decode`), which its own call runs
and which `front.decode_front` runs beside the f_b | g_b sweep's programs.

Conv state layout (`KdaState.conv`): [B, W-1, C] fp32, oldest first (`[:, -1]` = previous row).
With `slots`, conv_decode takes a pool [N, W-1, C] whole and each program reads and writes its
tile at its row's slot (`_state_view`); conv_prefill takes the B rows (the caller gathers and
scatters them: [B, W-1, C] is small).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common

__all__ = ["ConvBlockSizes", "conv_decode", "conv_prefill"]

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ConvBlockSizes:
    """Tiling of the conv kernels.

    Attributes:
      block_heads: head groups (of K channels) per program, a power of two dividing C/K.
      block_t: rows per program along T (prefill only), a power of two.
      num_warps: Triton warps per program.
    """

    block_heads: int
    block_t: int = 1
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_heads", "block_t", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"ConvBlockSizes.{name}={v}: expected a power of two >= 1")

    @staticmethod
    def get_default(t: int, groups: int, head_dim: int) -> ConvBlockSizes:
        """Decode (t = 1): 256-channel tiles, 4 warps, at every B (many small programs: faster
        than 1K-channel tiles at B = 64, and B = 1 still gets 48 programs); prefill (t = T):
        128 channels x 32 rows per program at 4 warps (the fastest of a block_t x block_heads x
        num_warps sweep on an H100 at B=1 T=8192 and B=16 T=1024, Kimi-Linear geometry).
        conv_decode passes t = 1 whatever R is, so R never changes the tiling (bit-equality
        with serial calls)."""
        divisor = groups & -groups
        if t <= 1:
            return ConvBlockSizes(block_heads=min(divisor, max(1, 256 // head_dim)))
        return ConvBlockSizes(
            block_heads=min(divisor, max(1, 128 // head_dim)), block_t=32, num_warps=4
        )


def _conv_row(window, x_row, taps, qk_mask, l2_eps):
    """One output row. window: W-1 tiles [HB, K] fp32 (oldest first); x_row: [HB, K] fp32;
    taps: W tiles [HB, K] fp32; qk_mask: [HB, 1] bool (q/k heads). Returns [HB, K] fp32."""
    y = taps[0] * window[0]
    for j in range(1, len(window)):
        y = y + taps[j] * window[j]
    y = y + taps[-1] * x_row
    y = y * jax.nn.sigmoid(y)
    inv = lax.rsqrt(jnp.sum(y * y, axis=-1, keepdims=True) + l2_eps)
    return jnp.where(qk_mask, y * inv, y)


def _qk_mask(block_heads: int, qk_groups: int, j):
    """[HB, 1] bool: which head groups of channel tile j are q or k."""
    group = j * block_heads + lax.broadcasted_iota(jnp.int32, (block_heads, 1), 0)
    return group < qk_groups


def _conv_decode_program(
    x_ref,  # [R, HB, K]
    state_ref,  # [W-1, HB, K]; pooled: the whole pool [N, W-1, C/K, K]
    *refs,  # W taps [HB, K]; pooled: pool slot [1]; per segment out [R, HB, K];
    # new state [W-1, HB, K] (pooled: the pool, aliased); snapshots [R, W-1, HB, K]
    j,
    slot,
    rows,
    width,
    qk_groups,
    l2_eps,
    tiles,
    snapshots,
    pooled,
    interpret,
):
    """Rows slot*G .. slot*G + G-1 (G = min(R, W-1)) of channel tile j of one sequence (j, slot:
    traced scalars read outside any `pl.when`). A row's output and the state after it depend on
    the last W raw inputs only, never on another row's output, so a verify's rows run in
    programs of G rows side by side. Only slot 0's rows read the carried state; slot 0 then
    writes the new state over the old one, which no other program needs (their inputs are all
    rows of x: where a select could pick the state, it is never picked).
    The new state is written into state_ref's memory; the snapshots ref [R, W-1, HB, K] comes
    last, with `snapshots` only. `tiles`: the first channel tile of each segment and the end
    (this program's segment is where its tile falls; the other segments' refs point at a
    clamped tile and are not written). A barrier orders every thread's loads of the old state
    before any thread's stores of the new one (a store's thread need not be the one that loaded
    that element)."""
    states_ref = refs[-1] if snapshots else None
    refs = refs[:-1] if snapshots else refs
    tap_refs, refs = refs[:width], refs[width:]
    pool_slot, refs = (refs[0][0], refs[1:]) if pooled else (None, refs)
    out_refs, new_state_ref = refs[:-1], refs[-1]
    taps = [r[...].astype(f32) for r in tap_refs]
    hb = x_ref.shape[1]
    qk_mask = _qk_mask(hb, qk_groups, j)
    size = min(rows, width - 1)
    one = rows == size  # a single program per tile: static row positions
    state_at, keep = _state_view(state_ref, pool_slot, j, hb)

    def raw(q):
        """The raw input at row position q (below 0: the carried state), [HB, K] fp32."""
        if isinstance(q, int):  # static positions (every row when one program holds them all)
            return (
                x_ref[q].astype(f32) if q >= 0 else state_ref[state_at(width - 1 + q)].astype(f32)
            )
        # Both loads are in bounds; the select copies one of them exactly.
        from_x = x_ref[jnp.clip(q, 0, rows - 1)].astype(f32)
        from_state = state_ref[state_at(jnp.clip(width - 1 + q, 0, width - 2))]
        return jnp.where(q >= 0, from_x, from_state.astype(f32))

    # Every load before the first store: a load after a store waits for it (the refs cannot be
    # told apart), which made R rows R memory round trips.
    base = 0 if one else slot * size
    inputs = [raw(base - (width - 1) + i) for i in range(size + width - 1)]
    # The state after the last row: the raw inputs at rows R-W+1 .. R-1 (the tail of `inputs`
    # when one program holds every row).
    last = inputs[size:] if one else [raw(q) for q in range(rows - width + 1, rows)]
    for i in range(size):
        window, x_row = inputs[i : i + width - 1], inputs[i + width - 1]
        y = _conv_row(window, x_row, taps, qk_mask, l2_eps)
        after = inputs[i + 1 : i + width]

        def store(r=base + i, y=y, after=after):
            _store_segment(out_refs, tiles, j, r, keep(y))
            if snapshots:
                for t in range(width - 1):
                    states_ref[r, t] = keep(after[t])

        if one:
            store()
        else:  # the last program's rows may run past R
            pl.when(base + i < rows)(store)
    common.barrier(interpret)

    def store_state():
        for t in range(width - 1):
            new_state_ref[state_at(t)] = last[t]

    writes = [] if one else [slot == 0]
    if pooled:
        writes.append(pool_slot >= 0)
    if writes:
        pl.when(functools.reduce(jnp.logical_and, writes))(store_state)
    else:
        store_state()


def _state_view(state_ref, pool_slot, j, hb):
    """How a decode program reaches its tile of the conv state: `state_at(t)`, the index of
    state row t in state_ref, and `keep(v)`, a stored output or snapshot tile. Dense: the
    BlockSpec's tile, every row kept. Pooled: pool[slot] at channel tile j; a row whose slot is
    negative reads slot 0 (in bounds, never kept) and stores 0 (slot -1, padding) or NaN
    (below -1: a row the caller refused)."""
    if pool_slot is None:
        return (lambda t: t), (lambda v: v)
    row = jnp.maximum(pool_slot, 0)
    fill = jnp.where(pool_slot == -1, f32(0), f32(jnp.nan))  # typed: Triton lowering
    return (
        lambda t: (row, t, pl.ds(j * hb, hb), slice(None)),
        lambda v: jnp.where(pool_slot >= 0, v, fill),
    )


def _store_segment(out_refs, tiles, j, row, y):
    """out_refs[s][row] = y for the segment s whose channel tiles [tiles[s], tiles[s+1]) hold
    this program's tile j (the other segments' refs point at a clamped tile: not written)."""
    if len(out_refs) == 1:
        out_refs[0][row] = y
        return
    for s, out_ref in enumerate(out_refs):

        def store(out_ref=out_ref):
            out_ref[row] = y

        pl.when((j >= tiles[s]) & (j < tiles[s + 1]))(store)


def _segments(splits, c: int, lanes: int, what: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(widths, tiles) of the output segments: `splits` (or the whole C) and the first channel
    tile of each segment plus the end; each width a positive multiple of the tile's lanes."""
    widths = (c,) if splits is None else tuple(int(v) for v in splits)
    if sum(widths) != c or any(v <= 0 or v % lanes for v in widths):
        raise ValueError(
            f"{what}: splits={splits}: expected positive multiples of the {lanes}-channel "
            f"tile summing to C={c}"
        )
    return widths, common.bounds(v // lanes for v in widths)


def _segment_spec(block, tiles, s: int, index, ids=lambda *g: g[:2]):
    """BlockSpec of output segment s: `index(sequence, tile)` places the program's tile, clamped
    into the segment (programs of other segments get a clamped block they never write); `ids`
    maps the grid ids to (sequence, channel tile)."""
    lo, hi = tiles[s], tiles[s + 1]

    def place(*g):
        i, j = ids(*g)
        return index(i, jnp.clip(j - lo, 0, hi - lo - 1))

    return pl.BlockSpec(block, place)


def _tap_specs(width: int, hb: int, k: int, index_of_group):
    """W BlockSpecs over w viewed as [C/K, K, W], one per tap column."""
    return [
        pl.BlockSpec((hb, k, None), lambda *ids, j=j: (index_of_group(*ids), 0, j))
        for j in range(width)
    ]


def _check(x, conv_state, w, qk_channels, head_dim, what):
    b, _, c = x.shape
    width = w.shape[1]
    if tuple(w.shape) != (c, width) or tuple(conv_state.shape) != (b, width - 1, c):
        raise ValueError(
            f"{what}: x {x.shape}, conv_state {conv_state.shape}, w {w.shape}: expected "
            "x [B, R|T, C], conv_state [B, W-1, C], w [C, W]"
        )
    if head_dim & (head_dim - 1) or c % head_dim or qk_channels % head_dim or qk_channels > c:
        raise ValueError(
            f"{what}: C={c}, qk_channels={qk_channels}, head_dim={head_dim}: head_dim must be a "
            "power of two dividing C and qk_channels (whole heads per channel tile)"
        )
    if width < 2:
        raise ValueError(f"{what}: conv width W={width} must be >= 2")


def _check_pool(pool, slots, b: int, what: str) -> None:
    """A pool [N >= 1, ...] and its slots [B] of integers."""
    if pool.ndim < 1 or pool.shape[0] < 1:
        raise ValueError(f"{what}: the pool has shape {tuple(pool.shape)}, expected N >= 1 rows")
    if tuple(slots.shape) != (b,) or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(
            f"{what}: slots has shape {tuple(slots.shape)} and dtype {slots.dtype}, expected "
            f"[{b}] integers"
        )


def _slots(rows: int, width: int) -> int:
    """conv_decode's programs per (sequence, channel tile): one per W-1 rows."""
    return common.cdiv(rows, min(rows, width - 1))


def _flat_ids(p, b: int, tiles: int, slots: int):
    """Program p of a 1-D grid -> (sequence, channel tile, slot), clamped to the last program."""
    p = jnp.minimum(p, b * tiles * slots - 1)
    return p // (tiles * slots), (p // slots) % tiles, p % slots


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """conv_decode laid out for a launch (`plan_decode`): `conv_decode` runs it alone;
    `front.decode_front` runs its programs in a grid it shares with the f_b | g_b sweep.

    Attributes:
      inputs, in_specs: x, the conv state (or pool), the W tap views of w, the pool slots when
        pooled, with their BlockSpecs.
      out_shape, out_specs: one output per segment, the new state, the snapshots if asked.
      kernel_kw: the static arguments of `_conv_decode_program` (its `tiles`: the segments'
        first channel tiles and the end; `interpret`: the launch's mode).
      num_warps: the tiling's; shape: (B, R, C, W); splits: the call's, for `finish`.
    """

    inputs: tuple
    in_specs: tuple
    out_shape: tuple
    out_specs: tuple
    kernel_kw: dict
    num_warps: int
    shape: tuple[int, int, int, int]
    splits: tuple[int, ...] | None

    @property
    def tiles(self) -> int:
        """Channel tiles of one sequence."""
        return self.kernel_kw["tiles"][-1]

    @property
    def slots(self) -> int:
        """Programs per (sequence, channel tile): one per W-1 rows."""
        return _slots(self.shape[1], self.shape[3])

    @property
    def interpret(self) -> bool:
        """Whether the launch that runs the plan is interpreted."""
        return self.kernel_kw["interpret"]

    @property
    def programs(self) -> int:
        return self.shape[0] * self.tiles * self.slots

    @property
    def state_output(self) -> int:
        """Index of the new state among the outputs (aliased to input 1, the old state)."""
        return len(self.kernel_kw["tiles"]) - 1

    def flat_ids(self, p):
        """Program p of a 1-D grid -> (sequence, channel tile, slot); programs at or past
        `programs` get the last one's (they see its blocks and must not run `program`)."""
        return _flat_ids(p, self.shape[0], self.tiles, self.slots)

    def program(self, refs, j, slot) -> None:
        """Slot `slot` of channel tile j of the sequence the BlockSpecs picked; refs: inputs',
        then outputs'."""
        _conv_decode_program(*refs, j=j, slot=slot, **self.kernel_kw)

    def finish(self, res):
        """The launch's outputs -> (out or its segments, new_state, states | None)."""
        b, r, c, width = self.shape
        n_out = self.state_output
        outs = tuple(o.reshape(b, r, o.shape[2] * o.shape[3]) for o in res[:n_out])
        new_state = res[n_out].reshape(res[n_out].shape[0], width - 1, c)
        states = res[n_out + 1].reshape(b, r, width - 1, c) if self.kernel_kw["snapshots"] else None
        return (outs[0] if self.splits is None else outs), new_state, states


def plan_decode(
    x,
    conv_state,
    w,
    *,
    qk_channels: int,
    head_dim: int,
    l2_eps: float,
    splits=None,
    snapshots: bool = False,
    slots: jax.Array | None = None,
    block_sizes: ConvBlockSizes | None = None,
    flat: bool = False,
    interpret: bool | None = None,
) -> DecodePlan:
    """Validates conv_decode's arguments and lays out its launch: for a grid (B, tiles, slots),
    or with `flat` for a 1-D grid whose first B * tiles * slots programs are the conv's
    (`DecodePlan.flat_ids`; later programs see the last one's blocks and must not run
    `program`). `interpret`: the mode of the launch that runs it (None: when there is no
    GPU). `slots`: as in `conv_decode`."""
    b, r, c = x.shape
    if slots is not None:
        _check_pool(conv_state, slots, b, "conv_decode")
    rows_state = (
        conv_state if slots is None else jax.ShapeDtypeStruct((b, *conv_state.shape[1:]), f32)
    )
    _check(x, rows_state, w, qk_channels, head_dim, "conv_decode")
    width, k = w.shape[1], head_dim
    groups = c // k
    blk = block_sizes or ConvBlockSizes.get_default(1, groups, k)
    hb = blk.block_heads
    if groups % hb:
        raise ValueError(f"conv_decode: block_heads={hb} must divide the {groups} head groups")
    widths, tiles = _segments(splits, c, hb * k, "conv_decode")
    n_tiles = groups // hb
    if flat:
        ids = lambda p: _flat_ids(p, b, n_tiles, _slots(r, width))[:2]  # noqa: E731
    else:
        ids = lambda i, j, slot: (i, j)  # noqa: E731
    at = lambda index: lambda *g: index(*ids(*g))  # noqa: E731
    state_spec = pl.BlockSpec((None, width - 1, hb, k), at(lambda i, j: (i, 0, j, 0)))
    pool = ()
    if slots is not None:  # the whole pool, reached at each row's slot in the kernel
        state_spec = pl.no_block_spec
        pool = ((slots.astype(jnp.int32),), (pl.BlockSpec((1,), at(lambda i, j: (i,))),))
    snap_shapes, snap_specs = [], []
    if snapshots:
        snap_shapes = [jax.ShapeDtypeStruct((b, r, width - 1, groups, k), f32)]
        snap_specs = [pl.BlockSpec((None, r, width - 1, hb, k), at(lambda i, j: (i, 0, 0, j, 0)))]
    return DecodePlan(
        inputs=(
            x.reshape(b, r, groups, k),
            conv_state.astype(f32).reshape(-1, width - 1, groups, k),
            *([w.reshape(groups, k, width)] * width),
            *(pool[0] if pool else ()),
        ),
        in_specs=(
            pl.BlockSpec((None, r, hb, k), at(lambda i, j: (i, 0, j, 0))),
            state_spec,
            *_tap_specs(width, hb, k, at(lambda i, j: j)),
            *(pool[1] if pool else ()),
        ),
        out_shape=(
            *(jax.ShapeDtypeStruct((b, r, v // k, k), f32) for v in widths),
            jax.ShapeDtypeStruct((conv_state.shape[0], width - 1, groups, k), f32),
            *snap_shapes,
        ),
        out_specs=(
            *(
                _segment_spec((None, r, hb, k), tiles, s, lambda i, g: (i, 0, g, 0), ids)
                for s in range(len(widths))
            ),
            state_spec,
            *snap_specs,
        ),
        kernel_kw=dict(
            rows=r,
            width=width,
            qk_groups=qk_channels // k,
            l2_eps=l2_eps,
            tiles=tiles,
            snapshots=snapshots,
            pooled=slots is not None,
            interpret=common.resolve_interpret(interpret),
        ),
        num_warps=blk.num_warps,
        shape=(b, r, c, width),
        splits=None if splits is None else tuple(int(v) for v in splits),
    )


def conv_decode(
    x: jax.Array,
    conv_state: jax.Array,
    w: jax.Array,
    *,
    qk_channels: int,
    head_dim: int,
    l2_eps: float,
    splits: tuple[int, ...] | None = None,
    snapshots: bool = False,
    slots: jax.Array | None = None,
    block_sizes: ConvBlockSizes | None = None,
    interpret: bool | None = None,
):
    """Conv step for R new rows per sequence; the kernel of `reference.conv_decode_reference`.

    Args:
      x: [B, R, C] raw (pre-conv) q|k|v rows, any float dtype.
      conv_state: [B, W-1, C] fp32, the last W-1 raw inputs, oldest first.
      w: [C, W] fp32 taps; w[:, W-1] multiplies the current row.
      qk_channels: the leading channels (q|k) to L2-normalise per head.
      head_dim: K, the L2 group size.
      l2_eps: added to the sum of squares before rsqrt.
      splits: channel widths summing to C (e.g. q, k, v): `out` comes back as that many arrays,
        each written by the kernel (no slice copies); each must be a multiple of the kernel's
        channel tile (whole heads: the block's P = H * K always is).
      snapshots: also return the conv state after every row.
      slots: [B] int32 or None. When given, conv_state is a pool [N, W-1, C] and row b reads
        and writes pool row slots[b] in the kernel (no gathered copy); a negative slot reads
        and writes nothing, and that row's out and states are 0 (slot -1) or NaN (below -1).
        Non-negative slots must be distinct and below N (two programs would race on a row).
      block_sizes: tiling (default `ConvBlockSizes.get_default(1, C/K, K)`); it must not
        depend on R when R-row calls must equal serial calls.
      interpret: run in Pallas interpret mode (None: when there is no GPU).
    Returns:
      out: [B, R, C] fp32, SiLU(conv) with q and k L2-normalised per head; with `splits`, a
        tuple of [B, R, c_s].
      new_state: [B, W-1, C] fp32, the conv state after the last row, written over conv_state's
        memory when the caller donates it; with slots, the whole pool [N, W-1, C], only the
        named rows changed.
      states: [B, R, W-1, C] fp32, the conv state after each row, or None without `snapshots`.
    """
    cp = plan_decode(
        x,
        conv_state,
        w,
        qk_channels=qk_channels,
        head_dim=head_dim,
        l2_eps=l2_eps,
        splits=splits,
        snapshots=snapshots,
        slots=slots,
        block_sizes=block_sizes,
        interpret=interpret,
    )

    def kernel(*refs):
        cp.program(refs, pl.program_id(1), pl.program_id(2))

    res = pl.pallas_call(
        kernel,
        out_shape=cp.out_shape,
        grid=(x.shape[0], cp.tiles, cp.slots),
        in_specs=cp.in_specs,
        out_specs=cp.out_specs,
        compiler_params=plt.CompilerParams(num_warps=cp.num_warps, num_stages=1),
        input_output_aliases={1: cp.state_output},
        name="kda_conv_decode",
        interpret=cp.interpret,
    )(*cp.inputs)
    return cp.finish(res)


def _conv_prefill_kernel(
    len_ref,  # [1] int32, this sequence's length
    x_ref,  # [T, HB, K], the whole sequence
    state_ref,  # [W-1, HB, K]
    *refs,  # W taps [HB, K]; per segment out [T, HB, K]; new state [W-1, HB, K]
    width,
    block_t,
    t_total,
    qk_groups,
    l2_eps,
    tiles,
):
    """Rows t0 .. t0 + block_t - 1 of channel tile j of one sequence (`tiles`: as in
    `_conv_decode_program`). An interior tile (its W-1 previous rows and all its rows inside x)
    computes its rows as one [block_t, HB, K] tile from W shifted loads of x; the first tile
    (which reads the old state) and a short last one walk their rows, carrying the window in
    registers. Both add the taps in `_conv_row`'s order."""
    tap_refs, out_refs, new_state_ref = refs[:width], refs[width:-1], refs[-1]
    j = pl.program_id(1)  # read here: interpret mode cannot see program_id inside pl.when
    length = len_ref[0]
    taps = [r[...].astype(f32) for r in tap_refs]
    qk_mask = _qk_mask(x_ref.shape[1], qk_groups, j)
    t0 = pl.program_id(2) * block_t
    dtype = out_refs[0].dtype
    # Static: a sequence shorter than one tile and its window has no interior tile (then every
    # tile walks its rows, with no branch on a constant, which Triton cannot lower).
    has_interior = t_total >= block_t + width - 1
    if has_interior:
        interior = (t0 >= width - 1) & (t0 + block_t <= t_total)

        @pl.when(interior)
        def _():
            y = taps[0] * x_ref[pl.ds(t0 - (width - 1), block_t)].astype(f32)
            for i in range(1, width):
                y = y + taps[i] * x_ref[pl.ds(t0 - (width - 1) + i, block_t)].astype(f32)
            y = y * jax.nn.sigmoid(y)
            inv = lax.rsqrt(jnp.sum(y * y, axis=-1, keepdims=True) + l2_eps)
            y = jnp.where(qk_mask[None], y * inv, y)
            rows = t0 + lax.broadcasted_iota(jnp.int32, (block_t, 1, 1), 0)
            y = jnp.where(rows < length, y, 0.0).astype(dtype)
            _store_segment(out_refs, tiles, j, pl.ds(t0, block_t), y)

    def raw(pos):
        """Raw input at position pos (>= -(W-1)) as fp32: from x, or from the old conv state
        before the sequence start. Both loads stay in bounds; the select picks one."""
        from_x = x_ref[jnp.clip(pos, 0, t_total - 1)].astype(f32)
        from_state = state_ref[jnp.clip(pos + width - 1, 0, width - 2)].astype(f32)
        return jnp.where(pos >= 0, from_x, from_state)

    def walk():
        def row(i, window):
            t = t0 + i
            x_row = x_ref[jnp.minimum(t, t_total - 1)].astype(f32)
            y = _conv_row(window, x_row, taps, qk_mask, l2_eps)

            @pl.when(t < t_total)
            def _():
                y_t = jnp.where(t < length, y, 0.0).astype(dtype)
                _store_segment(out_refs, tiles, j, t, y_t)

            return (*window[1:], x_row)

        window = tuple(raw(t0 - (width - 1) + i) for i in range(width - 1))
        lax.fori_loop(0, block_t, row, window)

    if has_interior:
        pl.when(~interior)(walk)
    else:
        walk()

    @pl.when(pl.program_id(2) == 0)
    def _():
        for i in range(width - 1):
            new_state_ref[i] = raw(length - (width - 1) + i)


def conv_prefill(
    x: jax.Array,
    conv_state: jax.Array,
    w: jax.Array,
    lengths: jax.Array,
    *,
    qk_channels: int,
    head_dim: int,
    l2_eps: float,
    out_dtype=jnp.float32,
    splits: tuple[int, ...] | None = None,
    block_sizes: ConvBlockSizes | None = None,
    interpret: bool | None = None,
):
    """Causal conv over T padded tokens; the kernel of `reference.conv_prefill_reference`.

    Args:
      x: [B, T, C] raw q|k|v, any float dtype; positions t >= lengths[b] may hold anything
        (NaN included): they never reach a real output or the new state.
      conv_state: [B, W-1, C] fp32, oldest first.
      w: [C, W] fp32 taps.
      lengths: [B] int, real tokens per row (0 <= lengths <= T).
      qk_channels, head_dim, l2_eps, splits, interpret: as in `conv_decode`.
      out_dtype: dtype of out.
      block_sizes: tiling (default `ConvBlockSizes.get_default(T, C/K, K)`).
    Returns:
      out: [B, T, C] out_dtype, SiLU(conv) with q, k L2-normalised, exactly 0 at pad positions;
        with `splits`, a tuple of [B, T, c_s].
      new_state: [B, W-1, C] fp32, the last W-1 raw inputs before position lengths[b] (from the
        old state where lengths[b] < W-1).
    """
    _check(x, conv_state, w, qk_channels, head_dim, "conv_prefill")
    b, t, c = x.shape
    if tuple(lengths.shape) != (b,):
        raise ValueError(f"conv_prefill: lengths has shape {lengths.shape}, expected ({b},)")
    width, k = w.shape[1], head_dim
    groups = c // k
    blk = block_sizes or ConvBlockSizes.get_default(t, groups, k)
    hb, bt = blk.block_heads, blk.block_t
    if groups % hb:
        raise ValueError(f"conv_prefill: block_heads={hb} must divide the {groups} head groups")
    widths, tiles = _segments(splits, c, hb * k, "conv_prefill")
    if t == 0:
        outs = tuple(jnp.zeros((b, 0, v), out_dtype) for v in widths)
        return (outs[0] if splits is None else outs), conv_state.astype(f32)
    kernel = functools.partial(
        _conv_prefill_kernel,
        width=width,
        block_t=bt,
        t_total=t,
        qk_groups=qk_channels // k,
        l2_eps=l2_eps,
        tiles=tiles,
    )
    seq_spec = pl.BlockSpec((None, t, hb, k), lambda i, j, s: (i, 0, j, 0))
    state_spec = pl.BlockSpec((None, width - 1, hb, k), lambda i, j, s: (i, 0, j, 0))
    *outs, new_state = pl.pallas_call(
        kernel,
        out_shape=(
            *(jax.ShapeDtypeStruct((b, t, v // k, k), out_dtype) for v in widths),
            jax.ShapeDtypeStruct((b, width - 1, groups, k), f32),
        ),
        # Time tiles last so a sequence's channel tile is visited by consecutive programs.
        grid=(b, groups // hb, common.cdiv(t, bt)),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j, s: (i,)),
            seq_spec,
            state_spec,
            *_tap_specs(width, hb, k, lambda i, j, s: j),
        ],
        out_specs=(
            *(
                _segment_spec((None, t, hb, k), tiles, s, lambda i, g: (i, 0, g, 0))
                for s in range(len(widths))
            ),
            state_spec,
        ),
        compiler_params=plt.CompilerParams(num_warps=blk.num_warps, num_stages=2),
        name="kda_conv_prefill",
        interpret=common.resolve_interpret(interpret),
    )(
        jnp.clip(lengths.astype(jnp.int32), 0, t),
        x.reshape(b, t, groups, k),
        conv_state.astype(f32).reshape(b, width - 1, groups, k),
        *([w.reshape(groups, k, width)] * width),
    )
    outs = tuple(o.reshape(b, t, o.shape[2] * k) for o in outs)
    return (outs[0] if splits is None else outs), new_state.reshape(b, width - 1, c)
