"""A step's attention function: what every layer calls in place of attention.

The runner hands the model an attention function built for the step. In every layer it first
stores the step's new K/V into their slots and then runs the selected backend's paged attention
over the cache: so a row reads its cached context and its own new tokens alike. With labkit's
Triton kernel the launch is planned once for the step and each layer only launches. An MLA
model's function stores the step's latent rows instead, then attends decode rows with the
backend's mla call and prefill rows over decompressed keys and values
(``labkit.engine.mla_prefill``).
Built from the runner's own metadata, none of them reads a value back to the host.

:class:`StepAttention` holds these builders; ``ModelRunner`` inherits them, so they read its
cache, backend and model.
"""
from __future__ import annotations

import numpy as np

from labkit.engine.device_metadata import DeviceMetadata
from labkit.engine.mla_prefill import engine_latent_attention
from labkit.engine.step_metadata import StepMetadata


class StepAttention:
    """The runner's attention functions for a step (see the module docstring)."""

    def _paged(self, md: DeviceMetadata, max_query_len: int, host: StepMetadata | None):
        """(q, layer, out) -> attention of the step's rows over layer's cache. With labkit's
        Triton kernel the launch is planned once for the step (tiles, grid, KV split: the same
        in every layer) and each layer only launches; the runner built the metadata itself, so
        no host sync checks it. Other backends are called as they are, per layer, given the
        step's lengths from the host metadata (``host``; None in a captured decode graph) so that
        no layer reads them back."""
        cache = self.cache
        if self.backend.name == "triton":
            from labkit.kernels.paged_attention import plan_paged_attention
            plan = plan_paged_attention(
                cache.k_scale is not None, self.model.config.num_attention_heads,
                cache.key_cache(0).shape, md.seq_lens.numel(),
                md.block_tables.shape[1] * cache.block_size, max_query_len, self.device)
            tables, cu, lens = md.block_tables, md.cu_seqlens_q, md.seq_lens
            shared = []  # the split path's workspace, made by the first layer for all of them

            def run(q, layer, out):
                if not shared:
                    shared.append(plan.workspace(q))
                return plan.run(q, cache.key_cache(layer), cache.value_cache(layer), tables, cu,
                                lens, *cache.scales(layer), out=out, workspace=shared[0])
            return run
        paged = self.backend.paged
        lengths = {"host_lengths": (np.diff(host.cu_seqlens_q).tolist(), host.seq_lens)} \
            if host is not None and self.backend.name in ("sdpa", "flex") else {}

        def run(q, layer, out):
            result = paged(q, cache.key_cache(layer), cache.value_cache(layer), md.block_tables,
                           md.cu_seqlens_q, md.seq_lens, **lengths).to(q.dtype)
            return result if out is None else out.copy_(result)
        return run

    def _attention(self, md: DeviceMetadata, max_query_len: int, *, store: bool = True,
                   host: StepMetadata | None = None):
        """The step's AttentionFn; ``store=False`` when the K/V were stored already (piecewise
        graphs store them inside the pieces)."""
        if self.mla:
            return engine_latent_attention(self, md, max_query_len, store=store, host=host)
        cache, run = self.cache, self._paged(md, max_query_len, host)

        def attention(layer, q, k, v, out=None):
            # Every new token's K/V goes in before any row reads: a prefix hit admitted in this
            # step may read blocks that another row of the same step is writing.
            # The slots come from the block manager (in range by construction): no host sync
            # to check them, which would also stall async scheduling's overlap.
            if store:
                cache.write(layer, k, v, md.slot_mapping, use_kernel=self.store_kernel,
                            check=False)
            return run(q, layer, out)
        return attention
