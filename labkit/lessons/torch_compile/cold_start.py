"""Cold and warm starts, each in a fresh process: what the first compiled call costs.

Timed inside the notebook's own process, a "cold" compile is not cold: Triton, the C++
toolchain and Inductor's modules are already loaded, and a second mode reuses what the first
one warmed. So each start here is a new Python process:

* **cold**: an empty Inductor cache (``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` point
  at a new temporary folder): trace, lower, generate, build, and on a GPU autotune;
* **warm cache**: another new process given the folder the cold start filled: the FX graph
  and kernel caches hit, so it mostly traces and loads.

The child reports how long its first call took (compile + run); the rest of the process
(interpreter, imports, building the block) is shown beside it. The comparison is the first call.
Each (round, mode) is a chain, cold then warm; on a machine with cores to spare several chains
run at once (a quarter of the cores: each child compiles on one thread), since a dozen fresh
processes one after another took most of notebook 03's time on the H200's host.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from labkit.measure.rounds import Spread

_ROOT = Path(__file__).resolve().parents[3]   # the folder that holds the labkit package


def _child(argv: list[str] | None = None) -> None:
    """One start: import, build the block, compile it in ``--mode``, time the first call."""
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="default")
    p.add_argument("--dim", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    a = p.parse_args(argv)
    import torch

    from labkit.device import synchronize
    from labkit.lessons.torch_compile.modes import autotune_log_kept, compiled
    from labkit.lessons.torch_compile.pipeline import BlockConfig, make_block

    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    block = make_block(BlockConfig(a.dim, a.hidden), dev, dtype)
    x = torch.randn(a.tokens, a.dim, device=dev, dtype=dtype)
    fn = compiled(block, a.mode)
    with torch.no_grad(), autotune_log_kept() as log:
        t1 = time.perf_counter()
        fn(x)
        synchronize(dev)
        first = time.perf_counter() - t1
    print(json.dumps({"first_call_s": first, "autotune_lines": len(log)}))


def start(mode: str, cache_dir: str, *, dim: int, hidden: int, tokens: int, device: str,
          dtype: str, timeout_s: float = 600) -> dict:
    """Run one fresh process with Inductor's caches in ``cache_dir``; its report and wall time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
    # one compile thread: the block's few kernels compile in the process itself, where
    # Inductor's pool of compile workers costs more to start and stop than it saves
    env.update(TORCHINDUCTOR_COMPILE_THREADS="1", TORCHINDUCTOR_CACHE_DIR=cache_dir,
               TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"),
               PYTHONPATH=os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, "-m", "labkit.lessons.torch_compile.cold_start", "--mode", mode,
           "--dim", str(dim), "--hidden", str(hidden), "--tokens", str(tokens),
           "--device", device, "--dtype", dtype]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the fresh process for mode {mode!r} failed (exit {done.returncode}):"
                           f"\n{done.stderr[-2000:]}")
    report = json.loads(lines[-1])
    # the rest of the process: interpreter, imports (torch, labkit), building the block, exit
    return {**report, "process_s": wall, "rest_of_process_s": wall - report["first_call_s"]}


def default_parallel(chains: int) -> int:
    """How many (cold, warm) chains run at once: a quarter of the cores, so that each child's
    one compile thread and its imports have cores to themselves (16 on the H200's host: 4; on a
    2-core laptop: 1, one after another)."""
    return max(1, min(chains, (os.cpu_count() or 1) // 4))


def cold_and_warm(modes: Sequence[str], *, dim: int, hidden: int, tokens: int, device: str,
                  dtype: str, rounds: int = 3, parallel: int | None = None) -> pd.DataFrame:
    """Per round and mode, a chain: a cold start in a fresh process with an empty cache folder,
    then a warm-cache start in another given that folder. Chains share nothing, so ``parallel``
    of them run at once (default :func:`default_parallel`); within a chain the warm start
    always follows its cold one. Rows come in (round, mode, cold then warm) order whatever
    finished first, with the ``parallel`` they ran under."""
    from concurrent.futures import ThreadPoolExecutor

    chains = [(r, mode) for r in range(rounds) for mode in modes]
    parallel = default_parallel(len(chains)) if parallel is None else parallel
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise ValueError(f"parallel must be a positive int (chains run at once), got {parallel!r}")

    def chain(r: int, mode: str) -> list[dict]:
        with tempfile.TemporaryDirectory(prefix="labkit_inductor_") as cache:
            return [{"round": r, "mode": mode, "start": kind, "parallel": parallel,
                     **start(mode, cache, dim=dim, hidden=hidden, tokens=tokens, device=device,
                             dtype=dtype)}
                    for kind in ("cold", "warm cache")]
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        done = [pool.submit(chain, r, mode) for r, mode in chains]
        return pd.DataFrame([row for future in done for row in future.result()])


def spreads(starts: pd.DataFrame) -> dict[str, dict[str, Spread]]:
    """mode -> {"cold": first-call seconds over rounds, "warm cache": ...}."""
    out: dict[str, dict[str, Spread]] = {}
    for (mode, kind), g in starts.groupby(["mode", "start"], sort=False):
        out.setdefault(mode, {})[kind] = Spread.of(g.first_call_s.tolist())
    return out


def summary(starts: pd.DataFrame) -> pd.DataFrame:
    """One row per mode and start: the first call's median and range, import and process time."""
    g = starts.groupby(["mode", "start"], sort=False)
    return pd.DataFrame({"first_call_s": g.first_call_s.median(), "low_s": g.first_call_s.min(),
                         "high_s": g.first_call_s.max(),
                         "rest_of_process_s": g.rest_of_process_s.median(),
                         "process_s": g.process_s.median(), "rounds": g.size()}).reset_index()


def figure(starts: pd.DataFrame, title: str):
    import plotly.express as px

    s = summary(starts)
    return px.bar(s, x="mode", y="first_call_s", color="start", barmode="group", title=title,
                  error_y=s.high_s - s.first_call_s, error_y_minus=s.first_call_s - s.low_s,
                  labels={"first_call_s": "first call in a fresh process (s)"})


if __name__ == "__main__":
    _child()
