"""Which option axes a call's kernels must have: options at their neutral values route
to the plain kernels (so they cannot change a bit), the rest to option kernels."""

from __future__ import annotations

from kgen.ir.params import INT_MAX
from kgen.runtime.options import Options


def needs(role, **kw):
    base = dict(n_head=4, attn_sink=0, attn_win=0, scale=None, window=None, softcap=0.0,
                sinks=None, causal=True)
    return Options.checked(**{**base, **kw}).needs(role)


def test_a_window_that_removes_no_key_needs_no_window_kernel():
    for role in ("decode", "decode_dev", "decode_paged", "prefill", "prefill_paged"):
        assert ("window", "exact") not in needs(role, window=(INT_MAX, 0))
        assert ("window", "exact") not in needs(role, window=(INT_MAX, 7), attn_sink=3)
        assert ("window", "exact") in needs(role, window=(INT_MAX - 1, 0))
        assert ("window", "exact") in needs(role, window=(5, 0))
        # FlashAttention's -1: no bound on that side (the same neutral window)
        assert ("window", "exact") not in needs(role, window=(-1, 0))
        assert ("window", "exact") not in needs(role, window=(-1, -1))
        assert ("window", "exact") in needs(role, window=(5, -1))


def test_under_a_full_mask_the_right_bound_counts():
    assert ("window", "exact") in needs("prefill", window=(INT_MAX, 0), causal=False)
    assert ("window", "exact") not in needs("prefill", window=(INT_MAX, INT_MAX),
                                            causal=False)


def test_softcap_zero_needs_no_softcap_kernel():
    assert needs("decode", softcap=0.0) == ()
    assert needs("decode", softcap=1.0) == (("softcap", "tanh"),)
