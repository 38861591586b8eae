"""Pallas GPU kernels of the KDA block, each with a pure-jnp reference: Triton backend, and one
Mosaic GPU kernel (`gemv_mgpu.py`, Hopper only; `gemv.proj` picks it).

Import kernels from their files (`from pallas_kernels.gemv import proj`; the package
namespace is left to the submodules, several of which share a kernel's name). Every public
kernel has the signature of its reference in `reference.py` (`<name>_reference`) plus two
static keywords: `block_sizes`, its file's frozen `...BlockSizes` (None: `get_default(...)`
for the shape), and `interpret` (None: Pallas interpret mode when there is no GPU, so the
same call runs on a CPU; the Mosaic GPU kernel in Mosaic GPU's interpreter). Stage functions
that compose kernels (`gemv.proj`, `gemv.proj_many`, `front.decode_front`, `chunk.chunk_kda`,
`chunk.prefill_core`) take `interpret` only and run their kernels at the default tilings;
`chunk_prepare`'s three kernels take their tiling from its `PrepareBlockSizes`.

| stage (SPEC §1)                         | kernel                        | file             |
|-----------------------------------------|-------------------------------|------------------|
| projections (decode, verify)            | gemv, gemv_batchm, proj       | gemv.py          |
| w_in's projection on Hopper, 1-16 rows  | gemv_mgpu                     | gemv_mgpu.py     |
| short conv + SiLU + L2 of q, k          | conv_decode, conv_prefill     | conv.py          |
| decode conv with f_b, g_b in one launch | decode_front                  | front.py         |
| gate, beta (fused into the kernels)     | gate_math, beta_math          | gate.py          |
| recurrence (decode, verify, snapshots)  | decode_core, fused_recurrent  | recurrent.py     |
| chunked prefill: intra-chunk            | chunk_prepare                 | chunk_prepare.py |
|   diagonal blocks, G, norms             |   chunk_diag                  | chunk_diag.py    |
|   qg, kg, A, T                          |   chunk_intra                 | chunk_intra.py   |
|   w, u                                  |   chunk_wu                    | chunk_wu.py      |
| chunked prefill: state pass and output  | chunk_scan                    | chunk_scan.py    |
| chunked prefill, orchestrated           | chunk_kda, prefill_core       | chunk.py         |
| sigmoid-gated RMSNorm (z's dot inside)  | o_norm, o_norm_gate           | o_norm.py        |
"""
