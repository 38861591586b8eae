"""Shared by the benchmark scripts: run metadata and a record list that is saved as it grows."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import jax


def meta() -> dict:
    """date, commit (KDA_COMMIT, else git), device and the command of this run."""
    commit = os.environ.get("KDA_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=True,
                cwd=os.path.dirname(os.path.abspath(__file__)),
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = None
    return dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        commit=commit,
        device=jax.devices()[0].device_kind,
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
    )


class Records(list):
    """A list of result records that rewrites its JSON file and prints a line on every append,
    so a run cut short by a time limit still leaves every finished case on disk."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def append(self, rec: dict) -> None:
        super().append(rec)
        with open(self.path, "w") as fh:
            json.dump(list(self), fh, indent=1)
        t, base = rec.get("time_us"), rec.get("baseline")
        base_s = "" if not base else f"  | {base['name']}: {base['time_us']} us"
        print(
            f"{rec['bench']:<14}{rec['shape']:<36}{rec['backend']:<26}"
            f"{'FAILED' if t is None else f'{t:.1f} us':>12}  floor {rec['floor_us']}{base_s}",
            flush=True,
        )


def cuda_graph_us(call, reps: int, calls: int = 20) -> float:
    """Median us per call of a PyTorch callable: `calls` calls captured in one CUDA graph,
    replayed `reps` times under torch.inference_mode() (how SPEC §9 timed FLA). Warm-up (and
    Triton autotuning) runs on a side stream before capture."""
    import statistics

    import torch

    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                call()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    torch.cuda.empty_cache()
    return statistics.median(times)
