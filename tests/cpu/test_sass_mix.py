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


# An sm_70+ listing's tail: after the kernel's last EXIT, out-of-line code (a JIT's path for
# a shuffle in a diverged warp) that branches back into the body.
TAIL = """Function : j
        /*0000*/ MOV R1, c[0x0][0x28] ;           /* 0x00000a0000017a02 */
                                                  /* 0x000fe40000000f00 */
        /*0010*/ FFMA R2, R3, R4, R2 ;            /* 0x0000000000000001 */
                                                  /* 0x0000000000000000 */
        /*0020*/ @P0 BRA 0x70 ;                   /* 0x0000000000000002 */
                                                  /* 0x0000000000000000 */
        /*0030*/ SHFL.BFLY PT, R5, R2, 0x1, 0x1f ; /* 0x0000000000000003 */
                                                  /* 0x0000000000000000 */
        /*0040*/ @!P1 BRA 0x10 ;                  /* 0x0000000000000004 */
                                                  /* 0x0000000000000000 */
        /*0050*/ @P2 EXIT ;                       /* 0x0000000000000005 */
                                                  /* 0x0000000000000000 */
        /*0060*/ EXIT ;                           /* 0x0000000000000006 */
                                                  /* 0x0000000000000000 */
        /*0070*/ SHFL.BFLY P6, R5, R2, R7, R8 ;   /* 0x0000000000000007 */
                                                  /* 0x0000000000000000 */
        /*0080*/ BRA 0x40 ;                       /* 0x0000000000000008 */
                                                  /* 0x0000000000000000 */
        /*0090*/ BRA 0x90 ;                       /* 0x0000000000000009 */
                                                  /* 0x0000000000000000 */
"""


def test_a_branch_back_from_past_the_last_exit_is_no_loop():
    """The out-of-line tail returns into the body: no loop of its own (else it would
    overlap the body's loop and be listed as a second innermost one); the body's loop
    stays, a predicated EXIT inside the body is no end, and the mix still counts every
    instruction (the upper words of an sm_70+ encoding are no instructions)."""
    s = sl.parse(TAIL)["j"]
    assert sl.loops(s) == [(0x10, 0x40)]
    assert sl.innermost(sl.loops(s)) == [(0x10, 0x40)]
    assert sum(sl.mix(s).values()) == 10 and sl.mix(s)["SHFL"] == 2


# An sm_5x/sm_6x listing: dual-issue pairs in braces, the second one's encoding on the
# line after it (where an unpaired instruction has its control word).
PAIRS = """Function : p
        /*0008*/                   MOV R1, c[0x0][0x20] ;         /* 0x4c98078000870001 */
        /*0010*/         {         MOV R51, c[0x0][0x174] ;       /* 0x4c98078005d70033 */
                                                                  /* 0x001fc000e6c007f0 */
        /*0018*/                   S2R R3, SR_CTAID.Y         }
                                                                  /* 0xf0c8000002670003 */
        /*0028*/         {         FFMA R0, R51, R3, R0 ;         /* 0x5980000000370000 */
        /*0030*/               @P0 BRA 0x10         }
                                                                  /* 0xe24000000000000f */
        /*0038*/                   EXIT ;                         /* 0xe30000000007000f */
"""


def test_dual_issue_pairs_are_two_instructions_each():
    """Braces are no opcode, and a pair's second instruction is counted with its own
    encoding (the line after it), not taken for a control word."""
    s = sl.parse(PAIRS)["p"]
    words = [(i.addr, i.text, i.encoding) for i in s]
    assert (0x18, "S2R R3, SR_CTAID.Y ;", "0xf0c8000002670003") in words
    assert (0x10, "MOV R51, c[0x0][0x174] ;", "0x4c98078005d70033") in words
    assert [i.encoding for i in s if i.addr is None] == ["0x001fc000e6c007f0"]
    assert sl.mix(s) == {"MOV": 2, "BRA": 1, "EXIT": 1, "FFMA": 1, "S2R": 1}
    assert sl.loops(s) == [(0x10, 0x30)]
