"""scripts/ptxas_report.py: the Triton modules it hands to ptxas (the ptxas step itself needs the
optional triton package and is not run here)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

import ptxas_report  # noqa: E402

from pallas_kernels.chunk_prepare import PrepareBlockSizes  # noqa: E402
from pallas_kernels.chunk_scan import ScanBlockSizes  # noqa: E402
from pallas_kernels.conv import ConvBlockSizes  # noqa: E402

# The launch parameters each kernel must carry: the block sizes' defaults at K = V = 128.
_BLK = PrepareBlockSizes.get_default(128, 128)
_SCAN = ScanBlockSizes.get_default(ptxas_report.B, ptxas_report.H, ptxas_report.K, ptxas_report.C)
_PREPARE = [
    ("kda_chunk_diag", _BLK.diag_warps, 1),
    ("kda_chunk_prepare", _BLK.num_warps, _BLK.num_stages),
    ("kda_chunk_wu", _BLK.wu_warps, _BLK.wu_stages),
]


@pytest.mark.parametrize(
    "case, kernels",
    [
        ("scan", [("kda_chunk_scan", _SCAN.num_warps, _SCAN.num_stages)]),
        (
            "conv-prefill",
            [("kda_conv_prefill", ConvBlockSizes.get_default(2, 96, 128).num_warps, 2)],
        ),
        ("prepare-bounded", _PREPARE),
        ("prepare-unbounded", _PREPARE),
    ],
)
def test_modules_are_clean_mlir_with_launch_params(case, kernels):
    fn, args = ptxas_report.CASES[case]()
    mods = ptxas_report.triton_modules(fn, args)
    assert [(name, warps, stages) for name, _, warps, stages in mods] == kernels
    for name, text, _, _ in mods:
        assert text.lstrip().startswith("module"), text[:80]
        assert f"tt.func public @{name}" in text
        assert "#loc" not in text and ".py:" not in text, "source locations left in the module"
        assert text.rstrip().endswith("}")


def test_unknown_case_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ptxas_report.py", "nope"])
    with pytest.raises(SystemExit) as err:
        ptxas_report.main()
    assert "unknown case(s) ['nope']" in str(err.value)
