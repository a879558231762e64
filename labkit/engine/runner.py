"""The model runner: one scheduled step in, the logits of its sampled rows out.

For each step it
1. applies the step's copy-on-write block copies to the KV cache;
2. builds the step's metadata and copies it to the device as ONE int32 buffer in one transfer
   (``labkit.engine.device_metadata``);
3. runs the model with an attention function that, in every layer, first stores the step's
   new K/V into their slots and then attends over the cache (``labkit.engine.step_attention``);
   where the store is already part of the forward (piecewise graphs on a GPU, whose pieces
   store; ``compile=True``, whose ``labkit::store_kv`` op sits inside each compiled piece), the
   attention function only attends;
4. returns the logits of the rows that sample (``logits_indices``), nothing else.

``cudagraph_mode`` says which steps replay CUDA Graphs (``labkit.engine.cudagraphs``: the four
modes, and capturing the graphs): decode-only steps replay full graphs per batch bucket, other
steps piecewise graphs per token bucket with attention eager between them, or every step runs
eagerly. With speculative decoding and full graphs, a step whose every row verifies k drafts
replays a full graph per (request bucket, k + 1) (``labkit.engine.verify_graphs``).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from labkit import check_positive_int, check_power_of_two
from labkit.attention import (BACKENDS, AttentionSpec, Backend, BackendUnavailable,
                              select_backend, selection_lines)
from labkit.engine.cudagraphs import (  # noqa: F401  (the runner's names for them)
    CUDAGRAPH_MODES,
    DEFAULT_CUDA_GRAPH_MODE,
    PAD,
    capture_compiled_piecewise,
    capture_decode_graphs,
    capture_piecewise_graphs,
    graph_memory,
    resolve_cudagraph_mode,
)
from labkit.engine.compiled_pieces import CompiledPiecewise
from labkit.engine.device_metadata import DeviceMetadata, decode_inputs, metadata_to_device
from labkit.engine.model import LlamaModel
from labkit.engine.mla_pieces import MLAPiecewiseForward
from labkit.engine.pieces import PiecewiseForward
from labkit.engine.request import ScheduledStep
from labkit.engine.step_attention import StepAttention
from labkit.engine.step_metadata import StepMetadata, build_step_metadata
from labkit.engine.verify_graphs import VerifyGraphs
from labkit.graphs import DEFAULT_BUCKETS, GraphPool
from labkit.graphs.buckets import check_buckets
from labkit.graphs.piecewise import PiecewiseGraphs, default_token_buckets
from labkit.kvcache import BlockManager, KVCacheShape, PagedKVCache, tokens_that_fit

log = logging.getLogger("labkit.engine")

def choose_backend(spec: AttentionSpec, backend: str = "auto") -> tuple[Backend, list[str]]:
    """The attention backend for ``spec`` and the log of the choice (chosen, then passed over),
    logged once to ``labkit.engine``.

    ``select_backend`` decides: ``backend="auto"`` takes the first backend of ``PRIORITY`` that
    can serve the spec, on CPU passing over the interpreted and uncompiled ones too
    (``CPU_SLOW``). A named backend is forced, and refused with every reason when it cannot
    serve the spec; the refusal names this engine's switches.
    """
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; known: "
                         f"{['auto', *BACKENDS]}")
    prefer = None if backend == "auto" else backend
    try:
        chosen, passed = select_backend(spec, prefer, skip_slow=True, logger=log)
    except BackendUnavailable as e:
        if prefer is None:
            raise
        hint = "" if spec.cuda_graph == "none" else (
            "\nOr pass cudagraph_mode='piecewise' (attention runs eagerly between the graphs) "
            "or enforce_eager=True: without full CUDA Graphs this backend may qualify.")
        message = str(e).replace("Drop prefer= to let auto selection choose",
                                 "Pass backend='auto' to let selection choose")
        raise BackendUnavailable(message + hint, e.reasons) from None
    return chosen, selection_lines(chosen.name, passed, forced=prefer is not None, spec=spec)


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor          # [num_sampled, vocab], rows in step order
    graph_batch: int | None       # the bucket a full (decode or verify) graph replayed at
    graph_tokens: int | None = None  # the token bucket piecewise graphs replayed at, or None
    graph_query_len: int | None = None  # a full verify graph's tokens per row (k + 1), or None
    inputs: DeviceMetadata | None = None  # the step's device metadata (async speculation
    # reads its drafts and sample rows to count what the target kept)


class ModelRunner(StepAttention):
    def __init__(self, model: LlamaModel, *, num_blocks: int | None = None,
                 kv_cache_memory: int | None = None, block_size: int = 16,
                 max_model_len: int | None = None, max_num_seqs: int = 64,
                 backend: str = "auto", enforce_eager: bool = False,
                 decode_buckets: tuple[int, ...] | None = None, fused_ops: bool | None = None,
                 cudagraph_mode: str | None = None, token_buckets: tuple[int, ...] | None = None,
                 max_num_batched_tokens: int = 2048,
                 decode_context_buckets: tuple[int, ...] | None = None, compile: bool = False,
                 num_speculative_tokens: int | None = None):
        c = model.config
        self.model = model
        # The layer ops of every step and of every captured graph; None: the model's own choice.
        self.fused_ops = model.fused_ops if fused_ops is None else bool(fused_ops)
        self.device = model.embed_tokens.device
        self.dtype = model.embed_tokens.dtype
        if max_model_len is not None:
            check_positive_int("max_model_len", max_model_len,
                               hint="prompt + output tokens, or None: the model's context")
        self.max_model_len = c.max_position_embeddings if max_model_len is None else max_model_len
        if self.max_model_len > c.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} is past the model's context "
                             f"of {c.max_position_embeddings} tokens (max_position_embeddings); "
                             "lower it")
        check_power_of_two("block_size", block_size,
                           hint="16 is usual; the triton backend takes 16 to 256")
        self.max_blocks_per_seq = math.ceil(self.max_model_len / block_size)
        self.cudagraph_mode = resolve_cudagraph_mode(cudagraph_mode, enforce_eager, self.device)
        # An MLA model (labkit.engine.mla) attends over a latent cache through the backend's
        # mla call; its layers are split for piecewise graphs (mla_pieces) and compile as the
        # Llama layers do (attention the opaque op).
        self.mla = c.is_mla
        if self.mla and self.fused_ops:
            raise ValueError("fused_ops=True runs the Llama layer's fused Triton ops; an MLA "
                             "model runs its own: leave it off")
        self.compiled = None
        if compile and self.fused_ops:
            raise ValueError("compile=True compiles the layers' plain ops (Inductor fuses "
                             "them itself): pass fused_ops=False, or leave it None")
        self.backend, self.selection_log = self._choose_backend(backend, block_size)
        self.use_graphs = self.cudagraph_mode.startswith("full")
        self.cache = self._make_cache(num_blocks, kv_cache_memory, block_size, max_num_seqs)
        # The store kernel is the fast path on a GPU; on CPU it runs interpreted, so it is used
        # only where the Triton backend is asked for (the whole Triton path, end to end).
        self.store_kernel = self.device.type == "cuda" or self.backend.name == "triton"
        if compile:  # its forward stores each layer's K/V itself (labkit::store_kv)
            from labkit.engine.compiled import CompiledForward
            self.compiled = CompiledForward(model, self.cache, self.store_kernel)
        self.staging = None
        if self.device.type == "cuda":
            from labkit.overlap.staging import PinnedStagingPool
            self.staging = PinnedStagingPool(num_buffers=2, device=self.device)
        self.decode_buckets: tuple[int, ...] | None = None
        self.graphs: GraphPool | None = None
        self.verify_graphs: VerifyGraphs | None = None
        buckets = tuple(sorted(set(decode_buckets or (
            *[b for b in DEFAULT_BUCKETS if b < max_num_seqs], max_num_seqs))))
        self.batch_buckets = buckets  # requests a full graph is captured for: decode, verify
        # cu_seqlens_q of a decode batch is 0, 1, ..., B: one constant, sliced per bucket.
        self._cu_arange = torch.arange(max(buckets[-1], max_num_seqs) + 1, dtype=torch.int32,
                                       device=self.device)
        # Decode graphs keyed by context too: each key's attention plans its KV splits for its
        # context bucket (max_model_len is always the last, so every decode has a key).
        self.decode_context_buckets: tuple[int, ...] | None = None
        if decode_context_buckets is not None:
            given = check_buckets("decode_context_buckets", decode_context_buckets,
                                  "context lengths in tokens")
            self.decode_context_buckets = tuple(sorted(
                {b for b in given if b < self.max_model_len} | {self.max_model_len}))
        if self.use_graphs:
            self.decode_buckets = buckets
            self.graphs = capture_decode_graphs(
                self.decode_forward, buckets, self.decode_context_buckets,
                self.max_blocks_per_seq, self.device)
        self.pieces: PiecewiseForward | MLAPiecewiseForward | None = None
        self.piecewise: PiecewiseGraphs | CompiledPiecewise | None = None
        if self.cudagraph_mode.endswith("piecewise"):
            token_buckets = token_buckets or default_token_buckets(max_num_batched_tokens)
            if self.compiled is not None:
                self.piecewise = capture_compiled_piecewise(self.compiled, token_buckets,
                                                            self.device)
            else:
                self.pieces, self.piecewise = capture_piecewise_graphs(
                    self.model, self.fused_ops, token_buckets, self.cache)
        if num_speculative_tokens is not None and self.use_graphs:
            self.capture_verify_graphs(num_speculative_tokens)

    def _choose_backend(self, backend: str, block_size: int):
        """Full graphs capture attention, so they need a backend that can be captured;
        piecewise graphs run it eagerly, so any backend serves. With full_and_piecewise, a
        backend named that cannot be captured keeps piecewise graphs only (as vLLM does)."""
        c = self.model.config

        def spec(graph: str) -> AttentionSpec:
            if self.mla:  # one latent row per token, read by every query head
                return AttentionSpec.here(
                    self.device, num_q_heads=c.num_attention_heads, num_kv_heads=1,
                    head_dim=c.latent_size, dtype=self.dtype, mla=True,
                    block_size=block_size, mixed_batch=True, cuda_graph=graph)
            return AttentionSpec.here(
                self.device, num_q_heads=c.num_attention_heads,
                num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=self.dtype,
                block_size=block_size, mixed_batch=True, cuda_graph=graph)

        full = self.cudagraph_mode.startswith("full")
        self.spec = spec("uniform_decode" if full else "none")
        try:
            return choose_backend(self.spec, backend)
        except BackendUnavailable:
            if self.cudagraph_mode != "full_and_piecewise" or backend == "auto":
                raise
        self.cudagraph_mode, self.spec = "piecewise", spec("none")
        chosen, lines = choose_backend(self.spec, backend)
        return chosen, [*lines, f"cudagraph_mode: {backend} cannot be captured in a full "
                                "decode graph, so every step replays piecewise graphs "
                                "(attention eager between them)"]

    # ------------------------------------------------------------------ KV cache
    def _make_cache(self, num_blocks, kv_cache_memory, block_size, max_num_seqs) -> PagedKVCache:
        c = self.model.config
        shape = KVCacheShape(c.num_hidden_layers, 1, c.latent_size, self.dtype, latent=True) \
            if self.mla else KVCacheShape(c.num_hidden_layers, c.num_key_value_heads,
                                          c.head_dim, self.dtype)
        if num_blocks is not None and kv_cache_memory is not None:
            raise ValueError(f"give num_blocks ({num_blocks}) or kv_cache_memory "
                             f"({kv_cache_memory:,} bytes), not both")
        if kv_cache_memory is not None:
            check_positive_int("kv_cache_memory", kv_cache_memory, hint="bytes")
            num_blocks = tokens_that_fit(shape, kv_cache_memory, block_size) // block_size
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory={kv_cache_memory:,} bytes holds no block of "
                                 f"{block_size} tokens at {shape.bytes_per_token:,} bytes per "
                                 "token; give more memory")
        elif num_blocks is None:
            # Enough for every running request at full length, and on a GPU at most half of
            # the memory still free once the model is loaded.
            num_blocks = max_num_seqs * self.max_blocks_per_seq
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                per_block = shape.bytes_per_token * block_size
                num_blocks = max(1, min(num_blocks, free // 2 // per_block))
        if isinstance(num_blocks, int) and num_blocks * block_size >= 2**31:
            raise ValueError(f"{num_blocks} blocks of {block_size} is more slots than the int32 "
                             "slot_mapping addresses; use fewer blocks")
        return PagedKVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, num_blocks,
                            block_size, self.dtype, self.device, latent=shape.latent)

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    # ------------------------------------------------------------------ metadata
    def to_device(self, md: StepMetadata, prev_tokens: torch.Tensor | None = None,
                  prev_accepted: torch.Tensor | None = None) -> DeviceMetadata:
        """One int32 buffer, one host-to-device copy, through this runner's pinned buffers
        (``device_metadata.metadata_to_device``); input tokens still PENDING on the host are
        taken from ``prev_tokens``, the previous step's samples on the device, and rows planned
        ahead of its accepted counts move by ``prev_accepted``."""
        return metadata_to_device(md, self.staging, prev_tokens, prev_accepted, self.block_size)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def execute(self, step: ScheduledStep, bm: BlockManager,
                prev_tokens: torch.Tensor | None = None,
                prev_accepted: torch.Tensor | None = None,
                inputs_ready: Callable[[], object] | None = None) -> StepOutput:
        """Runs ``step`` (call it after ``schedule()``, before ``update()``); ``prev_tokens``:
        the step in flight's next token per row that samples, on the device, for rows whose
        input is PENDING; ``prev_accepted``: its drafts kept per such row, for rows planned
        ahead of them (async speculation). ``inputs_ready`` is called once the step's inputs
        are queued on the device, right before its forward (e.g. an event's ``record``)."""
        self.cache.copy_blocks(list(step.block_copies))
        if not step.rows:
            vocab = self.model.config.vocab_size
            return StepOutput(torch.empty(0, vocab, device=self.device), None)
        md = build_step_metadata(step, bm)
        dev = self.to_device(md, prev_tokens, prev_accepted)
        if inputs_ready is not None:
            inputs_ready()
        return replace(self._run(step, md, dev), inputs=dev)

    def _run(self, step: ScheduledStep, md: StepMetadata, dev: DeviceMetadata) -> StepOutput:
        """``execute``'s forward: a full decode or verify graph, piecewise graphs, or eager.
        Lengths that wait on the step in flight are known on the device only: then no
        attention is given the host's."""
        host = md if md.lengths_known else None
        graph_batch, context = None, None
        if self.graphs is not None and step.is_decode_only:
            if self.decode_context_buckets is not None:
                context = md.max_seqlen_k
            key = self.graphs.key_for(len(step.rows), context)
            graph_batch = key[0] if key is not None else None
        verify = None if self.verify_graphs is None else self.verify_graphs.key_for(step)
        if verify is not None:
            return StepOutput(self.verify_graphs(dev), verify[0], graph_query_len=verify[1])
        tokens = md.num_tokens
        if graph_batch is None and self.piecewise is not None and \
                (bucket := self.piecewise.bucket_for(tokens)) is not None:
            if self.pieces is None:  # the compiled pieces' graphs; they store the K/V
                self.piecewise.load(dev.input_ids, dev.positions, dev.slot_mapping, bucket)
                hidden = self.piecewise.run(tokens, self._attention(dev, md.max_seqlen_q,
                                                                    store=False, host=host))
                return StepOutput(self.model.compute_logits(hidden[dev.logits_indices.long()]),
                                  None, bucket)
            self.pieces.load(dev.input_ids, dev.positions, dev.slot_mapping, bucket)
            attention = self._attention(dev, md.max_seqlen_q, store=self.pieces.cache is None,
                                        host=host)
            views = self.pieces.attention_views(tokens)
            self.piecewise.run(tokens, lambda layer: self.pieces.attend(layer, tokens, attention,
                                                                        views))
            hidden = self.pieces.hidden[:tokens]
            return StepOutput(self.model.compute_logits(hidden[dev.logits_indices.long()]),
                              None, bucket)
        if graph_batch is not None:
            # The graph reads block tables of one fixed width; only the used columns cross the
            # bus, the rest is padded on the device.
            tables = F.pad(dev.block_tables,
                           (0, self.max_blocks_per_seq - dev.block_tables.shape[1]))
            # Every decode row samples, so the graph's logits are already in row order.
            logits = self.graphs(*decode_inputs(replace(dev, block_tables=tables)),
                                 context=context)
            return StepOutput(logits, graph_batch)
        hidden = self._hidden_states(dev, md.max_seqlen_q, host=host)
        return StepOutput(self.model.compute_logits(hidden[dev.logits_indices.long()]), None)

    # ------------------------------------------------------------------ CUDA Graphs
    def graph_memory(self) -> list[dict]:
        """``cudagraphs.graph_memory`` of this runner's graphs."""
        return graph_memory(self.graphs, self.piecewise, self.pieces or self.piecewise,
                            None if self.verify_graphs is None else self.verify_graphs.pool)

    def capture_verify_graphs(self, num_speculative_tokens: int) -> VerifyGraphs:
        """Full graphs of uniform verify steps (k = ``num_speculative_tokens`` drafts a row),
        one per request bucket of the decode graphs. Off a GPU nothing is captured: the pool
        checks each call's shapes and runs ``verify_forward`` eagerly (how CPU tests take the
        branch)."""
        check_positive_int("num_speculative_tokens", num_speculative_tokens,
                           hint="k, the draft tokens each verify row checks")
        if self.verify_graphs is not None:
            raise RuntimeError("this runner's verify graphs are captured already")
        graphs = VerifyGraphs(self.verify_forward, self.decode_buckets or self.batch_buckets,
                              num_speculative_tokens + 1, self.max_blocks_per_seq, self.device)
        graphs.capture()
        self.verify_graphs = graphs
        return graphs

    def decode_forward(self, input_ids, positions, slot_mapping, block_tables, seq_lens,
                       context_bucket: int | None = None):
        """One decode token per row: [B] x 3, [B, max_blocks], [B] -> logits [B, vocab].

        What each graph captures (once per bucket): nothing here may read a value back to the
        host, and rows of PAD (-1) are computed but write no slot and are dropped. With a
        ``context_bucket`` (tokens) attention sees only the table's first blocks that hold it,
        so the kernel plans its KV splits for that context, not for ``max_model_len``.
        """
        batch = input_ids.shape[0]
        if context_bucket is not None:
            block_tables = block_tables[:, :math.ceil(context_bucket / self.block_size)]
        md = DeviceMetadata(input_ids.clamp(min=0), positions.clamp(min=0), slot_mapping,
                            self._cu_arange[:batch + 1], seq_lens.clamp(min=0), block_tables,
                            self._cu_arange[:batch])
        hidden = self._hidden_states(md, 1)
        return self.model.compute_logits(hidden)

    def verify_forward(self, input_ids, positions, slot_mapping, block_tables, seq_lens):
        """k + 1 tokens a row, causal within it: [B, k + 1] x 3, [B, max_blocks], [B] ->
        logits [B, k + 1, vocab]. Captured per request bucket as ``decode_forward`` is: no value
        read back to the host; PAD rows write no slot (their lengths clamp to 0, so they read
        no key either) and are dropped."""
        batch, q = input_ids.shape
        md = DeviceMetadata(input_ids.flatten().clamp(min=0), positions.flatten().clamp(min=0),
                            slot_mapping.flatten(), self._cu_arange[:batch + 1] * q,
                            seq_lens.clamp(min=0), block_tables,
                            None)  # logits_indices: every position samples
        hidden = self._hidden_states(md, q)
        return self.model.compute_logits(hidden).view(batch, q, -1)

    def _hidden_states(self, md: DeviceMetadata, max_query_len: int,
                       host: StepMetadata | None = None) -> torch.Tensor:
        """The forward of ``md``'s tokens, compiled (``compile=True``: it stores the K/V
        itself, so its attention does not) or with this runner's layer ops."""
        if self.compiled is not None:
            return self.compiled(md.input_ids, md.positions, md.slot_mapping,
                                 self._attention(md, max_query_len, store=False, host=host))
        return self.model.hidden_states(md.input_ids, md.positions,
                                        self._attention(md, max_query_len, host=host),
                                        fused_ops=self.fused_ops)
