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


def test_the_attention_op_runs_only_inside_a_steps_context():
    q = torch.randn(3, 2, 4)
    with pytest.raises(RuntimeError, match="outside attention_context"):
        attention_op(q, q, q, 0)

    def attention(layer, q, k, v, out):
        out.copy_(q * (layer + 1))
    with attention_context(attention):
        torch.testing.assert_close(attention_op(q, q, q, 2), 3 * q)


def test_compile_refuses_what_it_cannot_do_yet():
    model = random_model(ModelConfig.tiny(), seed=0, device="cpu")
    with pytest.raises(ValueError, match="compile=True runs with cudagraph_mode='none'"):
        LLM(model, compile=True, cudagraph_mode="piecewise")
    with pytest.raises(ValueError, match="pass fused_ops=False"):
        LLM(model, compile=True, fused_ops=True)


def test_a_warm_start_reuses_the_compile_cache_a_cold_one_filled(tmp_path):
    from labkit.engine.compiled import compile_start
    start = compile_start(ModelConfig.tiny(), cache_dir=tmp_path)
    cold, warm = start["cold"], start["warm"]
    assert cold["compilations"] == warm["compilations"] >= 1
    assert any(tmp_path.iterdir()), "the cold start wrote Inductor's cache there"
    assert warm["compile_s"] < 0.7 * cold["compile_s"], start
