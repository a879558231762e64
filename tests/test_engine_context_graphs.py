"""Decode graphs keyed by (batch, context bucket): each key's attention sees only the block-table
columns its context needs, so the kernel plans its KV splits for that context, not for
max_model_len. The full graphs need CUDA; on CPU the decode forward itself is checked."""
import dataclasses

import pytest
import torch

from labkit.engine import LLM, SamplingParams
from labkit.engine.runner import PAD, decode_inputs
from labkit.engine.step_metadata import build_step_metadata

from engine_peer import hf_model, make_prompts  # noqa: F401


def test_context_buckets_always_end_at_max_model_len_and_refuse_bad_values(hf_model):
    llm = LLM(hf_model[1], device="cpu", max_model_len=128, decode_context_buckets=[512, 32, 64])
    assert llm.runner.decode_context_buckets == (32, 64, 128), "past max_model_len: dropped"
    with pytest.raises(ValueError, match=r"decode_context_buckets\[1\]"):
        LLM(hf_model[1], device="cpu", decode_context_buckets=[32, 0])


def test_a_context_bucket_reads_only_the_columns_it_needs_and_gives_the_same_logits(hf_model):
    llm = LLM(hf_model[1], device="cpu", max_model_len=128, block_size=8, max_num_seqs=4)
    prompts = make_prompts([5, 17, 9], seed=2)
    for p in prompts:
        llm.add_request(p, SamplingParams(max_tokens=4))
    llm.step()  # the prefill: every request now holds its context in the cache
    runner, bm = llm.runner, llm.block_manager
    step = llm.scheduler.schedule()
    assert step.is_decode_only
    md = build_step_metadata(step, bm)
    dev = runner.to_device(md)
    width = runner.max_blocks_per_seq
    full = torch.nn.functional.pad(dev.block_tables, (0, width - dev.block_tables.shape[1]),
                                   value=PAD)
    seen = []
    paged = runner.backend.paged
    def counting(q, k, v, tables, *rest, **kwargs):
        seen.append(tables.shape[1])
        return paged(q, k, v, tables, *rest, **kwargs)

    runner.backend = dataclasses.replace(runner.backend, paged=counting)
    args = decode_inputs(dataclasses.replace(dev, block_tables=full))
    want = runner.decode_forward(*args)
    got = runner.decode_forward(*args, context_bucket=md.max_seqlen_k)
    assert seen[0] == width and seen[-1] == -(-md.max_seqlen_k // 8) < width
    torch.testing.assert_close(got, want)
    llm.scheduler.abort_step(step)


@pytest.mark.gpu
def test_gpu_context_keyed_decode_graphs_give_the_same_tokens(hf_model):
    prompts = make_prompts([3, 40, 1, 17, 9, 64, 2], seed=9)
    params = SamplingParams(max_tokens=24)
    keyed = LLM(hf_model[1], device="cuda", decode_context_buckets=[32, 64])
    eager = LLM(hf_model[1], device="cuda", enforce_eager=True)
    assert [o.token_ids for o in keyed.generate(prompts, params)] == \
        [o.token_ids for o in eager.generate(prompts, params)]
    keys = keyed.runner.graphs.keys()
    assert {k[1] for k in keys} == {32, 64, keyed.runner.max_model_len}
    assert keyed.stats.num_graph_steps > 0
