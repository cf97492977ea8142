"""The instruction mix of a kernel's loops (kgen.toolchain.sass_listing: loops,
innermost, mix), on a small listing and on the reference's committed sm_37 SASS."""

from __future__ import annotations

from pathlib import Path

from kgen.compiler.golden import _parse_rendered
from kgen.toolchain import sass_listing as sl

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "sass"

LISTING = """Function : k
        /*0008*/ MOV R1, c[0x0][0x44];          /* 0x64c03c00089c0006 */
        /*0010*/ FFMA R2, R3, R4, R2;            /* 0x0000000000000001 */
        /*0018*/ @P0 FFMA.FTZ R5, R3, R4, R5;    /* 0x0000000000000002 */
        /*0020*/ LDS.64 R6, [R7];                /* 0x0000000000000003 */
        /*0028*/ @!P1 BRA 0x18;                  /* 0x0000000000000004 */
        /*0030*/ ISETP.GE.AND P0, PT, R5, 0x1, PT;  /* 0x0000000000000005 */
        /*0038*/ @P0 BRA CC.NEU, 0x10;           /* 0x0000000000000006 */
        /*0040*/ EXIT;                           /* 0x0000000000000007 */
        /*0048*/ BRA 0x48;                       /* 0x0000000000000008 */
"""


def test_loops_nesting_and_the_mix_of_each():
    s = sl.parse(LISTING)["k"]
    spans = sl.loops(s)
    assert spans == [(0x18, 0x28), (0x10, 0x38)]      # the self-branch padding is no loop
    assert sl.innermost(spans) == [(0x18, 0x28)]
    assert sl.mix(s, (0x18, 0x28)) == {"BRA": 1, "FFMA": 1, "LDS": 1}
    whole = sl.mix(s)
    assert whole["FFMA"] == 2 and whole["BRA"] == 3 and sum(whole.values()) == 9
    assert list(whole)[:2] == ["BRA", "FFMA"]          # most frequent first
    assert sl.opcode("@!P0 SHFL.IDX PT, R3, R4, 0x1, 0x1f;") == "SHFL"


def test_the_reference_decode_has_loops_of_ffma():
    """fc_attn_flash_decode (committed SASS): its loops hold every FFMA the kernel has
    outside straight-line code, and each innermost loop is counted once."""
    s = _parse_rendered((GOLDEN / "fc_attn_flash_decode.sass").read_text())
    spans = sl.loops(s)
    inner = sl.innermost(spans)
    assert inner and set(inner) <= set(spans)
    assert all(lo < hi for lo, hi in spans)
    in_loops = sum(sl.mix(s, sp).get("FFMA", 0) for sp in inner)
    assert 0 < in_loops <= sl.mix(s)["FFMA"]


def test_profile_is_the_kernel_then_each_loop():
    s = sl.parse(LISTING)["k"]
    parts = sl.profile(s)
    assert [p["what"] for p in parts] == ["kernel", "loop 0x0018-0x0028 (innermost)",
                                          "loop 0x0010-0x0038"]
    assert [p["instructions"] for p in parts] == [9, 3, 6]
    assert [p["ffma"] for p in parts] == [2, 1, 2]
