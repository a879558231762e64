"""The engine serving an MLA model: a latent paged cache, the backend's mla call, and the same
greedy tokens as the model's own decompressed forward, under the engine's mechanisms."""
import pytest

from labkit.attention import BackendUnavailable
from labkit.engine import LLM, SamplingParams
from labkit.engine.mla import generate_greedy

from mla_cases import hf_model, mla_model, tiny_mla

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 12], list(range(20, 50)), [1, 2, 3, 4, 5, 6, 60]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def model():
    return mla_model(tiny_mla(), 3)


@pytest.fixture(scope="module")
def expected(model):
    """Each prompt's greedy tokens from the whole sequence recomputed every step through the
    decompressed path: no cache, no kernel, no engine."""
    return [generate_greedy(model, p, MAX_TOKENS, absorbed=False) for p in PROMPTS]


def tokens(llm, prompts=PROMPTS):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]


def test_the_engine_gives_the_decompressed_forwards_greedy_tokens(model, expected):
    llm = LLM(model, device="cpu")
    assert tokens(llm) == expected
    shape = llm.runner.cache.shape
    assert shape.latent and shape.num_kv_heads == 1 and shape.head_dim == 48
    assert shape.bytes_per_token == 2 * 48 * 4, "one 48-wide float32 row per token and layer"
    assert llm.backend == "reference" and "for MLA" in llm.selection_log[0]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=16, max_num_seqs=4),      # chunked prefill, mixed steps
    dict(num_blocks=14, block_size=4, max_num_seqs=4),    # preemption under block pressure
    dict(enable_prefix_caching=False),
], ids=["chunked", "preemption", "no-prefix-cache"])
def test_the_engines_mechanisms_keep_the_tokens(model, expected, options):
    llm = LLM(model, device="cpu", **options)
    assert tokens(llm) == expected
    if "num_blocks" in options:
        assert llm.stats.preemptions > 0, "the pressure test preempted nothing"


def test_a_shared_prefix_is_read_from_cached_latent_blocks(model, expected):
    llm = LLM(model, device="cpu", block_size=4)
    assert tokens(llm, PROMPTS[:1]) == expected[:1]
    assert tokens(llm, PROMPTS[3:]) == expected[3:]  # shares its first 6 tokens: 1 block hit
    assert llm.stats.prefix_hit_tokens >= 4


def test_labkits_triton_kernel_serves_it_too(model, expected):
    llm = LLM(model, device="cpu", backend="triton")
    assert llm.backend == "triton"
    assert tokens(llm, PROMPTS[:2]) == expected[:2]


def test_what_cannot_serve_an_mla_model_says_so(model):
    with pytest.raises(BackendUnavailable, match="MLA"):
        LLM(model, device="cpu", backend="sdpa")
    with pytest.raises(ValueError, match="leave it off"):
        LLM(model, device="cpu", fused_ops=True)


def test_a_deepseek_checkpoint_folder_serves(tmp_path):
    config = tiny_mla()
    hf_model(config, 5).save_pretrained(tmp_path)
    from labkit.engine.weights import load_mla_model

    expected = [generate_greedy(load_mla_model(tmp_path), p, 6, absorbed=False)
                for p in PROMPTS[:2]]
    llm = LLM(str(tmp_path), device="cpu")
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], SamplingParams(max_tokens=6))] == \
        expected


@pytest.mark.parametrize("options", [dict(), dict(max_num_batched_tokens=16, max_num_seqs=4)],
                         ids=["whole-prompts", "chunked"])
def test_piecewise_graphs_replay_an_mla_model_with_the_same_tokens(model, expected, options):
    """The MLA layer cut at attention (mla_pieces), its pieces captured by the CPU stand-in:
    a piece that read anything but its static buffers would replay stale values here."""
    llm = LLM(model, device="cpu", cudagraph_mode="piecewise", **options)
    assert llm.cudagraph_mode == "piecewise"
    assert tokens(llm) == expected
    kinds = [s.graph for s in llm.step_history]
    assert kinds.count("piecewise") >= len(kinds) - 1, kinds  # only a step past the buckets not
    if options:
        assert any(s.stats.num_prefill_tokens and s.stats.num_decode_tokens
                   for s in llm.step_history), "no mixed step was replayed"


@pytest.mark.parametrize("mode", ["none", "piecewise"])
def test_compile_traces_an_mla_model_split_at_its_latent_attention(model, expected, mode):
    """compile=True on the MLA model: Dynamo traces it with attention the opaque
    labkit::attention op (latent rows as k, no v, an out of the values' width), Inductor
    compiles the pieces, and under piecewise graphs the compiled pieces replay around it."""
    llm = LLM(model, device="cpu", compile=True, cudagraph_mode=mode, max_num_batched_tokens=16,
              max_num_seqs=4)
    assert tokens(llm) == expected
    stats = llm.runner.compiled.stats
    assert stats.attention_calls == model.config.num_hidden_layers
    assert stats.compilations <= 2, "one symbolic compile, and one where Dynamo specialises 1"
    before = stats.compilations
    assert tokens(llm) == expected
    assert stats.compilations == before, "steps of sizes seen before compiled again"
    if mode == "piecewise":
        assert "piecewise" in {s.graph for s in llm.step_history}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["none", "full_decode_only", "piecewise", "full_and_piecewise"])
def test_gpu_mla_engine_tokens_in_every_graph_mode(mode):
    model = mla_model(tiny_mla(), 3).to("cuda")
    expected = [generate_greedy(model, p, MAX_TOKENS, absorbed=False) for p in PROMPTS]
    llm = LLM(model, cudagraph_mode=mode, max_num_batched_tokens=16, max_num_seqs=4)
    assert llm.backend == "triton" and llm.cudagraph_mode == mode
    assert tokens(llm) == expected
    kinds = {s.graph for s in llm.step_history}
    assert ("full" in kinds) == mode.startswith("full")
    assert ("piecewise" in kinds) == mode.endswith("piecewise")


@pytest.mark.gpu
def test_gpu_compiled_mla_engine_under_the_default_graphs():
    model = mla_model(tiny_mla(), 3).to("cuda")
    expected = [generate_greedy(model, p, MAX_TOKENS, absorbed=False) for p in PROMPTS]
    llm = LLM(model, compile=True, max_num_batched_tokens=16, max_num_seqs=4)
    assert llm.cudagraph_mode == "full_and_piecewise" and tokens(llm) == expected
    assert {"full", "piecewise"} <= {s.graph for s in llm.step_history}
