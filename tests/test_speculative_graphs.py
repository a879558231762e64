"""Full CUDA Graphs of uniform verify steps, keyed by (request bucket, k + 1).

On CPU the full modes are refused and nothing can be captured, so these tests take the runner's
verify branch with a pool that checks every call against the captured shapes and runs the
captured function eagerly (``runner.capture_verify_graphs`` off a GPU), and run that function
directly on padded rows as the graph pool pads them. The tests marked ``gpu`` replay real graphs.
"""
import pytest
import torch

from labkit.engine import LLM, ModelConfig, ModelRunner, SamplingParams, SpeculativeConfig
from labkit.engine import random_model
from labkit.engine.cudagraphs import PAD
from labkit.engine.scheduler import Scheduler, SchedulerConfig
from labkit.engine.step_metadata import build_step_metadata
from labkit.engine.verify_graphs import VerifyGraphs
from labkit.kvcache import BlockManager

TINY = ModelConfig.tiny()
# A prompt that repeats (n-gram lookups find it), one the model tends to loop on, a plain one
PROMPTS = [[1, 2, 3, 4, 5] * 3 + [1, 2], [7, 8, 9], list(range(40)), [11, 12, 11, 12, 11]]
REPEATING = [[1, 2, 3, 4, 5] * 3 + [1, 2]]  # alone in its steps, its n-gram rows verify k


def outputs(llm, prompts=PROMPTS, max_tokens=24):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens))]


def spec(method: str, k: int) -> SpeculativeConfig:
    return SpeculativeConfig(method, num_speculative_tokens=k, acceptance=0.8)


@pytest.fixture(scope="module")
def plain():
    return {"mixed": outputs(LLM(TINY, device="cpu")),
            "repeating": outputs(LLM(TINY, device="cpu"), REPEATING)}


def cpu_verify_engine(method: str, k: int, **options) -> LLM:
    llm = LLM(TINY, device="cpu", speculative=spec(method, k), **options)
    llm.runner.capture_verify_graphs(k)
    return llm


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_verify_graphs_are_keyed_by_request_bucket_and_k_plus_one(k):
    llm = cpu_verify_engine("ngram", k, max_num_seqs=8)
    graphs = llm.runner.verify_graphs
    assert graphs.keys() == [(b, k + 1) for b in (1, 2, 4, 8)]
    [row] = [r for r in llm.runner.graph_memory() if r["graphs"] == "full verify"]
    assert row["count"] == 4


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("method, workload", [("controlled", "mixed"), ("ngram", "repeating")])
def test_uniform_verify_steps_take_the_verify_graphs_and_keep_greedy_outputs(plain, method,
                                                                             workload, k):
    prompts = PROMPTS if workload == "mixed" else REPEATING
    eager = LLM(TINY, device="cpu", speculative=spec(method, k))
    graphs = cpu_verify_engine(method, k)
    assert outputs(graphs, prompts) == outputs(eager, prompts) == plain[workload]
    counts = graphs.graph_steps
    assert counts["full verify"] > 0, counts
    assert eager.graph_steps["full verify"] == 0 and eager.runner.verify_graphs is None
    pool = graphs.runner.verify_graphs.stats
    assert pool.eager_calls == counts["full verify"], "each verify graph step went through it"
    for record in graphs.step_history:
        s = record.stats
        uniform = (not s.num_prefill_seqs and s.num_spec_proposed == k * s.num_decode_seqs
                   and s.num_decode_tokens == (k + 1) * s.num_decode_seqs)
        assert (record.graph == "full verify") == uniform, record
        if uniform:
            assert record.graph_query_len == k + 1 and record.graph_batch >= s.num_decode_seqs
    bm = graphs.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "a block leaked"


def test_verify_steps_beside_prefill_chunks_or_short_drafts_fall_back_and_are_counted(plain):
    # A tight token budget chunks the long prompt across steps beside the others' verifies;
    # near max_tokens a request has room for fewer than k drafts.
    llm = cpu_verify_engine("controlled", 3, max_num_batched_tokens=16, max_num_seqs=4)
    assert outputs(llm) == plain["mixed"]
    fallbacks = llm.runner.verify_graphs.fallbacks
    assert fallbacks["a prefill chunk in the step"] > 0, fallbacks
    assert fallbacks["a row with other than k=3 drafts"] > 0, fallbacks
    counts = llm.graph_steps
    assert counts["eager"] == len(llm.step_history) - counts["full verify"]
    verifying = sum(r.stats.num_spec_proposed > 0 for r in llm.step_history)
    assert sum(fallbacks.values()) == verifying - counts["full verify"], \
        "every verify step either replayed or was counted as a fallback"
    table = llm.history_table()
    assert set(table.graph) <= {"full verify", "eager"}


def three_verifying_requests(runner: ModelRunner, k: int):
    """A block manager and the step after the prefill of three requests, each verifying k
    controlled drafts (a bucket of 4 pads one row)."""
    bm = BlockManager(runner.num_blocks, runner.block_size)
    sched = Scheduler(SchedulerConfig(max_model_len=256, vocab_size=TINY.vocab_size,
                                      speculative=SpeculativeConfig("controlled", k)), bm)
    for i, p in enumerate([[5, 6, 7], list(range(20)), [9] * 17]):
        sched.add_request(i, p, max_tokens=8, reference=[3, 1, 4, 1, 5, 9, 2, 6])
    prefill = sched.schedule()
    sched.update(prefill, runner.execute(prefill, bm).logits.argmax(-1).tolist())
    step = sched.schedule()
    assert [r.num_draft for r in step.rows] == [k] * 3 and not step.is_decode_only
    return bm, step


def verify_inputs(runner: ModelRunner, md, q: int, pad: int = 0):
    """What the verify pool hands its graph: rows of q tokens, block tables at the captured
    width, then ``pad`` rows of PAD."""
    dev = runner.to_device(md)
    width = runner.max_blocks_per_seq

    def padded(x, trailing):
        x = x.view(-1, *trailing)
        return torch.cat([x, torch.full((pad, *trailing), PAD, dtype=x.dtype,
                                        device=x.device)])

    tables = torch.nn.functional.pad(dev.block_tables, (0, width - dev.block_tables.shape[1]))
    return (padded(dev.input_ids, (q,)), padded(dev.positions, (q,)),
            padded(dev.slot_mapping, (q,)), padded(tables, (width,)), padded(dev.seq_lens, ()))


def written_slots(runner: ModelRunner, before: torch.Tensor) -> list[int]:
    changed = (runner.cache.kv != before).flatten(2, 3).any(-1).any(-1).any(0).any(0)
    return changed.nonzero().flatten().tolist()


def test_the_verify_graph_function_ignores_its_padding_rows():
    """What a verify graph captures, run eagerly: three requests verifying k = 2 drafts each,
    padded with PAD rows as the pool pads them up to a bucket, write only the real rows' slots
    and give the eager step's logits."""
    k, pad = 2, 2
    runner = ModelRunner(random_model(TINY, seed=1, std=0.2), num_blocks=16)
    bm, step = three_verifying_requests(runner, k)
    md = build_step_metadata(step, bm)
    before = runner.cache.kv.clone()
    graph_logits = runner.verify_forward(*verify_inputs(runner, md, k + 1, pad))
    assert written_slots(runner, before) == sorted(md.slot_mapping), \
        "the padded batch wrote slots other than its real rows'"
    assert graph_logits.shape == (3 + pad, k + 1, TINY.vocab_size)
    eager = runner.execute(step, bm).logits
    torch.testing.assert_close(graph_logits[:3].flatten(0, 1), eager, rtol=1e-5, atol=1e-5)


def test_verify_graphs_need_a_draft_per_row():
    with pytest.raises(ValueError, match="at least one draft"):
        VerifyGraphs(lambda *a: None, (1, 2), 1, 4, torch.device("cpu"))


# ---------------------------------------------------------------- on a GPU: real replays
GPU_PROMPTS = PROMPTS[:3]  # 3 requests: bucket 4 pads one row


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("method", ["ngram", "controlled"])
def test_gpu_verify_graphs_replay_with_plain_decodings_greedy_outputs(method, k):
    def run(speculative=None):
        llm = LLM(TINY, device="cuda", dtype=torch.float32, cudagraph_mode="full_and_piecewise",
                  speculative=speculative)
        return llm, outputs(llm, GPU_PROMPTS), outputs(llm, REPEATING)

    _, base, base_repeating = run()
    llm, got, got_repeating = run(spec(method, k))
    assert got == base and got_repeating == base_repeating, f"{method} k={k} changed an output"
    graphs = llm.runner.verify_graphs
    assert graphs.keys() == [(b, k + 1) for b in llm.runner.decode_buckets]
    counts = llm.graph_steps
    assert counts["full verify"] > 0, (counts, dict(graphs.fallbacks))
    assert graphs.stats.replays == counts["full verify"] and graphs.stats.eager_calls == 0
    [memory] = [r for r in llm.runner.graph_memory() if r["graphs"] == "full verify"]
    assert memory["measured_bytes"] > 0 and memory["predicted_bytes"] is not None, memory
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks, "a block leaked"


@pytest.mark.gpu
def test_gpu_a_replayed_verify_graph_writes_only_its_rows_slots_and_gives_eager_logits():
    """A runner built with k = 2 captures its verify graphs at construction; three requests
    verifying replay the bucket of 4, whose padding row writes no slot."""
    k = 2
    model = random_model(TINY, seed=1, std=0.2, device="cuda", dtype=torch.float32)
    runner = ModelRunner(model, num_blocks=16, cudagraph_mode="full_decode_only",
                         num_speculative_tokens=k)
    assert runner.verify_graphs.keys() == [(b, k + 1) for b in runner.decode_buckets]
    bm, step = three_verifying_requests(runner, k)
    md = build_step_metadata(step, bm)
    before = runner.cache.kv.clone()
    out = runner.execute(step, bm)
    assert (out.graph_batch, out.graph_query_len) == (4, k + 1)
    assert written_slots(runner, before) == sorted(md.slot_mapping), \
        "the replay wrote slots other than its real rows'"
    pool = runner.verify_graphs.stats
    assert (pool.replays, pool.padded_rows, pool.eager_calls) == (1, 1, 0)
    eager = runner.verify_forward(*verify_inputs(runner, md, k + 1))
    torch.testing.assert_close(out.logits, eager.flatten(0, 1), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_gpu_verify_graph_padding_is_dropped_and_counted_in_the_step_records():
    """Three requests verify in a bucket of 4: the padding row's k + 1 tokens are computed and
    dropped (the outputs are plain decoding's) and the step records count them."""
    llm = LLM(TINY, device="cuda", dtype=torch.float32, cudagraph_mode="full_and_piecewise",
              speculative=spec("controlled", 2))
    assert outputs(llm, GPU_PROMPTS) == outputs(
        LLM(TINY, device="cuda", dtype=torch.float32, cudagraph_mode="full_and_piecewise"),
        GPU_PROMPTS)
    padded = [r for r in llm.step_history if r.graph == "full verify" and r.padded_tokens]
    assert padded and all(r.padded_tokens == 3 * r.stats.padded_rows for r in padded), padded
    assert llm.runner.verify_graphs.stats.padded_rows > 0
