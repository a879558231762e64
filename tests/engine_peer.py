"""The peer the engine tests check against: a tiny Llama built by transformers at a wide random
init (0.2, so logits spread out and no argmax is a near-tie that rounding could flip), saved with
``save_pretrained`` for the LLM to load, and transformers' own greedy tokens for each prompt."""
import pytest
import torch
import transformers  # a test dependency: the peer the engine is checked against

from labkit.engine import SamplingParams

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
            rope_theta=10000.0, rms_norm_eps=1e-6)
LENGTHS = [5, 17, 1, 33, 12]   # not multiples of the block, one token, more than two blocks
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS)


def make_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in lengths]


PROMPTS = make_prompts(LENGTHS)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(transformers model, checkpoint folder) at a wide random init."""
    path = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **TINY, initializer_range=0.2)).eval()
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


def hf_greedy(hf, prompt, max_new_tokens=MAX_TOKENS, device="cpu"):
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def expected(hf_model):
    """transformers' greedy tokens for each of PROMPTS, generated one prompt at a time."""
    hf, _ = hf_model
    return [hf_greedy(hf, p) for p in PROMPTS]


def assert_same_tokens(outputs, expected, what):
    for i, (out, want) in enumerate(zip(outputs, expected)):
        assert out.error is None, f"{what}: prompt {i} failed: {out.error}"
        assert out.token_ids == want, (
            f"{what}: prompt {i} (length {len(out.prompt_token_ids)}) diverges from "
            f"transformers:\n  engine       {out.token_ids}\n  transformers {want}")
