"""labkit.lessons.attention_backends.sass: the decode loop compiled for sm_90 on this machine, and the claims
notebook 06 and kernels/paged_attention.py make from it."""
import pytest

from labkit.lessons.attention_backends import sass


@pytest.fixture(scope="module")
def loops():
    return sass.decode_loops()  # compiles both caches in a child process, a few seconds


def test_the_fp8_loop_widens_every_element_once(loops):
    fp8 = loops["fp8_e4m3"]
    elements = 2 * fp8["block_n"] * fp8["head_dim"]  # a K and a V tile per iteration
    per_warp = elements // 2 // (32 * fp8["num_warps"])  # two elements per instruction
    assert fp8["opcodes"].get("F2FP.F16.E4M3.UNPACK_B") == per_warp
    assert not any(op.startswith("F2FP.F16.E4M3") for op in loops["bf16"]["opcodes"])


def test_fp8_v_is_transposed_byte_by_byte_and_bf16_by_ldmatrix(loops):
    fp8, bf16 = loops["fp8_e4m3"]["opcodes"], loops["bf16"]["opcodes"]
    assert fp8.get("LDS.U8", 0) >= 64, "fp8: V read from shared memory one byte at a time"
    assert "LDS.U8" not in bf16
    assert any(op.startswith("LDSM.16.MT88") for op in bf16), "bf16: transposing ldmatrix"


def test_per_key_fp8_costs_about_what_bf16_does(loops):
    ratio = loops["fp8_e4m3"]["instructions_per_key"] / loops["bf16"]["instructions_per_key"]
    assert 0.8 < ratio < 1.25, f"fp8/bf16 instructions per key {ratio:.2f}"
    table = sass.loop_table(loops)
    per_kb = table.loc["instructions per KB of KV"]
    assert per_kb["fp8_e4m3"] > 1.6 * per_kb["bf16"], "so per byte, fp8 issues far more"
    assert table.loc["fp8 -> f16 conversions", "bf16"] == 0


def test_the_plan_compiled_is_the_one_paged_attention_launches(loops, monkeypatch):
    from labkit.kernels import paged_attention_tiles as pa
    monkeypatch.setattr(pa, "interpreter_on", lambda: False)  # the plan a GPU gets
    consts, launch = pa.tile_plan(True, 128, 4, max_query_len=1, causal=True)
    fp8 = loops["fp8_e4m3"]
    assert (fp8["block_n"], fp8["num_warps"], fp8["num_stages"]) == \
        (consts["BLOCK_N"], launch["num_warps"], launch["num_stages"])
    assert consts["PREFETCH"] and not consts["CAUSAL"], "fp8 decode: prefetch, no causal mask"


LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IADD3 R2, R1, 0x1, RZ ;
        /*0020*/               @P0 BRA 0x0010 ;
        /*0030*/                   LDS.U8 R4, [R2] ;
        /*0040*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0050*/              @!P1 BRA 0x0030 ;
        /*0060*/                   BRA 0x0060;
        /*0070*/                   EXIT ;
"""


def test_main_loop_takes_the_largest_backward_branch():
    assert sass.main_loop(LISTING) == ["LDS.U8", "HMMA.16816.F32", "BRA"]
    assert sass.group_opcodes({"LDS.U8": 3, "HMMA.16816.F32": 2, "NOP": 1}) == {
        "tensor-core MMAs": 2, "byte loads from shared memory": 3, "other": 1}


def test_a_listing_without_a_loop_is_refused():
    with pytest.raises(ValueError, match="no loop"):
        sass.main_loop("        /*0000*/                   EXIT ;\n")
