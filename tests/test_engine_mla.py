"""MLA in the engine: the model equals transformers' DeepseekV3ForCausalLM, the absorbed path
over a paged latent cache equals the decompressed one, and DeepSeek configs read or refused.

Sizes are interpreter-sized (kv_lora_rank 32, rope 16); everything runs in float32 on CPU.
"""
import pytest
import torch

import labkit  # noqa: F401
from labkit.engine.config import ModelConfig
from labkit.engine.mla import MLAModel, generate_greedy

from attention_cases import cu_seqlens, fresh_seed
from mla_cases import MLA, hf_model, mla_model, tiny_mla  # noqa: F401


# --- (a) the same logits as transformers -----------------------------------------------------

@pytest.mark.parametrize("overrides", [
    dict(q_lora_rank=None), dict(q_lora_rank=24), dict(q_lora_rank=None, rope_interleave=False),
    dict(q_lora_rank=None, tie_word_embeddings=True)],
    ids=["q_proj", "q_lora", "rope_halves", "tied"])
def test_logits_equal_transformers_deepseek_v3(overrides):
    seed = fresh_seed()
    config = tiny_mla(**overrides)
    hf = hf_model(config, seed)
    ours = MLAModel(config)
    ours.load_state_dict(hf.state_dict(), strict=True)  # transformers' names, as they are
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (2, 13), generator=g)
    with torch.no_grad():
        expected = hf(ids).logits
    got = ours(ids)
    err = (got - expected).abs().max().item()
    assert err < 1e-4 * expected.abs().max().item(), f"seed {seed}: max error {err:.2e}"


# --- (b) absorbed over a paged latent cache == decompressed ----------------------------------

def scattered_tables(num_seqs: int, blocks_each: int, g: torch.Generator) -> torch.Tensor:
    """[num_seqs, blocks_each] block ids taken in random order from a pool with spares."""
    pool = torch.randperm(num_seqs * blocks_each + 5, generator=g)
    return pool[: num_seqs * blocks_each].view(num_seqs, blocks_each).int()


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_absorbed_steps_equal_the_decompressed_forward_token_by_token(q_lora_rank):
    """A mixed first step (prompts of 3, 17 and 9 tokens), then one token per sequence a step;
    the block size 8 divides none of the lengths, and the blocks are scattered."""
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    config, block_size = tiny_mla(q_lora_rank=q_lora_rank), 8
    model = mla_model(config, seed)
    totals, prompts = [11, 23, 14], [3, 17, 9]
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in totals]
    expected = [model(s[None])[0] for s in seqs]  # the decompressed logits at every position
    tables = scattered_tables(len(seqs), max(totals) // block_size + 1, g)
    cache = model.latent_cache(int(tables.max()) + 1, block_size)
    done = [0, 0, 0]
    for step in range(max(t - p for t, p in zip(totals, prompts)) + 1):
        new = [prompts[i] if step == 0 else min(1, totals[i] - done[i]) for i in range(3)]
        ids = torch.cat([seqs[i][done[i]: done[i] + new[i]] for i in range(3)])
        lens = torch.tensor([done[i] + new[i] for i in range(3)], dtype=torch.int32)
        logits = model.forward_paged(ids, cache, tables, cu_seqlens(new, "cpu"), lens)
        want = torch.cat([expected[i][done[i]: done[i] + new[i]] for i in range(3)])
        err = (logits - want).abs().max().item() if want.numel() else 0.0
        assert err < 1e-4, f"seed {seed} step {step} tokens {new}: max error {err:.2e}"
        done = [d + n for d, n in zip(done, new)]
    assert done == totals


def test_the_cache_holds_one_latent_row_per_token_in_the_blocks_of_its_table():
    seed = fresh_seed()
    config = tiny_mla()
    model = mla_model(config, seed)
    table = torch.tensor([[5, 2]], dtype=torch.int32)
    cache = model.latent_cache(6, 4)
    assert cache.shape == (2, 6, 4, 32 + 16)
    model.forward_paged(torch.arange(6), cache, table, cu_seqlens([6], "cpu"),
                        torch.tensor([6], dtype=torch.int32))
    written = cache.abs().sum(-1) != 0  # [layers, blocks, block_size]
    assert written[:, 5].all() and written[:, 2, :2].all()
    assert written.sum() == 2 * 6, "rows outside the table's first six slots were written"


# --- (c) greedy generation: the same tokens either way ---------------------------------------

def test_greedy_generation_is_identical_through_both_paths():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    model = mla_model(tiny_mla(q_lora_rank=24), seed)
    prompt = torch.randint(0, 128, (11,), generator=g).tolist()
    scattered = torch.randperm(9, generator=g)[:5].tolist()
    absorbed = generate_greedy(model, prompt, 8, block_table=scattered, block_size=4)
    decompressed = generate_greedy(model, prompt, 8, absorbed=False)
    assert absorbed == decompressed, f"seed {seed}"
    assert len(absorbed) == 8


def test_generate_refuses_a_block_table_too_short_for_the_tokens():
    model = mla_model(tiny_mla(), 0)
    with pytest.raises(ValueError, match="need 5 of 4"):
        generate_greedy(model, list(range(11)), 8, block_table=[0, 1], block_size=4)


# --- (d) DeepSeek configs: read, or refused with what to change -------------------------------

DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=64,
    intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, vocab_size=128, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=24,
    qk_rope_head_dim=16, v_head_dim=20, n_routed_experts=8, first_k_dense_replace=2,
    hidden_act="silu", rope_theta=10000.0, rope_scaling=None, rope_interleave=True,
    max_position_embeddings=256, rms_norm_eps=1e-6, torch_dtype="bfloat16")


def test_a_deepseek_v3_config_reads_as_mla():
    config = ModelConfig.from_dict(DEEPSEEK_V3)
    assert config.is_mla and not ModelConfig.tiny().is_mla
    assert (config.kv_lora_rank, config.q_lora_rank, config.qk_nope_head_dim,
            config.qk_rope_head_dim, config.v_head_dim) == (32, 24, 24, 16, 20)
    assert config.latent_size == 48 and config.qk_head_dim == 40
    assert config.rope_interleave and config.dtype == torch.bfloat16
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert ModelConfig.from_dict({**DEEPSEEK_V3, "q_lora_rank": None}).q_lora_rank is None
    assert "kv_lora_rank" not in ModelConfig.tiny().to_dict()  # a Llama config.json as before


def test_num_parameters_counts_the_mla_projections():
    config = tiny_mla(q_lora_rank=24)
    hf = hf_model(config, 0)
    assert config.num_parameters() == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("change", [
    dict(first_k_dense_replace=1), dict(first_k_dense_replace=None),
    {"first_k_dense_replace": 0, "model_type": "deepseek_v2"}])
def test_a_mixture_of_experts_config_is_refused_saying_what_to_set(change):
    values = {k: v for k, v in {**DEEPSEEK_V3, **change}.items() if v is not None}
    values["num_hidden_layers"] = 4  # deepseek_v3 without the field: dense below layer 3
    with pytest.raises(ValueError, match="dense MLP layers only.*first_k_dense_replace to "
                                         r"num_hidden_layers \(4\)"):
        ModelConfig.from_dict(values)


def test_deepseek_yarn_rope_scaling_is_refused():
    yarn = dict(type="yarn", factor=40, mscale=1.0, mscale_all_dim=1.0,
                original_max_position_embeddings=4096)
    with pytest.raises(ValueError, match="'yarn' RoPE scaling.*plain RoPE only"):
        ModelConfig.from_dict({**DEEPSEEK_V3, "rope_scaling": yarn})


@pytest.mark.parametrize("change,words", [
    (dict(kv_lora_rank=None), r"together.*without \['kv_lora_rank'\]"),
    (dict(v_head_dim=0), "v_head_dim must be a positive int"),
    (dict(q_lora_rank=-3), "q_lora_rank must be a positive int"),
    (dict(qk_rope_head_dim=15), "qk_rope_head_dim must be even"),
    (dict(qk_nope_head_dim=2.5), "qk_nope_head_dim must be a positive int"),
])
def test_bad_mla_fields_are_refused_naming_the_parameter(change, words):
    with pytest.raises(ValueError, match=words):
        ModelConfig.tiny(**{**MLA, **change})


def test_mla_only_fields_on_a_llama_config_are_refused():
    with pytest.raises(ValueError, match="q_lora_rank=8 is for multi-head latent attention"):
        ModelConfig.tiny(q_lora_rank=8)
    with pytest.raises(ValueError, match="MLAModel needs a multi-head latent attention"):
        MLAModel(ModelConfig.tiny())


def test_the_llama_model_refuses_an_mla_config_instead_of_computing_gqa_from_it():
    from labkit.engine.model import LlamaModel

    config = ModelConfig.from_dict(DEEPSEEK_V3)
    with pytest.raises(ValueError, match="MLAModel"):
        LlamaModel(config)


# --- loading a checkpoint ---------------------------------------------------------------------

def test_a_saved_transformers_checkpoint_loads_and_gives_its_logits(tmp_path):
    from labkit.engine.weights import load_mla_model

    seed = fresh_seed()
    config = tiny_mla()
    hf = hf_model(config, seed)
    hf.save_pretrained(tmp_path)  # config.json + model.safetensors, as published
    ours = load_mla_model(tmp_path)
    assert ours.config.is_mla and ours.config.kv_lora_rank == config.kv_lora_rank
    ids = torch.randint(0, config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
    err = (ours(ids) - expected).abs().max().item()
    assert err < 1e-4 * expected.abs().max().item(), f"seed {seed}: max error {err:.2e}"


def test_a_checkpoint_that_does_not_fit_names_every_tensor_at_fault(tmp_path):
    from safetensors.torch import load_file, save_file

    from labkit.engine.weights import load_mla_model

    hf_model(tiny_mla(), 0).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.self_attn.kv_b_proj.weight"]
    tensors["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(3, 3)
    tensors["model.layers.0.mlp.experts.0.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as e:
        load_mla_model(tmp_path)
    for words in ("missing: model.layers.0.self_attn.kv_b_proj.weight",
                  "unexpected: model.layers.0.mlp.experts.0.weight",
                  "model.layers.1.self_attn.o_proj.weight: checkpoint [3, 3]"):
        assert words in str(e.value)
