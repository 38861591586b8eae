"""Decode projections: y = x @ w.T for a few rows, one sweep over the weight (Triton backend).

Shapes (SPEC notation): x [M, D] activations, w [N, D] weight in torch `[out, in]` layout (bf16 or
fp32), y [M, N]. The block's real weights: w_in [3P + 2K + H, D] = [12576, 2304] (58 MB in bf16),
o_proj [D, P] = [2304, 4096], f_b and g_b [P, K] = [4096, 128].

A decode step reads every weight once and does almost no arithmetic, so the kernels are
bandwidth kernels: program `i` owns rows [i*block_n, (i+1)*block_n) of w and walks the whole of D in
power-of-two slices of `block_d` columns (2304 = 9 * 256), streaming each weight byte once; the
last row tile and a ragged last D slice are masked, so N and D need not be tile multiples.

Bit equality between `gemv` and `gemv_batchm` (what makes `decode_k` equal k serial `decode`s):
both run ONE program, `_gemv_kernel`, whose activation tile always has 16 rows (the smallest
tensor-core tile) for M <= 8; rows at or past M are masked to zero on load and never stored. Each
output element is then the same chain of products and fp32 accumulations (tensor-core MMA for
bf16, IEEE fp32 FMA for fp32 weights), in the same order (D slices in sequence), whatever M is and
whatever the other rows hold: a row's bits cannot depend on M. The block sizes must match too, so
`GemvBlockSizes.get_default` ignores M in 1..8. (Elementwise products with a per-row reduction
would also be M-independent but cost 8x the CUDA-core work at M = 8; an M = 16 MMA is free.)

Split reduction: a weight with few row tiles (o_proj, [2304, 4096]: 144 tiles of 16 rows) leaves
most SMs idle, so its D axis is split into `split_d` contiguous ranges on a second grid axis; each
program writes an fp32 partial sum and the partials are added afterwards in a fixed left-to-right
order, elementwise: still the same chain of operations for every row whatever M is.

Outputs without copies: `splits` hands the rows of one weight back as separate arrays (w_in's
q|k|v, f_a, g_a, b: the program whose row tile falls in a part stores it there, so no slice of
the product is ever copied), and `proj_many` sweeps several weights of one shape in one launch
(f_b and g_b: a third grid axis picks the weight). Each output element is still the same chain
of operations whatever M is. Part bounds must be multiples of 16 rows; a bound that is not a
multiple of the default row tile lowers that tile for the whole weight (still independent of
M, so rows keep their bits across M; w_in's bounds are multiples of its tile).

Many rows (9 <= M <= 64: decode at B = 64, a batched verify): the same program with an
activation tile of next_pow2(M) rows and a tiling of its own (`GemvBlockSizes.get_default`).
The product is still bound by the weight's read at these M (w_in at M = 64: 3.7 GFLOP against
58 MB), which this sweep streams once, writing w_in's parts apart, where XLA's dot would also
have to slice its output. Rows above 8 have their own tiling, so their bits need not match the
M <= 8 path's.

`proj` is the stage function the block's forward calls (signature of
`reference.gemv_reference`), `proj_many` the one for several weights; both dispatch on M. On
Hopper, `proj` sends the decode step's w_in (1..16 rows, bf16) to the Mosaic GPU kernel in
`gemv_mgpu.py` instead (`gemv_mgpu.mgpu_fits` says which calls). A
sweep is laid out once as a `SweepPlan` (`plan`), which its own launch runs and which
`front.decode_front` runs beside conv_decode's programs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import common, gemv_mgpu
from pallas_kernels import reference as ref

__all__ = [
    "GemvBlockSizes",
    "MAX_KERNEL_ROWS",
    "MAX_TILE_ROWS",
    "SweepPlan",
    "gemv",
    "gemv_batchm",
    "plan",
    "proj",
    "proj_many",
]

# Rows of the activation tile for M <= MAX_KERNEL_ROWS: M is padded (by masking) to the smallest
# tensor-core tile.
_ROWS = 16
# Most rows whose bits the kernel keeps whatever M is (gemv, gemv_batchm: decode_k's promise).
MAX_KERNEL_ROWS = 8
# Most rows the kernel serves (a tiling of its own above MAX_KERNEL_ROWS); above it `proj` hands
# the product to XLA's dot (cuBLAS / a Triton GEMM fusion).
MAX_TILE_ROWS = 64
_WEIGHT_DTYPES = (jnp.bfloat16, jnp.float32)


def _largest_pow2_divisor(n: int) -> int:
    return n & -n


def _block_d(d: int, cap: int) -> int:
    """D slice width: the largest power of two dividing d, up to `cap`; when d has no such
    divisor >= 32, the next power of two above d (up to `cap`) and a masked last slice instead
    of many thin steps; never below 16 (the tensor-core K)."""
    block_d = min(cap, _largest_pow2_divisor(d))
    if block_d < 32 and d > block_d:
        block_d = min(cap, common.next_pow2(d))
    return max(16, block_d)


@dataclasses.dataclass(frozen=True)
class GemvBlockSizes:
    """Static tiling of one weight sweep.

    Attributes:
      block_n: weight rows per program (power of two, >= 16: the tensor-core N).
      block_d: weight columns per inner-loop step (power of two, >= 16: the tensor-core K).
      num_warps: warps per program.
      num_stages: depth of Triton's software pipeline over the D loop (loads in flight).
      split_d: contiguous D ranges reduced by separate programs (1: no split); each range is a
        whole number of block_d slices.
    """

    block_n: int
    block_d: int
    num_warps: int = 4
    num_stages: int = 4
    split_d: int = 1

    def __post_init__(self):
        for name in ("block_n", "block_d"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemvBlockSizes.{name}={v}: expected a power of two >= 16")

    @classmethod
    def get_default(cls, n: int, d: int, m: int = 1, dtype=jnp.bfloat16) -> GemvBlockSizes:
        """Block sizes for w [n, d] of `dtype` and x [m, d], m <= MAX_TILE_ROWS.

        For m <= MAX_KERNEL_ROWS the result does not depend on m: `gemv` and `gemv_batchm` must
        run the same program for their rows to agree bit for bit (module docstring); m > 8 takes
        `_many_rows`' tiling.
        - block_d: the largest power of two dividing d, up to 256 columns for bf16 (512 B per row
          slice, 16-byte loads across a warp) or 128 for fp32; when d has no such divisor >= 32
          (d = 176 = 11 * 16), the next power of two above d (up to the same cap) and a masked
          last slice instead of many thin steps.
        - block_n: the largest of 64, 32, 16 rows that still yields >= 2 programs per SM
          (w_in: 32 -> 393 programs), else 16; but a weight that still has too few row tiles
          and long rows (o_proj [2304, 4096]) takes 32 x 128 tiles and splits D (split_d = 8).
        """
        if not 1 <= m <= MAX_TILE_ROWS:
            raise ValueError(
                f"GemvBlockSizes.get_default: m={m} rows, expected 1 <= m <= {MAX_TILE_ROWS}"
            )
        if m > MAX_KERNEL_ROWS:
            return cls._many_rows(n, d)
        cap = 256 if jnp.dtype(dtype).itemsize <= 2 else 128
        block_d = _block_d(d, cap)
        block_n = 16
        for cand in (64, 32):
            if common.cdiv(n, cand) >= common.TARGET_PROGRAMS:
                block_n = cand
                break
        split_d, num_stages = 1, 4
        if common.cdiv(n, block_n) < common.TARGET_PROGRAMS and d >= 8 * cap:
            # Few row tiles and long rows (o_proj): 32 x 128 tiles with D split until there are
            # >= 4 programs per SM (an unsplit o_proj leaves most SMs idle).
            block_n, block_d, num_stages = 32, min(block_d, 128), 3
            while (
                common.cdiv(n, block_n) * split_d < 2 * common.TARGET_PROGRAMS
                and d % (2 * split_d * block_d) == 0
            ):
                split_d *= 2
        return cls(block_n=block_n, block_d=block_d, num_stages=num_stages, split_d=split_d)

    @classmethod
    def _many_rows(cls, n: int, d: int) -> GemvBlockSizes:
        """9..64 rows: slices of at most 128 columns (a [64, 128] activation tile and the weight
        tile, pipelined, stay within shared memory); 64 weight rows per program while that
        leaves one program per SM (w_in: 197), else 32 with D split until there are two per SM
        (o_proj: 72 row tiles x 4)."""
        block_d = _block_d(d, 128)
        if common.cdiv(n, 64) >= common.TARGET_PROGRAMS // 2:
            return cls(block_n=64, block_d=block_d, num_stages=3)
        split_d, steps = 1, common.cdiv(d, block_d)
        while common.cdiv(n, 32) * split_d < common.TARGET_PROGRAMS and steps % (2 * split_d) == 0:
            split_d *= 2
        return cls(block_n=32, block_d=block_d, num_stages=3, split_d=split_d)


def _gemv_kernel(*refs, **kw):
    """The sweep's own launch: the program ids are its grid's (row tile, split, group)."""
    _gemv_program(refs, (pl.program_id(0), pl.program_id(1), pl.program_id(2)), **kw)


def _gemv_program(
    refs,
    ids,
    *,
    groups: int,
    m: int,
    rows: int,
    n: int,
    d: int,
    bs: GemvBlockSizes,
    steps: int,
    bounds,
):
    """One program: rows n0:n0+block_n (n0 = ids[0] * block_n) of group ids[2], over the D range
    of split = ids[1] (`steps` slices of block_d); `rows` >= m is the activation tile's height
    (16 for m <= 8). `ids` are traced scalars read outside any `pl.when` (interpret mode cannot
    see program_id inside one), so a launch that shares its grid with other work can pass its own.

    refs: x refs [m, d] (any float dtype, cast to w's dtype on load, as the reference does), one
    per group; w refs [n, d], one per group; then per group one y ref [split_d, m, n_s] per output
    segment, segment s holding rows bounds[s]:bounds[s+1] (block_n divides every inner bound, so a
    program's rows fall in one segment). Loads and stores are masked at row m, row n, column d.
    """
    block_n, block_d = bs.block_n, bs.block_d
    xs, ws, ys = refs[:groups], refs[groups : 2 * groups], refs[2 * groups :]
    segments = len(bounds) - 1
    n0 = ids[0] * block_n
    split = ids[1]
    first = split * steps
    x_rows = lax.broadcasted_iota(jnp.int32, (rows, block_d), 0) < m  # [rows, block_d]
    w_rows = n0 + lax.broadcasted_iota(jnp.int32, (block_n, block_d), 0) < n  # [block_n, block_d]
    ragged_n = n % block_n != 0
    ragged_d = d % block_d != 0

    def sweep(x_ref, w_ref):
        def step(i, acc):
            k0 = pl.multiple_of((first + i) * block_d, block_d)
            x_mask, w_mask = x_rows, (w_rows if ragged_n else None)
            if ragged_d:
                x_cols = k0 + lax.broadcasted_iota(jnp.int32, (rows, block_d), 1) < d
                w_cols = k0 + lax.broadcasted_iota(jnp.int32, (block_n, block_d), 1) < d
                x_mask = x_mask & x_cols
                w_mask = w_cols if w_mask is None else w_mask & w_cols
            xt = plt.load(x_ref.at[pl.ds(0, rows), pl.ds(k0, block_d)], mask=x_mask, other=0)
            wt = plt.load(
                w_ref.at[pl.ds(n0, block_n), pl.ds(k0, block_d)],
                mask=w_mask,
                other=None if w_mask is None else 0,
                eviction_policy="evict_first",  # every weight byte is read once: do not keep it
            )
            part = lax.dot_general(
                xt.astype(wt.dtype),
                wt,
                (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32,
                precision=lax.Precision.HIGHEST,  # fp32 weights: IEEE fp32, not TF32
            )
            return acc + part

        return lax.fori_loop(0, steps, step, jnp.zeros((rows, block_n), jnp.float32))

    def store(y_ref, acc, lo, hi):
        y_rows = lax.broadcasted_iota(jnp.int32, (rows, block_n), 0) < m
        y_cols = n0 + lax.broadcasted_iota(jnp.int32, (rows, block_n), 1) < hi
        plt.store(
            y_ref.at[split, pl.ds(0, rows), pl.ds(n0 - lo, block_n)],
            acc.astype(y_ref.dtype),
            mask=y_rows & y_cols,
        )

    def group(g):
        acc = sweep(xs[g], ws[g])
        if segments == 1:
            store(ys[g], acc, 0, n)
            return
        for s in range(segments):
            lo, hi = bounds[s], bounds[s + 1]
            pl.when((n0 >= lo) & (n0 < hi))(
                functools.partial(store, ys[g * segments + s], acc, lo, hi)
            )

    if groups == 1:
        group(0)
    else:
        for g in range(groups):
            pl.when(ids[2] == g)(functools.partial(group, g))


def _check(x: jax.Array, w: jax.Array, what: str, m_range: tuple[int, int]) -> None:
    if w.ndim != 2 or w.dtype not in _WEIGHT_DTYPES:
        raise ValueError(
            f"{what}: w has shape {tuple(w.shape)} and dtype {w.dtype}, expected [N, D] "
            "bfloat16 or float32"
        )
    if x.ndim != 2 or x.shape[1] != w.shape[1] or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"{what}: x has shape {tuple(x.shape)} and dtype {x.dtype}, expected [M, D] float "
            f"with D = {w.shape[1]} (w is {tuple(w.shape)})"
        )
    lo, hi = m_range
    if not lo <= x.shape[0] <= hi:
        raise ValueError(f"{what}: x has M = {x.shape[0]} rows, expected {lo} <= M <= {hi}")


def _check_groups(xs, ws, what: str) -> None:
    """As many activations as weights (at least one), one x shape and one w shape and dtype."""
    if not xs or len(xs) != len(ws) or xs[0].ndim != 2 or xs[0].shape[0] < 1:
        raise ValueError(
            f"{what}: {len(xs)} activations and {len(ws)} weights, expected as many of each "
            "(at least one), activations [M, D] with M >= 1"
        )
    if any(x.shape != xs[0].shape for x in xs) or any(
        w.shape != ws[0].shape or w.dtype != ws[0].dtype for w in ws
    ):
        raise ValueError(
            f"{what}: every group needs the same x and w shapes and w dtype, got x "
            f"{[tuple(a.shape) for a in xs]}, w {[(tuple(a.shape), a.dtype) for a in ws]}"
        )


def _bounds(n: int, splits) -> tuple[int, ...]:
    """Segment bounds (0, ..., n) of the output rows for `splits`: positive widths summing to n,
    every inner bound a multiple of 16 (the smallest row tile). Checked whatever M is, so the
    same call is accepted or refused on the kernel and the XLA paths alike."""
    if splits is None:
        return (0, n)
    splits = tuple(int(v) for v in splits)
    if not splits or min(splits) < 1 or sum(splits) != n:
        raise ValueError(f"splits={splits}: expected positive widths summing to N={n}")
    bounds = common.bounds(splits)
    if any(b % 16 for b in bounds[1:-1]):
        raise ValueError(
            f"splits={splits}: every part but the last must end at a multiple of 16 rows "
            f"(the kernel's smallest row tile); the parts end at {bounds[1:-1]}"
        )
    return bounds


@dataclasses.dataclass(frozen=True)
class SweepPlan:
    """One sweep of `groups` weights laid out for a launch (`plan`): `_launch` runs it alone;
    `front.decode_front` runs its programs in a grid it shares with conv_decode's.

    Attributes:
      inputs: xs, then ws (the refs `program` reads, in order).
      out_shape: one buffer [split_d, M, n_s] per group and output segment (fp32 partial sums
        when split_d > 1, else out_dtype).
      kernel_kw: the static arguments of `_gemv_program` (the tiling, groups and bounds that
        `grid` and `finish` read back).
      out_dtype, splits: the results' dtype and the call's `splits`, for `finish`.
    """

    inputs: tuple
    out_shape: tuple
    kernel_kw: dict
    out_dtype: jnp.dtype
    splits: tuple[int, ...] | None

    @property
    def block_sizes(self) -> GemvBlockSizes:
        return self.kernel_kw["bs"]

    @property
    def grid(self) -> tuple[int, int, int]:
        """(row tiles, split_d, groups)."""
        bs, kw = self.block_sizes, self.kernel_kw
        return common.cdiv(kw["n"], bs.block_n), bs.split_d, kw["groups"]

    def program(self, refs, ids) -> None:
        """One program of the sweep; refs: `inputs`' refs then `out_shape`'s; ids: (row tile,
        split, group) as traced scalars."""
        _gemv_program(refs, ids, **self.kernel_kw)

    def finish(self, parts) -> list:
        """The launch's buffers -> per group, y [M, N] (or a tuple of segments with `splits`).
        Split partial sums are added in a fixed left-to-right order, elementwise: the same chain
        of operations for every row whatever M is."""
        out = []
        for p in parts:
            y = p[0]
            for i in range(1, self.block_sizes.split_d):
                y = y + p[i]
            out.append(y.astype(self.out_dtype))
        segments = len(self.kernel_kw["bounds"]) - 1
        ys = [out[g * segments : (g + 1) * segments] for g in range(self.kernel_kw["groups"])]
        return [y[0] if self.splits is None else tuple(y) for y in ys]


def plan(
    xs,
    ws,
    *,
    out_dtype=None,
    block_sizes=None,
    splits=None,
    what="proj_many",
    m_range=(1, MAX_TILE_ROWS),
) -> SweepPlan:
    """Validates xs[g] [M, D] (M within m_range, at most 64) and ws[g] [N, D] and lays out one
    sweep over every weight (the tiling of `GemvBlockSizes.get_default` unless given: the same
    for every M <= 8, which is what keeps rows' bits across M)."""
    xs, ws = tuple(xs), tuple(ws)
    _check_groups(xs, ws, what)
    for x, w in zip(xs, ws, strict=True):
        _check(x, w, what, m_range)
    m, d = xs[0].shape
    n = ws[0].shape[0]
    bounds = _bounds(n, splits)
    bs = block_sizes or _largest_block_n(GemvBlockSizes.get_default(n, d, m, ws[0].dtype), bounds)
    steps = common.cdiv(d, bs.block_d)
    if steps % bs.split_d:
        raise ValueError(f"split_d={bs.split_d} must divide the {steps} slices of D={d}")
    if any(b % bs.block_n for b in bounds[1:-1]):
        raise ValueError(f"block_n={bs.block_n} must divide every split bound {bounds[1:-1]}")
    out_dtype = jnp.dtype(out_dtype or ws[0].dtype)
    rows = max(_ROWS, common.next_pow2(m))  # 16 for every M <= 8
    part_dtype = out_dtype if bs.split_d == 1 else jnp.float32
    widths = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    return SweepPlan(
        inputs=(*xs, *ws),
        out_shape=tuple(
            jax.ShapeDtypeStruct((bs.split_d, m, w), part_dtype) for _ in ws for w in widths
        ),
        kernel_kw=dict(
            groups=len(ws),
            m=m,
            rows=rows,
            n=n,
            d=d,
            bs=bs,
            steps=steps // bs.split_d,
            bounds=bounds,
        ),
        out_dtype=out_dtype,
        splits=None if splits is None else tuple(int(v) for v in splits),
    )


def _launch(sp: SweepPlan, interpret: bool | None) -> list:
    """Runs one sweep alone, in one launch."""
    parts = pl.pallas_call(
        functools.partial(_gemv_kernel, **sp.kernel_kw),
        out_shape=list(sp.out_shape),
        grid=sp.grid,
        compiler_params=plt.CompilerParams(
            num_warps=sp.block_sizes.num_warps, num_stages=sp.block_sizes.num_stages
        ),
        name="kda_gemv",
        interpret=common.resolve_interpret(interpret),
    )(*sp.inputs)
    return sp.finish(parts)


def _largest_block_n(bs: GemvBlockSizes, bounds) -> GemvBlockSizes:
    """bs with block_n lowered (to >= 16) until it divides every split bound."""
    block_n = bs.block_n
    while block_n > 16 and any(b % block_n for b in bounds[1:-1]):
        block_n //= 2
    return dataclasses.replace(bs, block_n=block_n)


def _run(xs, ws, out_dtype, block_sizes, splits, what, m_range, interpret):
    """Validates (M within m_range), picks the tiling, runs one sweep."""
    sp = plan(
        xs,
        ws,
        out_dtype=out_dtype,
        block_sizes=block_sizes,
        splits=splits,
        what=what,
        m_range=m_range,
    )
    return _launch(sp, interpret)


def gemv(
    x: jax.Array,
    w: jax.Array,
    *,
    out_dtype=None,
    block_sizes: GemvBlockSizes | None = None,
    splits: tuple[int, ...] | None = None,
    interpret: bool | None = None,
):
    """One row: y = x @ w.T with fp32 accumulation, every weight byte read once.

    Args:
      x: [1, D] activations, any float dtype (cast to w.dtype first, as the reference does).
      w: [N, D] bf16 or fp32 weight, torch `[out, in]` layout; N and D need not be tile multiples.
      out_dtype: dtype of y (default: w.dtype).
      block_sizes: tiling (default: `GemvBlockSizes.get_default`). Pass the same to
        `gemv_batchm` when its rows must equal this function's bits.
      splits: widths summing to N: y comes back as that many arrays (columns of y in order),
        each written by the kernel (no slice copies). Every bound must be a multiple of 16.
      interpret: run in Pallas interpret mode (None: when there is no GPU).
    Returns:
      [1, N] out_dtype, or a tuple of [1, n_s] when `splits` is given.
    """
    return _run([x], [w], out_dtype, block_sizes, splits, "gemv", (1, 1), interpret)[0]


def gemv_batchm(
    x: jax.Array,
    w: jax.Array,
    *,
    out_dtype=None,
    block_sizes: GemvBlockSizes | None = None,
    splits: tuple[int, ...] | None = None,
    interpret: bool | None = None,
):
    """2..64 rows in ONE sweep over w. For M <= 8 row i has exactly the bits of
    `gemv(x[i:i+1], w)`; 9..64 rows take a tiling of their own (the same products, other bits).

    Args:
      x: [M, D] activations, 2 <= M <= 64, any float dtype (cast to w.dtype first).
      w: [N, D] bf16 or fp32 weight, torch `[out, in]` layout.
      out_dtype, block_sizes, splits, interpret: as for `gemv` (the same defaults give the same
        bits).
    Returns:
      [M, N] out_dtype, or a tuple of [M, n_s] when `splits` is given.
    """
    m_range = (2, MAX_TILE_ROWS)
    return _run([x], [w], out_dtype, block_sizes, splits, "gemv_batchm", m_range, interpret)[0]


def proj(
    x: jax.Array,
    w: jax.Array,
    *,
    out_dtype=None,
    splits: tuple[int, ...] | None = None,
    interpret: bool | None = None,
):
    """The projection stage of the block: y = x @ w.T, fp32 accumulation (`gemv_reference`).

    Dispatch on the row count M (a static shape, so one branch is traced; inputs are validated
    the same way on every branch):
    - M <= 16 on Hopper, for a bf16 weight and output with at least one 64-row tile per SM and
      shapes TMA can move (`gemv_mgpu.mgpu_fits`: the decode step's w_in): the Mosaic GPU
      kernel `gemv_mgpu.gemv_mgpu` (rows agree bit for bit across M <= 16);
    - otherwise M == 1: `gemv`; 2 <= M <= 64: `gemv_batchm` (decode and the speculative verify,
      where the product is bound by reading the weight once; rows agree bit for bit across
      M <= 8, and rows above 8 take a tiling of their own);
    - M > 64 (prefill): XLA's dot (`reference.gemv_reference`, cuBLAS or a Triton GEMM fusion on
      a GPU), one per split: with many rows the product is a real matmul and tensor-core GEMM
      tiles beat a weight-streaming kernel. This is a deliberate split, not a fallback: rows
      there do not match the kernel path's bits.

    Args:
      x: [M, D], M >= 1, any float dtype; w: [N, D] bf16 or fp32 (any D, e.g. K = 128 for f_b).
      out_dtype: dtype of y (default: w.dtype).
      splits: widths summing to N: return y's column blocks as separate arrays (the kernel
        writes each one; bounds must be multiples of 16).
      interpret: run the kernels in interpret mode (None: when there is no GPU).
    Each path takes its kernel's default tiling.
    Returns:
      [M, N] out_dtype, or a tuple of [M, n_s] when `splits` is given.
    """
    if x.ndim != 2 or x.shape[0] < 1:
        raise ValueError(f"proj: x has shape {tuple(x.shape)}, expected [M, D] with M >= 1")
    m = x.shape[0]
    if m <= MAX_TILE_ROWS:
        what, rng = ("gemv", (1, 1)) if m == 1 else ("gemv_batchm", (2, MAX_TILE_ROWS))
        if common.hopper() and gemv_mgpu.mgpu_fits(x.shape, w.shape, w.dtype, out_dtype, splits):
            _check(x, w, what, rng)
            _bounds(w.shape[0], splits)
            return gemv_mgpu.gemv_mgpu(x, w, splits=splits, interpret=interpret)
        return _run([x], [w], out_dtype, None, splits, what, rng, interpret)[0]
    _check(x, w, "proj", (m, m))
    bounds = _bounds(w.shape[0], splits)  # the kernel path's rules for splits: both refuse alike
    if splits is None:
        return _xla_dot(x, w, out_dtype)
    # One dot per block of w's rows: each output is written whole, where cutting the columns of
    # one [M, N] product would copy them (a row block of w is contiguous).
    return tuple(
        _xla_dot(x, w[lo:hi], out_dtype) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    )


def _xla_dot(x: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
    """x @ w.T by XLA, written in out_dtype by the GEMM itself (accumulating in fp32 as
    `reference.gemv_reference` does): an fp32 product cast afterwards would cost a pass over it."""
    return lax.dot_general(
        x.astype(w.dtype),
        w,
        (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.dtype(out_dtype or w.dtype),
        precision=lax.Precision.HIGHEST,
    )


def proj_many(
    xs, ws, *, out_dtype=None, biases=None, interpret: bool | None = None
) -> tuple[jax.Array, ...]:
    """Several projections of one shape, y_g = xs[g] @ ws[g].T + biases[g]
    (`reference.proj_many_reference`): one launch for M <= 64 (a grid axis over the weights; the
    decode step's f_b and g_b), XLA's dots above, as in `proj`.

    Args:
      xs: sequence of [M, D] activations (same shape); ws: sequence of [N, D] weights (same shape
        and dtype), as many as xs.
      out_dtype: dtype of every y (default: the weights' dtype).
      biases: None, or one entry (None or [N]) per weight. With a bias, the sweep writes fp32
        and the bias is added in fp32 before the one cast to out_dtype (`reference.add_bias`).
      interpret: run the kernel in interpret mode (None: when there is no GPU).
    Returns:
      tuple of [M, N] out_dtype, one per weight.
    """
    xs, ws = list(xs), list(ws)
    _check_groups(xs, ws, "proj_many")
    biases = ref.proj_many_biases(biases, ws)
    m = xs[0].shape[0]
    if m <= MAX_TILE_ROWS:
        m_range = (1, MAX_TILE_ROWS)
        out_dtype = jnp.dtype(out_dtype or ws[0].dtype)
        acc = out_dtype if all(b is None for b in biases) else jnp.float32
        ys = _run(xs, ws, acc, None, None, "proj_many", m_range, interpret)
        return tuple(ref.add_bias(y, b, out_dtype) for y, b in zip(ys, biases, strict=True))
    for x, w in zip(xs, ws, strict=True):
        _check(x, w, "proj_many", (m, m))
    return ref.proj_many_reference(xs, ws, out_dtype=out_dtype, biases=biases)
