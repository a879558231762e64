"""LLM(compile=True): the forward traced once by Dynamo, split at the opaque attention op, each
piece compiled by Inductor for a symbolic token count, each layer's K/V stored by an opaque
store op inside its piece; the same greedy tokens as eager."""
import pytest
import torch

import labkit.engine.compiled as compiled_module
from labkit.engine import LLM, ModelConfig, SamplingParams, random_model
from labkit.engine.compiled import attention_context, attention_op, store_kv_op

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


def test_a_first_step_as_long_as_a_cache_block_does_not_tie_the_graph_to_the_caches_shape():
    # The cache is an input of the compiled forward: with its sizes symbolic, a first step of
    # 16 tokens (the block size, the head size) made Dynamo guard on them being equal.
    model = random_model(ModelConfig.tiny(), seed=0, device="cpu")
    llm = LLM(model, compile=True, max_num_batched_tokens=16, max_num_seqs=2)
    assert tokens(llm, [[1] * 16]) and tokens(llm, [[2] * 5, [3] * 9])
    assert llm.runner.compiled.stats.compilations == 2, "symbolic, and 1 token specialised"


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
    pw.load(ids, torch.arange(3, dtype=torch.int32), torch.tensor([40, 41, 42]), bucket=4)
    assert pw.ids[3] == 0 and pw.slots[3] == -1, "a padding row reads token 0, stores nowhere"
    hidden = pw.run(3, attention)
    assert hidden.shape == (3, compiled.config.hidden_size)
    assert seen == [(i, 3, 3, 3) for i in range(compiled.config.num_hidden_layers)]
    with pytest.raises(ValueError, match="num_tokens=17 has no captured bucket"):
        pw.run(17, attention)


def written_slots(kv: torch.Tensor) -> set[int]:
    """The slots of a paged cache [layers, planes, blocks, block_size, H, D] holding anything."""
    per_slot = kv.abs().sum(dim=(0, 1, 4, 5)).flatten()
    return set(torch.nonzero(per_slot).flatten().tolist())


def test_the_compiled_pieces_store_the_loaded_slots_and_padding_rows_nowhere():
    model = random_model(ModelConfig.tiny(), seed=0, device="cpu")
    llm = LLM(model, compile=True, cudagraph_mode="piecewise", cudagraph_capture_sizes=(4, 8),
              max_num_batched_tokens=8, max_num_seqs=2)
    runner = llm.runner
    kv, pw = runner.cache.kv, runner.piecewise
    assert not written_slots(kv), "capturing every bucket (all rows padding) stored nothing"
    ids = torch.tensor([3, 1, 4], dtype=torch.int32)
    pw.load(ids, torch.arange(3, dtype=torch.int32), torch.tensor([5, 17, 2], dtype=torch.int32),
            bucket=8)
    assert pw.slots[3:8].eq(-1).all()
    pw.run(3, lambda layer, q, k, v, out=None: out.zero_())
    assert written_slots(kv) == {5, 17, 2}, "the 5 padding rows of bucket 8 wrote no slot"
    for layer in range(model.config.num_hidden_layers):  # each layer's own K and V went there
        k = runner.cache.key_cache(layer).flatten(0, 1)[[5, 17, 2]]
        assert k.abs().sum(dim=(1, 2)).gt(0).all()
    kv.zero_()
    pw.load(ids[:1], torch.zeros(1, dtype=torch.int32), torch.tensor([9], dtype=torch.int32),
            bucket=4)
    pw.run(1, lambda layer, q, k, v, out=None: out.zero_())
    assert written_slots(kv) == {9}, "a replay stores the slots loaded for its step"


@pytest.mark.parametrize("fixture", ["engines", "piecewise_engines"])
def test_the_forward_stores_each_layers_kv_once_a_step_and_attention_stores_none(
        fixture, request, monkeypatch):
    eager, compiled = request.getfixturevalue(fixture)
    layers = compiled.config.num_hidden_layers
    stats = compiled.runner.compiled.stats
    assert stats.attention_calls == layers and stats.pieces == layers + 1, stats
    assert stats.stores == [1] * layers + [0], "one store inside each piece before attention"
    stored, attention_stored = [], []
    store_kv_ref = compiled_module.store_kv_ref
    monkeypatch.setattr(compiled_module, "store_kv_ref",
                        lambda *args, **kw: (stored.append(args[4].clone()),
                                             store_kv_ref(*args, **kw))[1])
    monkeypatch.setattr(compiled.runner.cache, "write",
                        lambda layer, *args, **kw: attention_stored.append(layer))
    steps = compiled.stats.num_steps
    prompts = [[8] * 21, [6, 5]]  # chunked: a prefill step, a mixed one, then decodes
    assert tokens(compiled, prompts) == tokens(eager, prompts)
    steps = compiled.stats.num_steps - steps
    assert not attention_stored, "the step's attention stored K/V the forward had stored"
    assert len(stored) == layers * steps, (len(stored), layers, steps)


def test_the_store_op_writes_its_layers_kv_and_skips_padding_slots():
    kv = torch.zeros(2, 2, 4, 4, 2, 8)  # layers, K/V, blocks, block_size, heads, head_dim
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    store_kv_op(key, value, kv, torch.tensor([6, -1, 0]), 1, None, None, False)
    assert written_slots(kv) == {6, 0} and not kv[0].any()
    torch.testing.assert_close(kv[1, 0].flatten(0, 1)[[6, 0]], key[[0, 2]])
    torch.testing.assert_close(kv[1, 1].flatten(0, 1)[[6, 0]], value[[0, 2]])
    latent = torch.zeros(2, 1, 4, 4, 1, 8)  # MLA: one latent row per slot, as key, no value
    store_kv_op(key[:, :1], None, latent, torch.tensor([-1, 3, 1]), 0, None, None, False)
    torch.testing.assert_close(latent[0, 0].flatten(0, 1)[[3, 1]], key[1:, :1])


def test_an_mla_models_latent_rows_are_stored_by_the_compiled_pieces(monkeypatch):
    from mla_cases import mla_model, tiny_mla
    model = mla_model(tiny_mla(), 3)
    options = dict(device="cpu", max_num_batched_tokens=16, max_num_seqs=4)
    eager = LLM(model, **options)
    compiled = LLM(model, compile=True, cudagraph_mode="piecewise", **options)
    layers = model.config.num_hidden_layers
    assert compiled.runner.compiled.stats.stores == [1] * layers + [0]
    attention_stored = []
    monkeypatch.setattr(compiled.runner.cache, "write_latent",
                        lambda layer, *args, **kw: attention_stored.append(layer))
    prompts = [list(range(1, 10)), list(range(20, 50)), [11, 12]]
    assert tokens(compiled, prompts) == tokens(eager, prompts)
    assert not attention_stored, "the latent attention stored rows the pieces had stored"
    assert compiled.stats.num_piecewise_steps > 0


def test_compiled_piecewise_steps_with_chunks_and_prefix_hits_give_eager_tokens(
        piecewise_engines):
    eager, compiled = piecewise_engines
    shared = [5] * 20  # a second request behind the same prefix: a prefix-cache hit
    prompts = [[1, 2, 3, 4, 5], [7], [3] * 37, shared + [1], shared + [2, 3]]
    hits = compiled.stats.prefix_hit_tokens
    before = compiled.runner.compiled.stats.compilations
    assert tokens(compiled, prompts) == tokens(eager, prompts)
    assert compiled.stats.prefix_hit_tokens > hits
    assert compiled.runner.compiled.stats.compilations == before


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


def agree_until_a_near_tie(model, prompt, ours, reference, rel):
    """``ours`` may leave ``reference`` only where the plain forward's top two logits were
    within ``rel`` of its largest: bf16 rounding (Inductor's fused kernels round once where
    eager rounds after every op) can flip such an argmax, and after it all differs."""
    for t, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            ids = torch.tensor([prompt + reference[:t]], device="cuda")
            top2 = model(ids)[0, -1].float().topk(2).values
            gap = (top2[0] - top2[1]).item()
            assert gap <= rel * top2[0].abs().item(), (
                f"token {t}: compiled {a}, eager {b}, where the margin was {gap:.4f} of "
                f"{top2[0].item():.3f}: no near-tie, so a real difference")
            return
    assert ours == reference


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, rel", [(torch.float32, 0.0), (torch.bfloat16, 5e-2)],
                         ids=["float32", "bf16"])
@pytest.mark.parametrize("mode", ["full_and_piecewise", "piecewise"])
def test_gpu_compiled_pieces_store_the_kv_inside_their_graphs(mode, dtype, rel, monkeypatch):
    model = random_model(ModelConfig.tiny(), seed=0, device="cuda", dtype=dtype)
    options = dict(max_num_batched_tokens=64, max_num_seqs=4)
    eager = LLM(model, enforce_eager=True, fused_ops=False, **options)
    compiled = LLM(model, compile=True, cudagraph_mode=mode, **options)
    layers = compiled.config.num_hidden_layers
    assert compiled.runner.compiled.stats.stores == [1] * layers + [0]
    attention_stored = []
    monkeypatch.setattr(compiled.runner.cache, "write",
                        lambda layer, *args, **kw: attention_stored.append(layer))
    shared = [5] * 20  # a prefix-cache hit; [3] * 90 comes in chunks, mixed with decodes
    prompts = [[1, 2, 3, 4, 5], [7], [3] * 90, shared + [1], shared + [2, 3], [9, 9]]
    ours, reference = tokens(compiled, prompts), tokens(eager, prompts)
    for prompt, a, b in zip(prompts, ours, reference):
        agree_until_a_near_tie(model, prompt, a, b, rel)
    assert not attention_stored, "the eager attention between the graphs stored K/V again"
    st = compiled.stats
    assert st.num_piecewise_steps > 0 and st.prefix_hit_tokens > 0
    assert (st.num_graph_steps > 0) == mode.startswith("full")
    before = compiled.runner.compiled.stats.compilations
    again = tokens(compiled, prompts[:3])  # prefix hits now: other steps, other buckets
    if dtype == torch.float32:
        assert again == ours[:3]
    assert compiled.runner.compiled.stats.compilations == before, "graphs replay, no compile"
