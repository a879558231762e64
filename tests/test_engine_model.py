"""labkit's Llama-style model against transformers' LlamaForCausalLM, its loader and its paths.

The peer check: transformers builds a model at random init from a seed and saves it with
``save_pretrained``; labkit loads those files with its own loader, and both must give the same
logits and the same greedy tokens.
"""
import json

import pytest
import torch
import transformers  # a test dependency: the peer the model is checked against
from safetensors.torch import load_file, save_file

from labkit.engine import LlamaModel, ModelConfig, load_model, load_weights, random_model
from labkit.engine.model import flash_unsupported, positions_in_sequences
from labkit.engine.weights import INDEX_FILE, SINGLE_FILE, hf_state_dict, save_weights

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
            rope_theta=10000.0, rms_norm_eps=1e-6)


def hf_checkpoint(path, seed=0, initializer_range=0.02, device="cpu", **overrides):
    """A transformers Llama at random init, saved as safetensors in ``path``: (hf model, path)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**TINY, **overrides},
                                      initializer_range=initializer_range)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(path, safe_serialization=True)
    return hf.to(device), path


def assert_logits_close(ours, ref, what, rel=1e-4):
    err = (ours.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= rel * scale + 1e-6, (
        f"{what}: logits differ by {err:.2e} (largest logit {scale:.2e}, allowed {rel:g} of "
        "it); a mismatch here usually means a RoPE convention, the RMSNorm dtype or a "
        "q/k/v row order differs from transformers")


def greedy(forward, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Full-forward greedy decoding: ``forward([1, len]) -> [1, len, vocab]``."""
    ids = prompt[None]
    for _ in range(max_new_tokens):
        next_id = forward(ids)[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, prompt.numel():].tolist()


# --- config -----------------------------------------------------------------------------------

def test_config_reads_transformers_5_names(tmp_path):
    _, path = hf_checkpoint(tmp_path, rope_theta=500000.0)
    on_disk = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_json(path)
    assert config.rope_theta == 500000.0, f"rope_theta lost from {on_disk.get('rope_parameters')}"
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim) == (64, 2, 16)
    assert config.torch_dtype == "float32"


def test_config_reads_transformers_4_names():
    config = ModelConfig.from_dict({**TINY, "rope_theta": 1e6, "torch_dtype": "bfloat16",
                                    "model_type": "llama", "use_cache": True})
    assert (config.rope_theta, config.dtype) == (1e6, torch.bfloat16)


def test_config_without_kv_heads_is_multi_head():
    values = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    assert ModelConfig.from_dict(values).num_key_value_heads == TINY["num_attention_heads"]


@pytest.mark.parametrize("change, message", [
    (dict(num_key_value_heads=3), "must be a multiple of num_key_value_heads"),
    (dict(hidden_size=66), "set head_dim explicitly"),
    (dict(head_dim=15), "positive even int"),
    (dict(vocab_size=0), "vocab_size must be a positive int"),
    (dict(torch_dtype="float8"), "torch_dtype must be one of"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps must be a finite number > 0"),
])
def test_config_errors_say_what_to_change(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.tiny(**change)


def test_config_missing_a_required_field_names_it():
    with pytest.raises(ValueError, match=r"lacks \['intermediate_size'"):
        ModelConfig.from_dict({k: v for k, v in TINY.items() if k != "intermediate_size"})


@pytest.mark.parametrize("config", [ModelConfig.tiny(), ModelConfig.tiny(tie_word_embeddings=True),
                                    ModelConfig.bench_1b()], ids=["tiny", "tied", "bench_1b"])
def test_parameter_count_formula_matches_the_built_model(config):
    model = LlamaModel(config, device="meta")  # shapes only: no memory for the 1B model
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("extra, message", [
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3"),
])
def test_config_refuses_arithmetic_the_model_does_not_implement(extra, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**TINY, **extra})


# --- logits and generations against transformers ----------------------------------------------

@pytest.mark.parametrize("heads", [
    pytest.param(dict(num_attention_heads=4, num_key_value_heads=2), id="gqa"),
    pytest.param(dict(num_attention_heads=4, num_key_value_heads=4), id="mha"),
    pytest.param(dict(num_attention_heads=4, num_key_value_heads=1), id="mqa"),
    pytest.param(dict(tie_word_embeddings=True), id="tied-embeddings"),
    pytest.param(dict(head_dim=32), id="head_dim-not-hidden-over-heads"),
])
def test_logits_match_transformers(tmp_path, heads):
    hf, path = hf_checkpoint(tmp_path, **heads)
    model = load_model(path)
    ids = torch.randint(0, TINY["vocab_size"], (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    assert_logits_close(model(ids), ref, f"labkit vs transformers ({heads})")


def test_tied_checkpoint_has_no_lm_head_and_shares_the_embedding(tmp_path):
    _, path = hf_checkpoint(tmp_path, tie_word_embeddings=True)
    model = load_model(path)
    assert model.lm_head is None
    assert model.output_weight is model.embed_tokens, "tied: logits must use the embedding"


def test_greedy_generation_identical_to_transformers(tmp_path):
    # A wider init than the default: logits spread out, so the tokens vary and no argmax is a
    # near-tie that float rounding could flip.
    hf, path = hf_checkpoint(tmp_path, initializer_range=0.2)
    model = load_model(path)
    prompt = torch.tensor([3, 17, 42, 99, 5])
    ours = greedy(model, prompt, 16)
    with torch.no_grad():
        theirs = hf.generate(prompt[None], max_new_tokens=16, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, prompt.numel():].tolist()
    assert len(set(ours)) >= 8, f"a degenerate generation proves little: {ours}"
    assert ours == theirs, f"greedy tokens diverge:\n labkit       {ours}\n transformers {theirs}"


# --- loading and saving -----------------------------------------------------------------------

def test_sharded_checkpoint_loads_through_its_index(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    hf.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / INDEX_FILE).is_file() and not (tmp_path / SINGLE_FILE).exists()
    ids = torch.randint(0, TINY["vocab_size"], (1, 9))
    with torch.no_grad():
        ref = hf(ids).logits
    assert_logits_close(load_model(tmp_path)(ids), ref, "sharded checkpoint")


def test_labkit_checkpoint_loads_in_transformers(tmp_path):
    model = random_model(ModelConfig.tiny(), seed=7)
    save_weights(model, tmp_path, max_shard_bytes=100_000)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 11))
    with torch.no_grad():
        ref = hf(ids).logits
    assert_logits_close(model(ids), ref, "labkit-saved checkpoint read by transformers")


def test_save_then_load_round_trips_every_tensor_exactly(tmp_path):
    model = random_model(ModelConfig.tiny(), seed=3)
    loaded = load_model(save_weights(model, tmp_path))
    for (name, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), f"{name} changed in a save/load round trip"


def test_load_converts_to_the_model_dtype(tmp_path):
    _, path = hf_checkpoint(tmp_path)
    ours = load_model(path, dtype=torch.bfloat16)
    ref = load_model(path)
    assert ours.embed_tokens.dtype == torch.bfloat16
    assert torch.equal(ours.layers[1].qkv_proj, ref.layers[1].qkv_proj.to(torch.bfloat16))


def test_random_init_is_reproducible_from_its_seed():
    a, b, c = (random_model(ModelConfig.tiny(), seed=s) for s in (5, 5, 6))
    assert torch.equal(a.layers[0].qkv_proj, b.layers[0].qkv_proj), "same seed, other weights"
    assert not torch.equal(a.layers[0].qkv_proj, c.layers[0].qkv_proj), "seed is ignored"


def _rewrite(path, change):
    tensors = load_file(path / SINGLE_FILE)
    change(tensors)
    save_file(tensors, path / SINGLE_FILE, metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    _, path = hf_checkpoint(tmp_path)
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing: model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(path)


def test_mis_shaped_tensor_is_named_with_both_shapes(tmp_path):
    _, path = hf_checkpoint(tmp_path)
    _rewrite(path, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(96, 64)}))
    with pytest.raises(ValueError, match=r"up_proj\.weight: checkpoint \[96, 64\], model "
                                         r"expects \[128, 64\]"):
        load_model(path)


def test_unexpected_tensor_is_named(tmp_path):
    _, path = hf_checkpoint(tmp_path)
    _rewrite(path, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}))
    with pytest.raises(ValueError, match=r"unexpected: model\.layers\.0\.self_attn\.q_norm"):
        load_model(path)


def test_failed_load_leaves_the_model_unchanged(tmp_path):
    _, path = hf_checkpoint(tmp_path)
    _rewrite(path, lambda t: t.pop("lm_head.weight"))
    model = random_model(ModelConfig.from_json(path), seed=0)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="missing: lm_head.weight"):
        load_weights(model, path)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters()), \
        "a load that failed its checks still wrote some parameters"


def test_folder_without_weights_says_what_was_looked_for(tmp_path):
    with pytest.raises(FileNotFoundError, match=INDEX_FILE):
        load_weights(LlamaModel(ModelConfig.tiny()), tmp_path)


def test_hf_state_dict_splits_fused_weights_back():
    model = random_model(ModelConfig.tiny(), seed=0)
    tensors = hf_state_dict(model)
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (64, 64) and torch.equal(q, model.layers[0].qkv_proj[:64])


# --- the packed (varlen) forward --------------------------------------------------------------

def _packed(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return seqs, torch.cat(seqs), cu


@pytest.mark.parametrize("lengths", [[7, 1, 12], [5], [1, 1, 1], [9, 0, 4]],
                         ids=["mixed", "one-sequence", "all-one-token", "with-empty"])
def test_varlen_forward_equals_per_sequence_forward(lengths):
    model = random_model(ModelConfig.tiny(), seed=2)
    seqs, ids, cu = _packed(lengths, model.config.vocab_size)
    packed = model.forward_varlen(ids, cu, backend="reference")
    for b, seq in enumerate(seqs):
        if seq.numel():
            assert_logits_close(packed[cu[b]:cu[b + 1]], model(seq[None])[0],
                                f"sequence {b} of lengths {lengths}, packed vs alone")


def test_positions_restart_at_every_sequence():
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32)
    assert positions_in_sequences(cu).tolist() == [0, 1, 2, 0, 1]


def test_varlen_with_the_triton_kernel_matches_the_reference_path():
    # On CPU the kernel runs in Triton's interpreter: float32 and few tokens keep it quick.
    model = random_model(ModelConfig.tiny(), seed=4)
    _, ids, cu = _packed([6, 1, 10], model.config.vocab_size)
    ref = model.forward_varlen(ids, cu, backend="reference")
    assert_logits_close(model.forward_varlen(ids, cu, backend="triton"), ref,
                        "flash_attention vs reference attention")


def test_auto_backend_on_cpu_says_why_it_uses_the_reference():
    reasons = flash_unsupported(ModelConfig.tiny(), torch.device("cpu"), torch.float32)
    assert any("interpreter" in r for r in reasons), reasons


def test_position_past_the_context_is_a_clear_error():
    model = random_model(ModelConfig.tiny(max_position_embeddings=8), seed=0)
    with pytest.raises(ValueError, match="past the model's context of 8 tokens"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_unknown_varlen_backend_is_refused():
    model = random_model(ModelConfig.tiny(), seed=0)
    _, ids, cu = _packed([3], model.config.vocab_size)
    with pytest.raises(ValueError, match="backend must be"):
        model.forward_varlen(ids, cu, backend="flashinfer")


def test_swapped_attention_runs_the_model_over_a_paged_kv_cache():
    """The contract the engine relies on: prefill, then decode one token per step, with K/V kept
    in a paged cache by the attention function, gives the full forward's logits."""
    from labkit.attention import paged_attention_ref
    from labkit.kvcache import BlockManager, PagedKVCache

    model = random_model(ModelConfig.tiny(), seed=8, std=0.2)
    c = model.config
    cache = PagedKVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, num_blocks=8,
                         block_size=4, dtype=torch.float32)
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    seqs = [torch.tensor([5, 9, 200, 31, 7]), torch.tensor([44, 2])]
    for i, s in enumerate(seqs):
        bm.allocate(i, s.tolist())  # as they grow, their blocks interleave in the cache
    for step in range(5):
        starts = [0] * 2 if step == 0 else [s.numel() - 1 for s in seqs]
        new = [s[start:] for s, start in zip(seqs, starts)]
        lens = torch.tensor([s.numel() for s in seqs], dtype=torch.int32)
        cu_q = torch.tensor([0, *torch.tensor([n.numel() for n in new]).cumsum(0)],
                            dtype=torch.int32)
        slots = torch.tensor([x for i, (a, n) in enumerate(zip(starts, lens.tolist()))
                              for x in bm.slots(i, a, n)])
        tables = [bm.block_table(i) for i in range(2)]
        width = max(map(len, tables))
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                    dtype=torch.int32)

        def paged(layer, q, k, v):
            cache.write(layer, k, v, slots, use_kernel=False)
            return paged_attention_ref(q, cache.key_cache(layer), cache.value_cache(layer),
                                       block_tables, cu_q, lens,
                                       compute_dtype=torch.float32).to(q.dtype)

        positions = torch.cat([torch.arange(a, int(n)) for a, n in zip(starts, lens)])
        with torch.inference_mode():
            hidden = model.hidden_states(torch.cat(new), positions, paged)
            logits = model.compute_logits(hidden[cu_q[1:].long() - 1])  # last token of each
        for b, seq in enumerate(seqs):
            assert_logits_close(logits[b], model(seq[None])[0, -1],
                                f"step {step}, sequence {b}: paged decode vs full forward")
        seqs = [torch.cat([s, row.argmax().view(1)]) for s, row in zip(seqs, logits)]
        for i, s in enumerate(seqs):
            bm.append_token(i, int(s[-1]))


# --- on a GPU ---------------------------------------------------------------------------------

def _relative_error(ours, ref) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.gpu
def test_gpu_float32_logits_and_greedy_tokens_match_transformers(tmp_path):
    hf, path = hf_checkpoint(tmp_path, initializer_range=0.2, device="cuda")
    model = load_model(path, device="cuda")
    ids = torch.randint(0, TINY["vocab_size"], (3, 17), device="cuda")
    with torch.no_grad():
        ref = hf(ids).logits
    assert_logits_close(model(ids), ref, "labkit vs transformers on the GPU")
    prompt = torch.tensor([3, 17, 42, 99, 5], device="cuda")
    with torch.no_grad():
        theirs = hf.generate(prompt[None], max_new_tokens=16, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, 5:].tolist()
    assert greedy(model, prompt, 16) == theirs


@pytest.mark.gpu
@pytest.mark.parametrize("path_name", ["contiguous", "varlen-triton"])
def test_gpu_bf16_is_within_1_percent_of_the_float32_reference(path_name):
    config = ModelConfig.tiny()
    ref_model = random_model(config, seed=0, device="cuda")
    model = random_model(config, seed=0, device="cuda", dtype=torch.bfloat16)
    lengths = [17, 1, 30]
    seqs, ids, cu = _packed(lengths, config.vocab_size)
    ids, cu = ids.cuda(), cu.cuda()
    ref = ref_model.forward_varlen(ids, cu, backend="reference")
    if path_name == "contiguous":
        ours = torch.cat([model(s.cuda()[None])[0] for s in seqs])
    else:
        assert not flash_unsupported(config, ids.device, torch.bfloat16)
        ours = model.forward_varlen(ids, cu, backend="triton")
    err = _relative_error(ours, ref)
    assert err < 1e-2, f"bf16 {path_name} logits are {err:.2%} off the float32 reference"
