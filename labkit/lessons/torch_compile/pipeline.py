"""One small block followed through torch.compile's pipeline, with the artefact of each stage.

``torch.compile(fn)`` runs four things in a row:

1. **TorchDynamo** intercepts ``fn``'s frame before Python runs it, executes its bytecode
   symbolically on fake tensors and records the tensor operations into an **FX graph**
   (torch-level ops: ``torch.rsqrt``, ``self.up``, ``+``).
   Whatever it cannot record ends the graph (a *graph break*: see ``graph_breaks.py``).
2. **AOTAutograd** traces that graph down to **aten** ops (``aten.addmm``, ``aten.mean``),
   functionalises it and, when training, splits it into forward and backward graphs.
3. **TorchInductor** schedules the aten graph, fuses neighbouring pointwise and reduction ops
   into one loop nest each, and leaves matmuls to vendor libraries (``extern_kernels``).
4. It **generates code**: C++/OpenMP loops on a CPU, Triton kernels on a GPU.

Each stage here is captured with a backend we write ourselves (a backend is just a function
that receives the FX graph), so the notebook shows exactly what the compiler saw.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch import nn

from labkit.device import synchronize


@dataclass(frozen=True)
class BlockConfig:
    dim: int = 64
    hidden: int = 256
    eps: float = 1e-6

    def __post_init__(self):
        if self.dim < 1 or self.hidden < 1:
            raise ValueError(f"dim and hidden must be >= 1, got dim={self.dim}, "
                             f"hidden={self.hidden}")
        if not 0 < self.eps < 1:
            raise ValueError(f"eps must be in (0, 1) (it only guards the rsqrt), got {self.eps}")


class RMSNormMLP(nn.Module):
    """``x + down(gelu(up(rmsnorm(x))))``: a transformer block's MLP half.

    The norm is written out op by op (pow, mean, add, rsqrt, mul, mul) on purpose: eager runs
    each as its own kernel, Inductor fuses them into one loop.
    """

    def __init__(self, cfg: BlockConfig = BlockConfig()):
        super().__init__()
        self.cfg = cfg
        self.norm_weight = nn.Parameter(torch.ones(cfg.dim))
        self.up = nn.Linear(cfg.dim, cfg.hidden)
        self.down = nn.Linear(cfg.hidden, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [tokens, dim]
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.eps) * self.norm_weight
        return x + self.down(torch.nn.functional.gelu(self.up(normed)))


def make_block(cfg: BlockConfig = BlockConfig(), device="cpu", dtype=torch.float32,
               seed: int = 0) -> RMSNormMLP:
    torch.manual_seed(seed)
    return RMSNormMLP(cfg).to(device=device, dtype=dtype).eval()


@dataclass
class FxStage:
    """What one stage produced: the graph's Python code and the ops it calls, in order."""
    stage: str
    code: str
    ops: list[str]
    graphs: int = 1


def _ops_of(gm: torch.fx.GraphModule) -> list[str]:
    ops = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            ops.append(getattr(node.target, "__name__", str(node.target)) if node.op ==
                       "call_function" else f".{node.target}")
        elif node.op == "call_module":
            ops.append(f"self.{node.target}")
    return [str(op) for op in ops]


def dynamo_graph(fn: Callable, *args) -> FxStage:
    """Stage 1: the FX graph TorchDynamo hands to a backend (torch-level ops)."""
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward  # run it as-is: we only want to look

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=capture)(*args)
    return FxStage("TorchDynamo", "\n\n".join(g.code.strip() for g in graphs),
                   [op for g in graphs for op in _ops_of(g)], graphs=len(graphs))


def aot_graph(fn: Callable, *args) -> FxStage:
    """Stage 2: the aten graph AOTAutograd passes on (inference: no backward graph)."""
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=aot_autograd(fw_compiler=capture))(*args)
    return FxStage("AOTAutograd", "\n\n".join(g.code.strip() for g in graphs),
                   [op for g in graphs for op in _ops_of(g)], graphs=len(graphs))


# A kernel Inductor defines: `cpp_fused_add_mean_0 = async_compile.cpp_pybinding(...` on CPU,
# `triton_poi_fused_gelu_1 = async_compile.triton(...` on GPU.
_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.(\w+)\(", re.MULTILINE)
_EXTERN_CALL = re.compile(r"\bextern_kernels\.(\w+)\(")


@dataclass
class InductorStage:
    """Stage 3+4: the generated code, the kernels it defines and the library calls it makes."""
    code: list[str]                 # one module per compiled graph
    kernels: list[str]              # generated loops/kernels (each one fused group of ops)
    extern_calls: list[str]         # matmuls etc. left to cuBLAS / oneDNN / MKL
    language: str                   # "C++" or "Triton"
    compile_s: float                # first call: trace + lower + codegen + build
    max_abs_err: float              # against eager on the same input
    out: torch.Tensor = field(repr=False, default=None)

    @property
    def graphs(self) -> int:
        return len(self.code)

    def fused_ops(self) -> pd.DataFrame:
        """Each generated kernel and the ops Inductor fused into it (read off its name)."""
        rows = []
        for name in self.kernels:
            fused = name.split("fused_", 1)[1] if "fused_" in name else name
            rows.append({"kernel": name, "ops fused into it": ", ".join(fused.split("_")[:-1])})
        return pd.DataFrame(rows)

    def kernel_source(self, index: int = 0, max_lines: int = 60) -> str:
        """The source of one generated kernel, cut to ``max_lines``."""
        name = self.kernels[index]
        src = next(c for c in self.code if f"{name} = async_compile" in c)
        start = src.index(f"{name} = async_compile")
        lines = src[start:].splitlines()
        end = next((i for i, ln in enumerate(lines[1:], 1) if ln.startswith("'''")), len(lines))
        lines = lines[:end + 1]
        cut = len(lines) > max_lines
        return "\n".join(lines[:max_lines]) + ("\n    ... (cut)" if cut else "")


def no_caches():
    """Inductor with its compile caches off: a first call as on a fresh machine."""
    import warnings
    from contextlib import ExitStack

    stack = ExitStack()
    if hasattr(torch._inductor.config, "force_disable_caches"):
        stack.enter_context(torch._inductor.config.patch(force_disable_caches=True))
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=".*force_disable_caches")
    return stack


def inductor_code(fn: Callable, *args, mode: str | None = None,
                  cold: bool = False) -> InductorStage:
    """Compile ``fn`` with Inductor from scratch and keep the code it generates.

    ``cold`` switches Inductor's caches off, so ``compile_s`` is what a fresh machine pays.
    """
    from contextlib import nullcontext

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with torch.no_grad(), (no_caches() if cold else nullcontext()):
        expected = fn(*args)
        compiled = torch.compile(fn, mode=mode)
        t0 = time.perf_counter()
        out, code = run_and_get_code(compiled, *args)
        synchronize(out.device)
        compile_s = time.perf_counter() - t0
    kernels = [m.group(1) for c in code for m in _KERNEL_DEF.finditer(c)]
    externs = [m.group(1) for c in code for m in _EXTERN_CALL.finditer(c)]
    language = "Triton" if any("async_compile.triton(" in c for c in code) else "C++"
    return InductorStage(code=code, kernels=kernels, extern_calls=externs, language=language,
                         compile_s=compile_s,
                         max_abs_err=float((out.float() - expected.float()).abs().max()), out=out)


_VIEWS = {"t", "view", "_unsafe_view", "permute", "expand", "reshape", "transpose", "unsqueeze",
          "squeeze", "slice", "select", "alias", "detach"}


def eager_launches(aot: FxStage) -> list[str]:
    """The aten ops eager mode would run one kernel each for (views move no data)."""
    return [op for op in aot.ops if op.split(".")[0] not in _VIEWS]


def pipeline_table(dynamo: FxStage, aot: FxStage, inductor: InductorStage,
                   eager_ops: list[str] | None = None) -> pd.DataFrame:
    """How many operations each stage sees: the ops shrink into a few fused kernels."""
    rows = []
    if eager_ops is not None:
        rows.append({"stage": "eager", "artefact": "kernels, one per aten op",
                     "count": len(eager_ops)})
    rows += [
        {"stage": "TorchDynamo", "artefact": "FX graph: torch-level ops", "count": len(dynamo.ops)},
        {"stage": "AOTAutograd", "artefact": "aten graph: aten ops", "count": len(aot.ops)},
        {"stage": "TorchInductor", "artefact": f"generated {inductor.language} kernels",
         "count": len(inductor.kernels)},
        {"stage": "TorchInductor", "artefact": "library calls (matmuls)",
         "count": len(inductor.extern_calls)},
    ]
    return pd.DataFrame(rows)


def pipeline_figure(table: pd.DataFrame, title: str = "ops at each stage of torch.compile"):
    import plotly.express as px

    labels = table["stage"] + ": " + table["artefact"]
    return px.bar(table, x=labels, y="count", title=title, text="count",
                  labels={"x": "", "count": "operations / kernels"})


def with_break(block: RMSNormMLP) -> Callable:
    """The same block with one untraceable call inside the norm: two graphs instead of one.

    The break falls between ops Inductor would have fused (rsqrt and the multiplies after it),
    so the compiled code needs one more kernel and a round trip through Python.
    """
    @torch.compiler.disable
    def host_side(t):  # stands for logging, a Python-side check, a C extension call...
        return t

    def forward(x):  # x: [tokens, dim]
        inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + block.cfg.eps)
        inv_rms = host_side(inv_rms)
        normed = x * inv_rms * block.norm_weight
        return x + block.down(torch.nn.functional.gelu(block.up(normed)))

    return forward


def break_cost_table(full: InductorStage, split: InductorStage) -> pd.DataFrame:
    """Same math, one graph against the two FX graphs a Dynamo graph break leaves: what
    "compile enabled" leaves unfused. (Not the piecewise compilation engines choose, which
    splits one traced graph at attention on purpose.)"""
    return pd.DataFrame([
        {"compiled as": name, "graphs": s.graphs, "generated kernels": len(s.kernels),
         "library calls": len(s.extern_calls),
         "launches per call": len(s.kernels) + len(s.extern_calls),
         "kernels": ", ".join(s.kernels)}
        for name, s in (("one graph", full), ("two graphs (one graph break)", split))])
