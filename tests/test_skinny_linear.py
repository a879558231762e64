"""skinny_linear (a decode step's matmuls, norm and SiLU folded in) against the eager sequence.

Under Triton's interpreter on CPU in float32; on a GPU in bf16 and inside the engine (``gpu``).
"""
import random

import pytest
import torch

import labkit  # noqa: F401  (interpreter before triton)
from labkit.engine import LLM, ModelConfig, SamplingParams, random_model
from labkit.engine.model import FusedOps, skinny_matmuls
from labkit.kernels.skinny_linear import MAX_ROWS, skinny_linear, skinny_linear_ref

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def fresh_seed():
    return random.randrange(2**31)


def close(a, b, dtype, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    scale = max(b.double().abs().max().item(), 1.0) if b.numel() else 1.0
    assert err <= TOL[dtype] * scale, f"{what}: max error {err:.2e} (scale {scale:.2f})"


def rows_of_each_call(monkeypatch, module, name: str) -> list[int]:
    """Wrap ``module.name`` (a function of a [rows, ...] tensor first) so each call appends its
    row count to the returned list, then runs it."""
    rows, real = [], getattr(module, name)

    def counted(x, *a, **kw):
        rows.append(x.shape[0])
        return real(x, *a, **kw)
    monkeypatch.setattr(module, name, counted)
    return rows


def case(rows, n, k, *, norm, residual, gated, dtype=torch.float32, device="cpu", g=None):
    x = torch.randn(rows, k, generator=g).to(device, dtype)
    w = (torch.randn((2 if gated else 1) * n, k, generator=g) / k ** 0.5).to(device, dtype)
    r = torch.randn(rows, k, generator=g).to(device, dtype) if residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype) if norm else None
    return x, w, dict(residual=r, norm_weight=nw, eps=1e-5, gated=gated)


@pytest.mark.parametrize("rows, n, k", [(1, 48, 64), (16, 33, 17), (5, 16, 600), (3, 70, 1),
                                        (0, 32, 64), (2, 0, 32)])
@pytest.mark.parametrize("norm, residual, gated", [(False, False, False), (True, False, False),
                                                   (True, True, False), (True, True, True),
                                                   (False, False, True)])
def test_matches_the_eager_sequence(rows, n, k, norm, residual, gated):
    g = torch.Generator().manual_seed(seed := fresh_seed())
    x, w, kw = case(rows, n, k, norm=norm, residual=residual, gated=gated, g=g)
    (out, res), (ref, ref_res) = skinny_linear(x, w, **kw), skinny_linear_ref(x, w, **kw)
    close(out, ref, torch.float32, f"seed {seed}: out")
    if norm:
        close(res, ref_res, torch.float32, f"seed {seed}: new residual")
        if residual and rows:
            assert res.data_ptr() not in (x.data_ptr(), kw["residual"].data_ptr())
    else:
        assert res is None


def test_one_long_row_takes_its_own_tile_and_stays_exact():
    """down_proj's long rows (K >= LONG_K) run one output feature a program in wider K steps;
    the answer is the eager sequence's, with K off the step (LONG_K + 5) and on it."""
    from labkit.kernels.skinny_linear import LONG_K, LONG_ROWS, default_tile
    assert default_tile(True, LONG_K) == default_tile(True, 64) | LONG_ROWS
    assert default_tile(True, LONG_K - 1)["block_n"] != LONG_ROWS["block_n"]
    assert default_tile(False, LONG_K)["block_n"] >= 16, "many rows keep the tl.dot tile"
    g = torch.Generator().manual_seed(seed := fresh_seed())
    for k in (LONG_K, LONG_K + 5):
        x, w, kw = case(1, 3, k, norm=False, residual=False, gated=False, g=g)
        close(skinny_linear(x, w, **kw)[0], skinny_linear_ref(x, w, **kw)[0], torch.float32,
              f"seed {seed}: K {k}")


def test_one_row_in_one_chunk_or_in_several_gives_the_eager_answer():
    """A row that fits one K step is read once for the norm and the multiply-adds; a longer one
    in steps. Both give the eager sequence's output and new residual, K on and off the step."""
    g = torch.Generator().manual_seed(seed := fresh_seed())
    for k, block_k in ((64, None), (64, 64), (70, 16), (70, 128)):
        x, w, kw = case(1, 10, k, norm=True, residual=True, gated=True, g=g)
        got, res = skinny_linear(x, w, block_k=block_k, **kw)
        want, want_res = skinny_linear_ref(x, w, **kw)
        close(got, want, torch.float32, f"seed {seed}: K {k} block_k {block_k}")
        close(res, want_res, torch.float32, f"seed {seed}: K {k} block_k {block_k} residual")


def test_random_shapes_and_tiles():
    rng = random.Random(seed := fresh_seed())
    g = torch.Generator().manual_seed(seed)
    for _ in range(10):
        rows = rng.choice([1, 1, rng.randint(2, MAX_ROWS)])
        n, k = rng.randint(1, 90), rng.randint(1, 700)
        flags = dict(norm=rng.random() < 0.7, gated=rng.random() < 0.5)
        flags["residual"] = flags["norm"] and rng.random() < 0.7
        x, w, kw = case(rows, n, k, g=g, **flags)
        gemv = rng.random() < 0.5  # one row: the multiply-add kernel, or the tensor-core tile
        block_n = rng.choice([4, 8, 16, 32] if rows == 1 and gemv else [16, 32, 64])
        block_k = rng.choice([None, 16, 64])
        got = skinny_linear(x, w, block_n=block_n, gemv=gemv, block_k=block_k, **kw)[0]
        close(got, skinny_linear_ref(x, w, **kw)[0], torch.float32,
              f"seed {seed}: rows {rows} n {n} k {k} {flags} block_n {block_n} gemv {gemv}")


def test_bad_input_names_the_parameter():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="MAX_ROWS=16"):
        skinny_linear(torch.randn(17, 8), w)
    with pytest.raises(ValueError, match="K=8"):
        skinny_linear(x, torch.randn(4, 9))
    with pytest.raises(ValueError, match="gated=True wants weight"):
        skinny_linear(x, torch.randn(5, 8), gated=True)
    with pytest.raises(ValueError, match="pass norm_weight"):
        skinny_linear(x, w, residual=x)
    with pytest.raises(ValueError, match="norm_weight must be"):
        skinny_linear(x, w, norm_weight=torch.ones(7))
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        skinny_linear(x, w, block_n=24)
    with pytest.raises(ValueError, match="one dtype"):
        skinny_linear(x, w.double())
    with pytest.raises(ValueError, match="contiguous rows"):
        skinny_linear(torch.randn(8, 2).t(), w)


def test_the_fused_model_uses_it_for_small_steps_only(monkeypatch):
    """By default one-row steps (batch-1 decode) run skinny_linear, four calls a layer; with
    skinny_matmuls(True) steps of up to MAX_ROWS rows do, with skinny_matmuls(False) none, and
    the default comes back after each block. A prompt's rows run cuBLAS. The tokens are the
    same every way."""
    import labkit.engine.model as model_module
    calls = rows_of_each_call(monkeypatch, model_module, "skinny_linear")
    cfg = ModelConfig.tiny()
    prompts = [[random.randrange(256) for _ in range(n)] for n in (20, 3)]
    params = SamplingParams(max_tokens=4)

    def run(batch):
        llm = LLM(cfg, device="cpu", dtype=torch.float32, fused_ops=True)
        return [o.token_ids for o in llm.generate(batch, params)]
    with skinny_matmuls(False):
        off, off_one = run(prompts), run(prompts[:1])
    assert calls == [] and FusedOps.skinny_rows == 1
    assert run(prompts) == off and calls == [], "two rows a decode step: cuBLAS by default"
    assert run(prompts[:1]) == off_one and set(calls) == {1}, "one row: the GEMV by default"
    assert len(calls) % (4 * cfg.num_hidden_layers) == 0
    calls.clear()
    with skinny_matmuls(True):
        assert FusedOps.skinny_rows == MAX_ROWS
        on = run(prompts)
    assert FusedOps.skinny_rows == 1
    assert on == off and calls and max(calls) <= MAX_ROWS and 2 in calls
    assert len(calls) % (4 * cfg.num_hidden_layers) == 0


@pytest.mark.gpu
def test_gpu_bf16_and_the_engine():
    g = torch.Generator().manual_seed(seed := fresh_seed())
    for rows in (1, 7, 16):
        for n, k, gated in ((3072, 2048, False), (8192, 2048, True), (2048, 8192, False),
                            (1000, 300, False)):
            norm = k != 8192  # down_proj's input has no norm before it
            x, w, kw = case(rows, n, k, norm=norm, residual=norm and rows > 1, gated=gated,
                            dtype=torch.bfloat16, device="cuda", g=g)
            (out, res), (ref, ref_res) = skinny_linear(x, w, **kw), skinny_linear_ref(x, w, **kw)
            close(out, ref, torch.bfloat16, f"seed {seed}: rows {rows} n {n} k {k}")
            if kw["norm_weight"] is not None:
                close(res, ref_res, torch.bfloat16, f"seed {seed}: residual")
    # float32 on a GPU: tl.dot must not drop to TF32, or greedy tokens would differ from cuBLAS
    x, w, kw = case(4, 96, 640, norm=True, residual=True, gated=False, device="cuda", g=g)
    close(skinny_linear(x, w, **kw)[0], skinny_linear_ref(x, w, **kw)[0], torch.float32,
          "float32 on a GPU")
    prompts = [[random.randrange(256) for _ in range(n)] for n in (5, 17, 1, 30, 9)]
    params = SamplingParams(max_tokens=10)
    cfg = ModelConfig.tiny(torch_dtype="float32")
    plain = LLM(cfg, device="cuda", fused_ops=False).generate(prompts, params)
    with skinny_matmuls(True):  # the decode graphs capture it
        with_skinny = LLM(cfg, device="cuda", fused_ops=True).generate(prompts, params)
    assert [o.token_ids for o in with_skinny] == [o.token_ids for o in plain]


@pytest.mark.gpu
def test_gpu_a_chain_of_pdl_launches_reads_each_kernels_output_eager_and_replayed():
    """Each one-row GEMV launches before the kernel ahead of it ends (programmatic dependent
    launch) and loads its first weight chunk before waiting; it must still read the x that the
    kernel ahead wrote. A chain of norm'd, gated and plain projections, each fed the last one's
    output, eager and replayed from a CUDA Graph, against the eager sequence."""
    from labkit.graphs import capture_graph
    from labkit.kernels.pdl import pdl_supported
    from labkit.kernels.skinny_linear import DEFAULT
    if not pdl_supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90 or newer")
    assert DEFAULT[True]["pdl"], "one-row steps launch as programmatic dependents on Hopper"
    g = torch.Generator().manual_seed(seed := fresh_seed())
    dt, dev = torch.bfloat16, "cuda"
    x0 = torch.randn(1, 2048, generator=g).to(dev, dt)
    res0 = torch.randn(1, 2048, generator=g).to(dev, dt)
    nw = (1 + 0.1 * torch.randn(2048, generator=g)).to(dev, dt)
    weights = [(torch.randn(2 * 4096, 2048, generator=g) / 45).to(dev, dt),
               (torch.randn(2048, 4096, generator=g) / 64).to(dev, dt)] * 4

    def chain(fn, **kw):
        x, res = x0, res0
        for i in range(0, len(weights), 2):
            h, res = fn(x, weights[i], residual=res, norm_weight=nw, eps=1e-5, gated=True, **kw)
            x = fn(h, weights[i + 1], **kw)[0]
        return x, res
    ref = chain(skinny_linear_ref)
    eager = chain(skinny_linear)
    graph, replayed = capture_graph(lambda: chain(skinny_linear))
    x0.copy_(torch.randn(1, 2048, generator=g).to(dev, dt))  # the replay must read the new x
    graph.replay()
    new_ref = chain(skinny_linear_ref)
    for got, want, what in ((eager, ref, "eager"), (replayed, new_ref, "replayed")):
        close(got[0], want[0], dt, f"seed {seed}: {what} output")
        close(got[1], want[1], dt, f"seed {seed}: {what} residual")


def rope_case(rows, hq, hkv, d, k, g):
    from labkit.engine.model import rope_inv_freq
    x, w, kw = case(rows, (hq + 2 * hkv) * d, k, norm=True, residual=True, gated=False, g=g)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    return x, w, kw, (positions, rope_inv_freq(d, 10000.0), hq, hkv)


@pytest.mark.parametrize("rows", [1, 3])
def test_rope_folded_into_the_qkv_gemv_rotates_as_rope_does(rows):
    """rope=: one row rotates q and k inside the GEMV (a program per rotation pair), more rows
    run rope_ after the matmul; either way the result is skinny_linear then rope_, bit for bit
    in float32, with v untouched and the residual as without rope."""
    from labkit.kernels.layer_ops import rope_
    rng = random.Random(seed := fresh_seed())
    g = torch.Generator().manual_seed(seed)
    for hq, hkv, d in ((4, 2, 16), (3, 1, 8), (2, 2, 32), (1, 1, 2)):
        x, w, kw, rope = rope_case(rows, hq, hkv, d, rng.randint(1, 90), g)
        (got, res), (plain, plain_res) = skinny_linear(x, w, rope=rope, **kw), \
            skinny_linear(x, w, **kw)
        want = rope_(plain.clone(), *rope)
        assert torch.equal(got, want), f"seed {seed}: Hq {hq} Hkv {hkv} D {d}"
        assert torch.equal(res, plain_res)
        v = (hq + hkv) * d
        assert torch.equal(got[:, v:], plain[:, v:]), "v is not rotated"
        assert not torch.equal(got[:, :v], plain[:, :v]), "q and k are"


def test_rope_needs_a_qkv_weight_and_one_position_a_row():
    g = torch.Generator().manual_seed(0)
    x, w, kw, rope = rope_case(1, 2, 1, 8, 16, g)
    with pytest.raises(ValueError, match="got 31"):
        skinny_linear(x, w[:31], rope=rope, **kw)
    with pytest.raises(ValueError, match=r"positions must be \[rows=1\]"):
        skinny_linear(x, w, rope=(torch.tensor([1, 2]), *rope[1:]), **kw)
    with pytest.raises(ValueError, match="not gated=True"):
        skinny_linear(x, torch.cat([w, w]), rope=rope, **(kw | {"gated": True}))


def test_the_engine_can_fold_rope_into_its_qkv_gemv_with_the_same_tokens(monkeypatch):
    """FusedOps.rope_in_gemv (the default): one-token steps rotate inside the q/k/v GEMV (no
    rope_ launch); the greedy tokens are those of the separate kernels."""
    from labkit.kernels import layer_ops
    assert FusedOps.rope_in_gemv, "on by default"
    monkeypatch.setattr(FusedOps, "rope_in_gemv", False)
    cfg = ModelConfig.tiny()
    prompts = [[random.randrange(256) for _ in range(n)] for n in (20,)]
    params = SamplingParams(max_tokens=5)
    rope_rows = rows_of_each_call(monkeypatch, layer_ops, "rope_")

    def run():
        llm = LLM(cfg, device="cpu", dtype=torch.float32, fused_ops=True)
        return [o.token_ids for o in llm.generate(prompts, params)]
    separate = run()
    assert 1 in rope_rows, "one-token steps ran rope_ on their own"
    model = random_model(cfg, seed=0, dtype=torch.float32)
    layer, x = model.layers[0], torch.randn(1, cfg.hidden_size)
    rotary = FusedOps.rotary(torch.tensor([11]), model.inv_freq)
    apart = layer.before_attention(x, None, rotary, FusedOps)
    rope_rows.clear()
    monkeypatch.setattr(FusedOps, "rope_in_gemv", True)
    folded = layer.before_attention(x, None, rotary, FusedOps)
    assert all(torch.equal(a, b) for a, b in zip(apart, folded)), "q, k, v and the residual"
    assert run() == separate
    assert rope_rows and 1 not in rope_rows, f"one-token steps rotate in the GEMV: {rope_rows}"


@pytest.mark.gpu
def test_gpu_rope_folded_into_the_qkv_gemv_at_llama_widths():
    """bf16 on the GPU, bench_1b's q/k/v (32 q heads, 8 kv heads, head_dim 64, K 2,048), the
    GEMV launched as a programmatic dependent: the same as the matmul then rope_."""
    from labkit.kernels.layer_ops import rope_
    g = torch.Generator().manual_seed(seed := fresh_seed())
    x, w, kw, rope = rope_case(1, 32, 8, 64, 2048, g)
    x, w = x.cuda().bfloat16(), w.cuda().bfloat16()
    kw = {k: (v.cuda().bfloat16() if torch.is_tensor(v) else v) for k, v in kw.items()}
    rope = (rope[0].cuda(), rope[1].cuda(), *rope[2:])
    got = skinny_linear(x, w, rope=rope, **kw)[0]
    want = rope_(skinny_linear(x, w, **kw)[0], *rope)
    close(got, want, torch.bfloat16, f"seed {seed}")
