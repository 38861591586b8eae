"""scripts/ptxas_report.py: the Triton modules it hands to ptxas (the ptxas step itself needs the
optional triton package and is not run here)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

import ptxas_report  # noqa: E402


@pytest.mark.parametrize(
    "case, kernels",
    [
        ("scan", [("kda_chunk_scan", 4, 2)]),
        ("prepare-bounded", [("kda_chunk_prepare", 4, 1), ("kda_chunk_wu", 4, 1)]),
        (
            "prepare-unbounded",
            [("kda_chunk_diag", 4, 1), ("kda_chunk_prepare", 4, 1), ("kda_chunk_wu", 4, 1)],
        ),
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
