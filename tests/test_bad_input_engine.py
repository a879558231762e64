"""Bad input to the engine's front doors (LLM, SamplingParams, ModelConfig, checkpoints) is
refused with an error that names the parameter or the file, says what is wrong and what to
change; and a refused call leaves the engine (or the model) exactly as it was."""
import json
import shutil

import pytest
import torch

from labkit.engine import (LLM, ModelConfig, SamplingParams, load_model, random_model,
                           save_weights)
from labkit.engine.sampling import sample

TINY = ModelConfig.tiny()


@pytest.fixture(scope="module")
def llm():
    return LLM(TINY, device="cpu", num_blocks=32)


def engine_state(llm: LLM) -> tuple:
    """Everything a refused call must leave alone: ids, queues, live requests, cache blocks."""
    bm = llm.block_manager
    return (llm._next_id, dict(llm._finished), dict(llm._live),
            [r.request_id for r in llm.scheduler.waiting],
            [r.request_id for r in llm.scheduler.running],
            bm.snapshot(), llm._seeds.getstate())


def refused(llm, call, error, match):
    before = engine_state(llm)
    with pytest.raises(error, match=match):
        call()
    assert engine_state(llm) == before, "a refused call changed the engine"


# --- LLM(...): its own arguments, named as the user gave them -------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(max_num_seqs=0), "max_num_seqs must be a positive int"),
    (dict(max_num_seqs=-1), "max_num_seqs must be a positive int"),
    (dict(max_num_seqs=1.5), "max_num_seqs must be a positive int"),
    (dict(max_model_len=-5), "max_model_len must be a positive int"),
    (dict(max_model_len=0), "max_model_len must be a positive int"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be a positive int"),
    (dict(num_blocks=0), "num_blocks must be a positive int"),
    (dict(block_size=12), "block_size must be a power of two"),
    (dict(seed=-1), r"seed must be an int in \[0, 2\*\*63\)"),
    (dict(seed=1.5), r"seed must be an int in \[0, 2\*\*63\)"),
    (dict(seed=None), r"seed must be an int in \[0, 2\*\*63\)"),
    (dict(dtype=torch.int32), "dtype must be a floating-point torch dtype"),
    (dict(dtype="float64"), "dtype must be a floating-point torch dtype"),
])
def test_llm_arguments_are_checked_and_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(TINY, device="cpu", **kwargs)


def test_max_model_len_none_means_the_models_context():
    assert LLM(TINY, device="cpu", max_model_len=None).scheduler.config.max_model_len == 256


def test_a_dtype_may_be_named_by_its_string():
    llm = LLM(TINY, device="cpu", dtype="float16")
    assert llm.model.embed_tokens.dtype == torch.float16


# --- generate / add_request: prompts and params -----------------------------------------------

def test_a_dict_for_sampling_params_says_how_to_write_it(llm):
    refused(llm, lambda: llm.generate([[1, 2]], {"max_tokens": 2}), TypeError,
            r"pass SamplingParams\(max_tokens=2\)")
    refused(llm, lambda: llm.add_request([1, 2], {"max_tokens": 2}), TypeError,
            r"pass SamplingParams\(max_tokens=2\)")
    refused(llm, lambda: llm.generate([[1], [2]], [SamplingParams(), {"max_tokens": 2}]),
            TypeError, r"sampling_params\[1\] is a dict; pass SamplingParams\(max_tokens=2\)")


def test_a_params_list_of_the_wrong_length_says_both_counts(llm):
    refused(llm, lambda: llm.generate([[1], [2]], [SamplingParams()]), ValueError,
            "1 SamplingParams for 2 prompts")


def test_a_one_dimensional_tensor_of_prompts_is_one_clear_error(llm):
    refused(llm, lambda: llm.generate(torch.tensor([1, 2, 3])), TypeError,
            r"prompts is a 1-D tensor.*list of prompts")


def test_a_two_dimensional_tensor_is_a_batch_of_equal_length_prompts(llm):
    rows = llm.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), SamplingParams(max_tokens=2))
    lists = llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=2))
    assert [o.token_ids for o in rows] == [o.token_ids for o in lists]
    assert [o.prompt_token_ids for o in rows] == [[1, 2, 3], [4, 5, 6]]


@pytest.mark.parametrize("prompts, match", [
    (5, "prompts must be a list of prompts"),
    (None, "prompts must be a list of prompts"),
    ([[1, 2], 7], r"prompt 1 is a int; a prompt is a list of token ids"),
    ([[1, 2], [1, 2.0]], r"prompt 1 holds float 2.0 at position 1: token ids are ints"),
    ([[True, False]], r"prompt 0 holds bool True at position 0: token ids are ints"),
    ([[[1, 2]]], r"prompt 0 holds list \[1, 2\] at position 0"),
    ([torch.tensor([[1, 2]])], r"prompt 0 is a 2-D tensor"),
    ([torch.tensor([1.0, 2.0])], r"prompt 0 is a torch.float32 tensor"),
])
def test_prompts_of_the_wrong_type_are_refused_before_anything_is_queued(llm, prompts, match):
    refused(llm, lambda: llm.generate(prompts, SamplingParams(max_tokens=2)), TypeError, match)


def test_add_request_refuses_a_wrong_prompt_without_using_an_id(llm):
    refused(llm, lambda: llm.add_request(7), TypeError, "prompt 0 is a int")
    refused(llm, lambda: llm.add_request([[1, 2]]), TypeError, "prompt 0 holds list")


def test_prompts_may_be_any_iterable(llm):
    outs = llm.generate(iter([[1, 2], [3]]), SamplingParams(max_tokens=2))
    assert [o.prompt_token_ids for o in outs] == [[1, 2], [3]]


def test_a_stop_token_outside_the_vocabulary_is_refused(llm):
    refused(llm, lambda: llm.generate([[1]], SamplingParams(stop_token_ids=(1000,))),
            ValueError, r"stop_token_ids holds 1000, outside the vocabulary \[0, 256\)")
    refused(llm, lambda: llm.add_request([1], SamplingParams(stop_token_ids=(256,))),
            ValueError, "stop_token_ids holds 256")


def test_token_values_still_give_per_request_errors_and_the_rest_runs(llm):
    outs = llm.generate([[1, 300], [1, 2], [1] * 300], SamplingParams(max_tokens=2))
    assert [o.finish_reason for o in outs] == ["error", "length", "error"]
    assert "outside the vocabulary" in outs[0].error and "max_model_len" in outs[2].error


# --- SamplingParams -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(stop_token_ids=(-1,)), "stop_token_ids must be token ids >= 0"),
    (dict(stop_token_ids=(True,)), "stop_token_ids must be ints"),
    (dict(top_p=float("nan")), r"top_p must be in \(0, 1\]"),
])
def test_sampling_params_refuse_what_would_never_match(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
def test_a_tiny_temperature_samples_the_argmax_instead_of_failing(temperature):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    tokens = sample(logits, [SamplingParams(temperature=temperature)] * 3,
                    [torch.Generator().manual_seed(i) for i in range(3)])
    assert tokens.tolist() == logits.argmax(-1).tolist()


# --- ModelConfig ------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, error, match", [
    (dict(tie_word_embeddings="false"), TypeError, "tie_word_embeddings must be True or False"),
    (dict(rms_norm_eps="1e-6"), ValueError, "rms_norm_eps must be a finite number > 0"),
    (dict(rms_norm_eps=float("inf")), ValueError, "rms_norm_eps must be a finite number > 0"),
    (dict(rope_theta=float("inf")), ValueError, "rope_theta must be a finite number > 0"),
])
def test_model_config_fields_of_the_wrong_kind_are_refused(overrides, error, match):
    with pytest.raises(error, match=match):
        ModelConfig.tiny(**overrides)


def test_from_dict_refuses_what_is_not_a_config_object():
    with pytest.raises(TypeError, match="config must be a dict"):
        ModelConfig.from_dict([1, 2])
    with pytest.raises(ValueError, match=r"config.json lacks \['hidden_size'\]"):
        ModelConfig.from_dict({**TINY.to_dict(), "hidden_size": None})
    with pytest.raises(ValueError, match="rope_scaling must be an object"):
        ModelConfig.from_dict({**TINY.to_dict(), "rope_scaling": "linear"})


# --- checkpoints ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model = random_model(TINY, seed=1)
    save_weights(model, root / "single")
    save_weights(model, root / "sharded", max_shard_bytes=20_000)
    return root


def broken(checkpoint, tmp_path, layout, edit):
    folder = tmp_path / layout
    shutil.copytree(checkpoint / layout, folder)
    edit(folder)
    return folder


@pytest.mark.parametrize("text, match", [
    ("{not json", r"config.json is not valid JSON \(line 1 column 2"),
    ("[1, 2]", r"config.json must hold a JSON object .*, got a list"),
    ('{"hidden_size": 64}', r"config.json: config.json lacks"),
])
def test_a_broken_config_json_is_named(checkpoint, tmp_path, text, match):
    folder = broken(checkpoint, tmp_path, "single",
                    lambda f: (f / "config.json").write_text(text))
    with pytest.raises(ValueError, match=match):
        load_model(folder)


@pytest.mark.parametrize("index, match", [
    ({"metadata": {}}, r"model.safetensors.index.json has no 'weight_map'"),
    ({"weight_map": [1]}, r"'weight_map' must map tensor names to shard files"),
    ([], r"model.safetensors.index.json must hold a JSON object"),
])
def test_a_broken_index_is_named(checkpoint, tmp_path, index, match):
    folder = broken(checkpoint, tmp_path, "sharded", lambda f: (
        f / "model.safetensors.index.json").write_text(json.dumps(index)))
    with pytest.raises(ValueError, match=match):
        load_model(folder)


def test_an_index_that_is_not_json_is_named(checkpoint, tmp_path):
    folder = broken(checkpoint, tmp_path, "sharded", lambda f: (
        f / "model.safetensors.index.json").write_text("{oops"))
    with pytest.raises(ValueError, match="model.safetensors.index.json is not valid JSON"):
        load_model(folder)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_file_instead_of_the_folder_says_to_pass_the_folder(checkpoint, name):
    with pytest.raises(ValueError, match=rf"{name} is a file: pass the checkpoint folder"):
        load_model(checkpoint / "single" / name)


@pytest.mark.parametrize("cut", [0.5, 0.0])
def test_a_truncated_shard_is_named(checkpoint, tmp_path, cut):
    def truncate(folder):
        weights = folder / "model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(data[:int(len(data) * cut)])
    folder = broken(checkpoint, tmp_path, "single", truncate)
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors "
                                         r"file .*download it again"):
        load_model(folder)


def test_a_failed_load_weights_leaves_the_model_as_it_was(checkpoint, tmp_path):
    from labkit.engine import load_weights

    def truncate_last(folder):
        last = sorted(folder.glob("model-*.safetensors"))[-1]
        last.write_bytes(last.read_bytes()[:40])
    folder = broken(checkpoint, tmp_path, "sharded", truncate_last)
    model = random_model(TINY, seed=5)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_weights(model, folder)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_saving_over_a_sharded_checkpoint_leaves_no_stale_shards(tmp_path):
    old, new = random_model(TINY, seed=1), random_model(TINY, seed=2)
    save_weights(old, tmp_path, max_shard_bytes=20_000)
    save_weights(new, tmp_path)
    loaded = load_model(tmp_path)
    assert torch.equal(loaded.embed_tokens, new.embed_tokens), "loaded the old shards"


@pytest.mark.parametrize("shard, match", [(0, "max_shard_bytes must be a positive int"),
                                          (-1, "max_shard_bytes must be a positive int")])
def test_save_weights_checks_its_arguments(tmp_path, shard, match):
    with pytest.raises(ValueError, match=match):
        save_weights(random_model(TINY), tmp_path, max_shard_bytes=shard)
    with pytest.raises(TypeError, match="save_weights takes a LlamaModel, got ModelConfig"):
        save_weights(TINY, tmp_path)


def test_the_engine_writes_kv_without_the_slot_check_it_made_safe_itself(monkeypatch):
    """The runner builds slot_mapping from the block manager, so it passes check=False: the
    check's host sync would stall async scheduling (and is skipped during graph capture)."""
    from labkit.kvcache import PagedKVCache

    seen, write = [], PagedKVCache.write
    monkeypatch.setattr(PagedKVCache, "write",
                        lambda self, *a, **kw: seen.append(kw.get("check", True)) or
                        write(self, *a, **kw))
    LLM(ModelConfig.tiny(), max_model_len=64).generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert seen and not any(seen)
