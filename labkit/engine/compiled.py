"""The model's forward compiled the way vLLM compiles it: traced once by Dynamo, split at attention,
each piece compiled by Inductor for a symbolic number of tokens.

Attention cannot go into a compiled graph as ordinary ops: what it reads (each row's context
through its block table) is the step's metadata, not the step's shapes. So attention is one
custom op, ``labkit::attention(q, k, v, out, layer)``, registered with ``torch.library``.
Dynamo sees an opaque call; it never looks inside. The op finds the step's attention function
in a context the runner sets around each forward (``attention_context``), as vLLM's attention
op reads its forward context.

Storing the step's new K/V is token by token: row i goes to slot ``slot_mapping[i]``, whatever
its sequence. So the store is a custom op of its own, ``labkit::store_kv(key, value, kv_cache,
slot_mapping, layer, ...)``, called in every layer just before attention, and NOT a place to cut:
it declares ``kv_cache`` (the paged cache's one tensor, ``PagedKVCache.kv``) as what it mutates,
so no pass drops it as dead code or moves it past a read, and Inductor calls it in place from
inside the piece, an opaque call between its fused kernels. The slots are an input of the
compiled forward (``CompiledForward(input_ids, positions, slot_mapping, attention)``), and the
attention the runner passes stores nothing (``store=False``). One layer's cut, in the graph
Dynamo traces::

    piece i:     ... norm, qkv projection, RoPE -> q, k, v
                 labkit::store_kv(k, v, kv, slot_mapping, i)       stays in the piece
    split:       labkit::attention(q, k, v, out, i)                a part of its own
    piece i + 1: o projection, norm, MLP, ... layer i + 1 up to its store

The backend (``split_at_attention``) cuts the FX graph at every attention call: with L layers
there are L + 1 pieces around L attention calls, each of the first L holding one store, the same
cut as the engine's piecewise graphs (``labkit.engine.pieces``). Each piece goes to Inductor
(``compile_fx``) with the fake inputs Dynamo traced it with, so its kernels are generated once
for a symbolic token count: a step of any size runs the same compiled pieces, with no
recompilation.

Under CUDA graphs the compiled pieces are captured the way the engine's own pieces are
(``labkit.engine.cudagraphs``). A full decode graph captures the whole compiled forward, the
stores and the decode attention inside the opaque op included. Piecewise graphs
(``labkit.engine.compiled_pieces``) run the compiled forward once per token bucket with a
recorder in place: each compiled piece is captured as one graph into a shared memory pool, its
layer's store with it (reading the slots from a static buffer, so a replay stores the step's
tokens; padding rows hold slot -1, which the store skips), and each attention call between them
is written down with the tensors it reads and writes. Those tensors live in the pool, made by
the graph before (attention's output too: the op fills an ``out`` the piece before allocates),
so a step replays the graphs in order and runs each attention eagerly on its recorded tensors,
the step's real rows only. Nothing the pool holds is kept alive by Python, so a bucket captured
later reuses what an earlier one used: buckets never run at once.

An MLA model's latent rows go through the same store op (the latent as ``key``, no ``value``):
its pieces store them as a Llama model's store K and V.
"""
from __future__ import annotations

import contextlib
import time
import types
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from labkit.engine.compiled_pieces import RECORDING
from labkit.engine.model import AttentionFn, LlamaModel
from labkit.kernels.store_kv import store_kv, store_kv_ref

_STEP_ATTENTION: list[AttentionFn] = []  # the step's attention function, innermost last


@contextlib.contextmanager
def attention_context(attention: AttentionFn) -> Iterator[None]:
    """Inside it, ``labkit::attention`` calls ``attention`` (the step's, with its metadata)."""
    _STEP_ATTENTION.append(attention)
    try:
        yield
    finally:
        _STEP_ATTENTION.pop()


@torch.library.custom_op("labkit::attention", mutates_args=("out",))
def attention_op(q: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor],
                 out: torch.Tensor, layer: int) -> None:
    """Layer ``layer``'s attention of this step over the cache ``labkit::store_kv`` has just
    filled (the step's attention function stores nothing): q [T, Hq, D] -> ``out`` [T, Hq, D],
    filled in place. Opaque to Dynamo and Inductor, so the compiled graph splits
    here; ``out`` is allocated before the split, so under piecewise graphs it is memory of the
    graph before, the same address at every replay. An MLA model passes its query
    ``[q_nope ; q_pe]``, its latent rows as ``k``, no ``v``, and an ``out`` of the values' width
    (``MLAModel.hidden_states``)."""
    if not _STEP_ATTENTION:
        raise RuntimeError("labkit::attention ran outside attention_context(...): the runner "
                           "sets the step's attention around each compiled forward")
    _STEP_ATTENTION[-1](layer, q, k, v, out=out)


@attention_op.register_fake
def _attention_shape(q, k, v, out, layer):
    return None


@torch.library.custom_op("labkit::store_kv", mutates_args=("kv_cache",))
def store_kv_op(key: torch.Tensor, value: Optional[torch.Tensor], kv_cache: torch.Tensor,
                slot_mapping: torch.Tensor, layer: int, k_scale: Optional[torch.Tensor],
                v_scale: Optional[torch.Tensor], use_kernel: bool) -> None:
    """Layer ``layer``'s new rows into their slots of ``kv_cache`` [layers, planes, num_blocks,
    block_size, H, D] (``PagedKVCache.kv``), in place: key, value [T, H, D], slot_mapping [T],
    slot -1 (a padding row) written nowhere. An MLA model passes its latent rows [T, 1, W] as
    ``key`` and no ``value``. ``k_scale``, ``v_scale``: an fp8 cache's [layers, H] scales.
    ``use_kernel``: the Triton store, else its torch reference. Declaring ``kv_cache`` mutated
    is what keeps the call in the compiled graph (an op that returns nothing and mutates
    nothing is dead code) and in its place: after the rows it stores, before attention."""
    store = store_kv if use_kernel else store_kv_ref
    k_cache = kv_cache[layer, 0]
    if value is None:  # the latent row is both: store_kv writes it once into one cache
        key = key.contiguous()
        value, v_cache = key, k_cache
    else:
        v_cache = kv_cache[layer, 1]
    store(key, value, k_cache, v_cache, slot_mapping,
          None if k_scale is None else k_scale[layer],
          None if v_scale is None else v_scale[layer], check=False)


@store_kv_op.register_fake
def _store_kv_shape(key, value, kv_cache, slot_mapping, layer, k_scale, v_scale, use_kernel):
    return None


ATTENTION_TARGETS = (torch.ops.labkit.attention.default,)
STORE_TARGETS = (torch.ops.labkit.store_kv.default,)


def _is_attention(node) -> bool:
    return node.op == "call_function" and node.target in ATTENTION_TARGETS


def _is_store(node) -> bool:
    return node.op == "call_function" and node.target in STORE_TARGETS


@dataclass
class CompileStats:
    pieces: int = 0              # graphs Inductor compiled (the work between attentions)
    attention_calls: int = 0     # opaque attention calls the graph was split at
    compile_s: float = 0.0       # calls that compiled (Dynamo, split, Inductor, one run), summed
    compilations: int = 0        # times Dynamo handed the backend a graph (1: no recompile)
    piece_names: list[str] = field(default_factory=list)
    stores: list[int] = field(default_factory=list)  # store_kv calls inside each piece, in order


class _Piece(torch.nn.Module):
    """A compiled piece where the split module had its FX submodule: run as it is, or, while
    ``compiled_pieces.CompiledPiecewise`` captures a bucket, captured into that bucket's
    graphs. A full graph's capture (no recorder then) just runs it: the full graph takes its
    kernels."""

    def __init__(self, compiled):
        super().__init__()
        self.compiled = compiled

    def forward(self, *args):
        if RECORDING:
            return RECORDING[-1].capture(self.compiled, args)
        return self.compiled(*args)


class _CompilePieces(torch.fx.Interpreter):
    """Runs the split graph on Dynamo's fake inputs; each piece that holds no attention call is
    compiled by Inductor for the (symbolic) inputs it receives and put in its place."""

    def __init__(self, split: torch.fx.GraphModule):
        super().__init__(split)
        self.compiled: list[str] = []
        self.stores: list[int] = []

    def call_module(self, target, args, kwargs):
        from torch._inductor.compile_fx import compile_fx

        sub = self.fetch_attr(target)
        out = super().call_module(target, args, kwargs)
        if not any(_is_attention(n) for n in sub.graph.nodes):
            self.module._modules[target] = _Piece(compile_fx(sub, list(args)))
            self.compiled.append(target)
            self.stores.append(sum(_is_store(n) for n in sub.graph.nodes))
        return out


def split_at_attention(stats: CompileStats):
    """A Dynamo backend: the graph cut at every attention call (each call a part of its own),
    every other part compiled by Inductor, the K/V stores inside them. Records what it did in
    ``stats``."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.passes.split_module import split_module

    def backend(gm: torch.fx.GraphModule, example_inputs):
        part, parts = 0, {}
        for node in gm.graph.nodes:
            if _is_attention(node):
                parts[node], part = part + 1, part + 2
            else:
                parts[node] = part
        split = split_module(gm, None, lambda node: parts[node], keep_original_order=True)
        fake_mode = torch._guards.TracingContext.try_get().fake_mode
        fakes = []
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                v = node.meta.get("example_value")
                if isinstance(v, torch.Tensor) and not (isinstance(v, FakeTensor)
                                                        and v.fake_mode is fake_mode):
                    v = fake_mode.from_tensor(v)
                fakes.append(v)
        compiler = _CompilePieces(split)
        with fake_mode:
            compiler.run(*fakes)
        stats.pieces = len(compiler.compiled)
        stats.piece_names = compiler.compiled
        stats.stores = compiler.stores
        stats.attention_calls = sum(_is_attention(n) for n in gm.graph.nodes)
        stats.compilations += 1
        return split
    return backend


class CompiledForward:
    """``model.hidden_states`` compiled (a LlamaModel's or an MLAModel's), storing each layer's
    new K/V into ``cache`` (a ``PagedKVCache``) through ``labkit::store_kv``:
    ``forward(input_ids, positions, slot_mapping, attention)`` -> the final-normed hidden
    states, the layers' small ops plain (Inductor fuses them itself). ``attention`` must not
    store: the forward did. ``store_kernel``: the Triton store, else its torch reference."""

    def __init__(self, model: LlamaModel, cache, store_kernel: bool = True):
        self.model, self.cache = model, cache
        self.stats = CompileStats()
        use_kernel = bool(store_kernel)
        # The cache's shape never changes: static, or Dynamo would make its sizes symbolic too
        # and guard on any that happened to equal the first step's token count.
        for t in (cache.kv, cache.k_scale, cache.v_scale):
            if t is not None:
                torch._dynamo.mark_static(t)

        def forward(input_ids, positions, slot_mapping, kv_cache, k_scale, v_scale):
            def attend(layer, q, k, v, out=None):
                store_kv_op(k, v, kv_cache, slot_mapping, layer, k_scale, v_scale, use_kernel)
                out = torch.empty_like(q) if out is None else out  # MLA's is narrower than q
                attention_op(q, k, v, out, layer)
                return out
            return model.hidden_states(input_ids, positions, attend, fused_ops=False)
        # Dynamo keeps its compiled code and guards per code object, and every engine's forward
        # would share this one's: each new backend a guard failure, the eighth engine of a
        # process a hard failure at the recompile limit. A copy of the code object of its own
        # keeps each engine's compilations its own.
        forward = types.FunctionType(forward.__code__.replace(), forward.__globals__,
                                     forward.__name__, forward.__defaults__, forward.__closure__)
        self._compiled = torch.compile(forward, backend=split_at_attention(self.stats),
                                       dynamic=True, fullgraph=True)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """input_ids, positions, slot_mapping: [T] (slot -1: a row that stores nothing) ->
        hidden [T, hidden]; ``attention`` attends over the cache the forward stored into."""
        t0, before = time.perf_counter(), self.stats.compilations
        cache = self.cache
        # a float (rms_norm_eps) stays a constant of the graph, not a symbolic input
        with attention_context(attention), torch._dynamo.config.patch(specialize_float=True):
            hidden = self._compiled(input_ids, positions, slot_mapping, cache.kv, cache.k_scale,
                                    cache.v_scale)
        if self.stats.compilations > before:  # a call that compiled: its time is the compile's
            self.stats.compile_s += time.perf_counter() - t0
        return hidden


_START = """
import json, sys, time
t0 = time.perf_counter()
import torch
from labkit.engine import LLM, ModelConfig, SamplingParams, random_model
config, device, dtype = ModelConfig.from_dict(json.loads(sys.argv[1])), sys.argv[2], sys.argv[3]
mode = json.loads(sys.argv[4])
model = random_model(config, seed=0, device=device, dtype=getattr(torch, dtype))
t1 = time.perf_counter()
llm = LLM(model, compile=True, cudagraph_mode=mode, max_num_seqs=2)
llm.generate([[1, 2, 3], [4] * 9], SamplingParams(max_tokens=2))
t2 = time.perf_counter()
s = llm.runner.compiled.stats
print(json.dumps({"import_and_model_s": t1 - t0, "first_generate_s": t2 - t1,
                  "compile_s": s.compile_s, "compilations": s.compilations,
                  "cudagraph_mode": llm.cudagraph_mode,
                  "capture_ms": sum(r["capture_ms"] for r in llm.runner.graph_memory())}))
"""


def compile_start(config, *, device: str = "cpu", dtype: str = "float32", cache_dir=None,
                  cudagraph_mode: str | None = "none", timeout_s: float = 600.0) -> dict:
    """Cold and warm start of ``compile=True`` in fresh processes: the first with an empty
    Inductor cache in ``cache_dir`` (a new temporary folder by default), the second with the
    cache the first left there. Each reports its first ``generate`` (engine built, compiled,
    its graphs captured per ``cudagraph_mode`` (None: the device's default), run), the compile
    time inside it and the graphs' capture time."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="labkit_inductor_") as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir or tmp)}
        out = {}
        for start in ("cold", "warm"):
            proc = subprocess.run(
                [sys.executable, "-c", _START, json.dumps(config.to_dict()), device, dtype,
                 json.dumps(cudagraph_mode)],
                env=env, capture_output=True, text=True, timeout=timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"the {start} start failed:\n{proc.stderr[-2000:]}")
            out[start] = json.loads(proc.stdout.strip().splitlines()[-1])
        return out
