"""Every ```python block of README.md runs as written (CPU, tiny configs).

Each block is executed on its own, in a fresh namespace and a temporary working directory, so a
reader can copy any one of them. A README without Python blocks fails: this test must not pass
by finding nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def _python_blocks() -> list[tuple[int, str]]:
    """(line number, source) of every ```python block."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


BLOCKS = _python_blocks()


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 4, f"expected the quick-start snippets in {README}, found {len(BLOCKS)}"


@pytest.mark.slow
@pytest.mark.parametrize("line,source", BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = compile(source, f"README.md:{line}", "exec")
    exec(code, {"__name__": f"readme_line{line}"})
