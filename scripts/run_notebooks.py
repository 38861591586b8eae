"""Executes every notebooks/*.ipynb top to bottom; exits non-zero if any cell fails.

    .venv/bin/python scripts/run_notebooks.py [NOTEBOOK ...] [--timeout SECONDS] [--save DIR]

Runs each notebook with nbclient in a kernel of *this* interpreter (the venv's python3, with
ipykernel from the `notebooks` extra), from the notebooks/ folder, with matplotlib's inline
(Agg) backend: no display needed.
Stored notebooks carry no outputs; `--save DIR` writes the executed copies there for reading.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNEL = "python3"


def _ensure_kernel() -> None:
    """Makes sure the `python3` kernelspec points at this interpreter (the venv's)."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL)
        argv0 = spec.argv[0]
        if argv0 in ("python", "python3") or os.path.realpath(argv0) == os.path.realpath(
            sys.executable
        ):
            return
    except NoSuchKernel:
        pass
    from ipykernel.kernelspec import install

    install(kernel_name=KERNEL, prefix=sys.prefix)


def run_one(path: Path, timeout: int, save_dir: Path | None) -> float:
    """Executes one notebook in place (in memory); returns the seconds it took."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name=KERNEL,
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    if save_dir is not None:
        save_dir.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, save_dir / path.name)
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/*.ipynb")
    ap.add_argument("--timeout", type=int, default=600, help="per-cell timeout in seconds")
    ap.add_argument("--save", type=Path, default=None, help="write executed copies here")
    args = ap.parse_args(argv)

    paths = [p.resolve() for p in args.notebooks] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    if not paths:
        print("no notebooks found under notebooks/", file=sys.stderr)
        return 1
    # Inherited by the kernel: the inline backend renders with Agg (no display needed) and keeps
    # the figures as PNG outputs for --save.
    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    _ensure_kernel()

    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    failures, total = [], 0.0
    for path in paths:
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        print(f"running {shown} ...", flush=True)
        try:
            seconds = run_one(path, args.timeout, args.save)
        except (CellExecutionError, CellTimeoutError) as e:
            print(f"FAILED {path.name}:\n{e}", flush=True)
            failures.append(path.name)
            continue
        total += seconds
        print(f"  ok  {path.name}: {seconds:.1f} s", flush=True)
    print(f"{len(paths) - len(failures)}/{len(paths)} notebooks ran cleanly in {total:.1f} s")
    if failures:
        print(f"failed: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
