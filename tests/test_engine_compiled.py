"""LLM(compile=True): the forward traced once by Dynamo, split at the opaque attention op, each
piece compiled by Inductor for a symbolic token count; the same greedy tokens as eager."""
import pytest
import torch

from labkit.engine import LLM, ModelConfig, SamplingParams, random_model
from labkit.engine.compiled import attention_context, attention_op

GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def engines():
    torch.manual_seed(0)
    model = random_model(ModelConfig.tiny(), seed=0, device="cpu")
    options = dict(max_num_batched_tokens=16, max_num_seqs=4)  # long prompts come in chunks
    return LLM(model, **options), LLM(model, compile=True, **options)


def tokens(llm, prompts):
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def test_the_compiled_engine_gives_eager_greedy_tokens(engines):
    eager, compiled = engines
    shared = [5] * 20  # a second request behind the same prefix: a prefix-cache hit
    prompts = [[1, 2, 3, 4, 5], [7], [3] * 37, shared + [1], shared + [2, 3]]
    assert tokens(compiled, prompts) == tokens(eager, prompts)
    assert compiled.stats.prefix_hit_tokens > 0 and not compiled.fused_ops


def test_the_graph_is_cut_at_every_attention_and_compiled_once_for_any_length(engines):
    eager, compiled = engines
    tokens(compiled, [[9, 8, 7], [2] * 11])
    stats = compiled.runner.compiled.stats
    layers = compiled.config.num_hidden_layers
    assert stats.attention_calls == layers and stats.pieces == layers + 1, stats
    before = stats.compilations
    prompts = [[4] * 13, [6, 6], [1] * 29]  # token counts not seen yet
    assert tokens(compiled, prompts) == tokens(eager, prompts)
    assert stats.compilations == before, "a symbolic token count: no recompilation"
    assert stats.compile_s > 0


def test_the_attention_op_fills_the_out_it_is_given_inside_a_steps_context():
    q = torch.randn(3, 2, 4)
    with pytest.raises(RuntimeError, match="outside attention_context"):
        attention_op(q, q, q, torch.empty_like(q), 0)

    def attention(layer, q, k, v, out):
        out.copy_(q * (layer + 1))
    out = torch.zeros_like(q)
    with attention_context(attention):
        assert attention_op(q, q, q, out, 2) is None
    torch.testing.assert_close(out, 3 * q)


@pytest.fixture(scope="module")
def piecewise_engines():
    model = random_model(ModelConfig.tiny(), seed=0, device="cpu")
    options = dict(max_num_batched_tokens=16, max_num_seqs=4)
    return LLM(model, **options), LLM(model, compile=True, cudagraph_mode="piecewise",
                                      cudagraph_capture_sizes=(1, 4, 8, 16), **options)


def test_compiled_piecewise_steps_replay_each_bucket_with_eager_tokens(piecewise_engines):
    eager, compiled = piecewise_engines
    runner = compiled.runner
    layers = compiled.config.num_hidden_layers
    stats = runner.piecewise.stats
    assert stats.num_pieces == layers + 1 and stats.num_graphs == 4 * (layers + 1)
    assert list(stats.buckets) == [1, 4, 8, 16]
    compilations = runner.compiled.stats.compilations
    assert compilations <= 2, "one symbolic compile, and one where Dynamo specialises 1 token"
    prompts = [[1, 2, 3, 4, 5], [7], [3] * 37, [5] * 20 + [1], [9, 9]]
    assert tokens(compiled, prompts) == tokens(eager, prompts)
    st = compiled.stats
    assert st.num_piecewise_steps == st.num_steps > 0, "every step fits a bucket here"
    assert st.padded_tokens > 0 and stats.padded_tokens == st.padded_tokens
    assert runner.compiled.stats.compilations == compilations, "replays compile nothing"
    assert runner.graph_memory()[0]["count"] == stats.num_graphs


def test_compiled_piecewise_runs_attention_on_the_real_rows_only(piecewise_engines):
    _, compiled = piecewise_engines
    pw = compiled.runner.piecewise
    seen = []

    def attention(layer, q, k, v, out=None):
        seen.append((layer, q.shape[0], k.shape[0], out.shape[0]))
        out.zero_()
    ids = torch.tensor([3, 1, 4], dtype=torch.int32)
    pw.load(ids, torch.arange(3, dtype=torch.int32), bucket=4)
    assert pw.ids[3] == 0, "a padding row reads token 0"
    hidden = pw.run(3, attention)
    assert hidden.shape == (3, compiled.config.hidden_size)
    assert seen == [(i, 3, 3, 3) for i in range(compiled.config.num_hidden_layers)]
    with pytest.raises(ValueError, match="num_tokens=17 has no captured bucket"):
        pw.run(17, attention)


def test_compile_refuses_what_it_cannot_do():
    model = random_model(ModelConfig.tiny(), seed=0, device="cpu")
    with pytest.raises(ValueError, match="pass fused_ops=False"):
        LLM(model, compile=True, fused_ops=True)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        LLM(model, compile=True, cudagraph_mode="full_and_piecewise")


def test_a_warm_start_reuses_the_compile_cache_a_cold_one_filled(tmp_path):
    from labkit.engine.compiled import compile_start
    start = compile_start(ModelConfig.tiny(), cache_dir=tmp_path)
    cold, warm = start["cold"], start["warm"]
    assert cold["compilations"] == warm["compilations"] >= 1
    assert any(tmp_path.iterdir()), "the cold start wrote Inductor's cache there"
    assert warm["compile_s"] < 0.7 * cold["compile_s"], start


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["full_and_piecewise", "full_decode_only", "piecewise"])
def test_compiled_pieces_under_cuda_graphs_give_eager_greedy_tokens(mode):
    model = random_model(ModelConfig.tiny(), seed=0, device="cuda")
    options = dict(max_num_batched_tokens=64, max_num_seqs=4)
    eager = LLM(model, enforce_eager=True, fused_ops=False, **options)
    compiled = LLM(model, compile=True, cudagraph_mode=mode, **options)
    prompts = [[1, 2, 3, 4, 5], [7], [3] * 90, [5] * 20 + [1], [9, 9]]
    assert tokens(compiled, prompts) == tokens(eager, prompts)
    st = compiled.stats
    assert (st.num_graph_steps > 0) == mode.startswith("full")
    assert (st.num_piecewise_steps > 0) == mode.endswith("piecewise")
    before = compiled.runner.compiled.stats.compilations
    assert tokens(compiled, [[4] * 13, [6] * 33]) == tokens(eager, [[4] * 13, [6] * 33])
    assert compiled.runner.compiled.stats.compilations == before, "graphs replay, no compile"


def test_each_compiled_engine_keeps_its_own_compilations():
    # Dynamo caches per code object: engines sharing one forward's code each added a guard
    # failure to it, and the recompile limit's engine failed hard (fullgraph=True).
    model = random_model(ModelConfig.tiny(), seed=0, device="cpu")
    with torch._dynamo.config.patch(recompile_limit=2):
        for _ in range(3):
            llm = LLM(model, compile=True, max_num_seqs=2)
            assert tokens(llm, [[1, 2, 3], [4] * 9])
            assert llm.runner.compiled.stats.compilations == 1
