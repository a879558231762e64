"""The fused small ops of a decoder layer against the model's eager arithmetic.

Under Triton's interpreter on CPU (float32, float16); on a GPU in bf16 (``gpu``). The fused
path must give the eager path's logits and greedy tokens, so an engine can switch it on.
"""
import random

import pytest
import torch

import labkit  # noqa: F401  (interpreter before triton)
from labkit.engine import LLM, ModelConfig, SamplingParams, random_model
from labkit.engine.model import rope_inv_freq
from labkit.kernels.layer_ops import (add_rms_norm, add_rms_norm_ref, rope_, rope_ref,
                                      silu_mul, silu_mul_ref)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def fresh_seed():
    return random.randrange(2**31)


def close(a, b, dtype, what):
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    scale = max(b.double().abs().max().item(), 1.0) if b.numel() else 1.0
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.2e} (scale {scale:.2f})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens, hidden", [(7, 64), (1, 96), (0, 64), (5, 200)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_the_eager_norm(dtype, tokens, hidden, with_residual):
    g = torch.Generator().manual_seed(seed := fresh_seed())
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    r = torch.randn(tokens, hidden, generator=g).to(dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    (out, res), (ref, ref_res) = add_rms_norm(x, r, w, 1e-6), add_rms_norm_ref(x, r, w, 1e-6)
    close(out, ref, dtype, f"seed {seed}: normed")
    close(res, ref_res, dtype, f"seed {seed}: residual")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens, heads, head_dim", [(5, (4, 2), 16), (1, (2, 2), 64),
                                                     (0, (4, 1), 32), (3, (8, 1), 64)])
def test_rope_in_place_matches_the_eager_rotation(dtype, tokens, heads, head_dim):
    g = torch.Generator().manual_seed(seed := fresh_seed())
    hq, hkv = heads
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    inv_freq = rope_inv_freq(head_dim, 10000.0)
    expected = rope_ref(qkv, positions, inv_freq, hq, hkv)
    got = rope_(qkv.clone(), positions, inv_freq, hq, hkv)
    close(got, expected, dtype, f"seed {seed}: rotated qkv")
    v = slice((hq + hkv) * head_dim, None)
    assert torch.equal(got[:, v], qkv[:, v]), "v must be left untouched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens, inter", [(4, 128), (1, 1500), (0, 64)])
def test_silu_mul_matches_the_eager_activation(dtype, tokens, inter):
    g = torch.Generator().manual_seed(seed := fresh_seed())
    gate_up = (3 * torch.randn(tokens, 2 * inter, generator=g)).to(dtype)
    close(silu_mul(gate_up), silu_mul_ref(gate_up), dtype, f"seed {seed}: silu(gate) * up")


def test_bad_shapes_are_refused_with_the_expected_layout():
    with pytest.raises(ValueError, match=r"\(Hq \+ 2 Hkv\) \* D"):
        rope_(torch.zeros(2, 10), torch.zeros(2, dtype=torch.long), rope_inv_freq(4, 1e4), 1, 1)
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(torch.zeros(2, 8), None, torch.ones(4), 1e-6)


def test_the_fused_model_gives_the_eager_logits():
    seed = fresh_seed()
    model = random_model(ModelConfig.tiny(), seed=seed, dtype=torch.float32)
    fused = random_model(ModelConfig.tiny(), seed=seed, dtype=torch.float32, fused_ops=True)
    ids = torch.randint(0, model.config.vocab_size, (3, 11))
    eager = model(ids)
    close(fused(ids), eager, torch.float32, "logits")


def test_fused_ops_are_off_by_default_on_cpu_where_triton_is_interpreted():
    assert not LLM(ModelConfig.tiny(), device="cpu", dtype=torch.float32).model.fused_ops


def test_an_engine_with_fused_ops_generates_the_same_tokens():
    prompts = [[random.randrange(256) for _ in range(n)] for n in (5, 17, 1, 30)]
    params = SamplingParams(max_tokens=6)
    plain = LLM(ModelConfig.tiny(), device="cpu", dtype=torch.float32).generate(prompts, params)
    fused = LLM(ModelConfig.tiny(), device="cpu", dtype=torch.float32, fused_ops=True)
    assert fused.model.fused_ops
    assert [o.token_ids for o in fused.generate(prompts, params)] == \
        [o.token_ids for o in plain]


@pytest.mark.gpu
def test_gpu_fused_ops_bf16_and_graphs():
    for dtype in (torch.bfloat16,):
        g = torch.Generator().manual_seed(seed := fresh_seed())
        x = torch.randn(33, 2048, generator=g).to("cuda", dtype)
        r = torch.randn(33, 2048, generator=g).to("cuda", dtype)
        w = torch.randn(2048, generator=g).to("cuda", dtype)
        (out, res), (ref, ref_res) = add_rms_norm(x, r, w, 1e-5), add_rms_norm_ref(x, r, w, 1e-5)
        close(out, ref, dtype, f"seed {seed}: normed")
        qkv = torch.randn(33, 48 * 64, generator=g).to("cuda", dtype)
        pos = torch.randint(0, 4096, (33,), generator=g).cuda()
        inv = rope_inv_freq(64, 5e5, "cuda")
        close(rope_(qkv.clone(), pos, inv, 32, 8), rope_ref(qkv, pos, inv, 32, 8), dtype, "rope")
        gu = torch.randn(33, 2 * 8192, generator=g).to("cuda", dtype)
        close(silu_mul(gu), silu_mul_ref(gu), dtype, "silu_mul")
    prompts = [[random.randrange(256) for _ in range(n)] for n in (5, 17, 1, 30, 9, 3, 40)]
    params = SamplingParams(max_tokens=12)
    cfg = ModelConfig.tiny(torch_dtype="float32")
    plain = LLM(cfg, device="cuda", fused_ops=False).generate(prompts, params)
    fused = LLM(cfg, device="cuda")
    assert fused.model.fused_ops, "on CUDA the fused ops are the default"
    assert [o.token_ids for o in fused.generate(prompts, params)] == \
        [o.token_ids for o in plain]
    assert fused.stats.num_graph_steps > 0
    eager = LLM(cfg, device="cuda", enforce_eager=True)
    assert eager.model.fused_ops, "eager steps launch the same fused kernels the graphs replay"
    assert [o.token_ids for o in eager.generate(prompts, params)] == \
        [o.token_ids for o in plain]
