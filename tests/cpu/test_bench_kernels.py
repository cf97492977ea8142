"""`make bench-kernels` off the GPU: the report's bars and the copy timed with the arms.
prefill_long's ratio is to torch SDPA's math path (the SIMT f32 peer), never to the
tensor-core arm torch picks by default; a decode's roofline comes from the copy timed in
the same interleaved rounds as its arms."""

from __future__ import annotations

import re

import pytest

from kgen.bench import kernels


def _long_rows(ms: dict[str, float]) -> list[dict]:
    peers = {n for n in ms if n.startswith("torch SDPA")}
    return [{"kv": "f32", "head_dim": 128, "n_head": 32, "n_kv": 8, "kernel": n, "ms": t,
             "TFLOPs": 1.0, "of_sgemm": 0.5, "peer": n in peers, "sgemm": n == kernels.SGEMM_ARM,
             "best_kgen": n == "qs_f32_causal"} for n, t in ms.items()]


def test_prefill_long_ratio_is_to_the_simt_peer_not_the_tensor_core_arm(tmp_path, capsys):
    ms = {"qs_f32_causal": 20.0,
          "torch SDPA f32 efficient_attention (tensor-core)": 10.0,
          f"torch SDPA f32 math {kernels.SIMT_LABEL}": 50.0,
          kernels.SGEMM_ARM: 20.0}
    kernels.report({"device": "test", "prefill_long": _long_rows(ms)}, tmp_path)
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "qs_f32_causal " in ln)
    assert re.search(r"2\.50x vs SDPA math", line), line          # 50 / 20, not 10 / 20
    tensor = next(ln for ln in out.splitlines() if "tensor-core" in ln)
    assert "5.00x vs SDPA math" in tensor
    sgemm = next(ln for ln in out.splitlines() if kernels.SGEMM_ARM in ln)
    assert "vs SDPA" not in sgemm
    assert (tmp_path / "kernels.json").is_file()


def test_prefill_long_without_the_simt_peer_prints_no_ratio(tmp_path, capsys):
    ms = {"qs_f32_causal": 20.0, "torch SDPA f32 efficient_attention (tensor-core)": 10.0}
    kernels.report({"device": "test", "prefill_long": _long_rows(ms)}, tmp_path)
    assert "vs SDPA" not in capsys.readouterr().out


def test_the_copy_is_timed_in_the_arms_rounds(monkeypatch):
    seen = {}

    def fake_bench(cp, arms):
        seen.update(arms)
        return {n: (0.25 if n == kernels.COPY_ARM else 0.01) for n in arms}

    monkeypatch.setattr(kernels, "bench", fake_bench)
    arms = {"a": lambda: None, "b": lambda: None}
    copy = (lambda: None, 1_000_000_000)          # 1 GB moved a call
    t, gbps = kernels._with_copy(None, arms, copy)
    assert set(seen) == {"a", "b", kernels.COPY_ARM}  # one bench call: the same rounds
    assert set(t) == {"a", "b"}                       # the copy is not an arm of the table
    assert gbps == pytest.approx(4000.0)              # 1 GB in 0.25 ms


def test_decode_goals_report_prints_each_rows_copy(tmp_path, capsys):
    lim = {"arm": "limits", "copy_GBps": 3000.0, "sgemm_TFLOPs": 50.0, "sms": 132}
    row = {"kv": "f16", "head_dim": 128, "n_head": 32, "n_kv": 8, "seq": 32768,
           "arm": "dq_f16_d128_g4_host kps 32 cap 66 (64 splits) [default]",
           "kernel": "dq_f16_d128_g4_host", "stream": True, "splits": 64, "us": 44.0,
           "blocks_per_sm": 4, "roofline_us": 34.0, "of_roofline": 34.0 / 44.0,
           "copy_GBps": 3950.0, "default": True, "best": True, "vs_best": 1.0}
    kernels.report({"device": "test", "decode_goals": [lim, row]}, tmp_path)
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "32768 keys" in ln)
    assert "copy  3950 GB/s" in line and "77.3%" in line


def _paged(kv: str, us: float) -> list[dict]:
    return [{"arm": "limits", "copy_GBps": 3000.0, "sgemm_TFLOPs": 50.0},
            {"kv": kv, "what": "paged decode", "arm": f"dq_{kv}_d128_g4_paged [default]",
             "kernel": f"dq_{kv}_d128_g4_paged", "us": us, "TFLOPs": 1.0, "of_sgemm": 0.02,
             "GBps": 3000.0, "roofline_us": 0.7 * us, "of_roofline": 0.7}]


def test_runs_of_parts_merge_into_one_report(tmp_path, capsys, monkeypatch):
    """A GPU lent minutes a command runs the benchmark in parts: `report DIR...` merges
    their kernels.json (a section's rows in run order, each run's limits row skipped)."""
    import json

    for i, kv in enumerate(("f16", "q8_0")):
        d = tmp_path / f"run{i}"
        d.mkdir()
        (d / "kernels.json").write_text(json.dumps({"device": "H", "rounds": 7,
                                                    "paged_goals": _paged(kv, 200.0 + i)}))
    rec = kernels.merged([json.loads((tmp_path / f"run{i}" / "kernels.json").read_text())
                          for i in range(2)])
    assert [r.get("kv") for r in rec["paged_goals"]] == [None, "f16", None, "q8_0"]
    out = tmp_path / "merged"
    monkeypatch.setenv("KGEN_BENCH_OUT", str(out))
    assert kernels.main(["report", str(tmp_path / "run0"), str(tmp_path / "run1")]) == 0
    text = capsys.readouterr().out
    rows = [ln for ln in text.splitlines() if "paged decode" in ln and "us" in ln
            and "roofline" in ln and ln.startswith("  ")]
    assert [ln.split()[0] for ln in rows] == ["f16", "q8_0"]
    merged = json.loads((out / "kernels.json").read_text())
    assert len(merged["paged_goals"]) == 4


def test_merging_refuses_runs_of_different_devices():
    with pytest.raises(ValueError, match="different devices"):
        kernels.merged([{"device": "A"}, {"device": "B"}])
    with pytest.raises(ValueError, match="no runs"):
        kernels.merged([])
    assert kernels.main(["nonsense"]) == 2


def test_rows_print_their_kernels_k80_occupancy(tmp_path, capsys):
    rows = _long_rows({"qs_f32_causal": 20.0, kernels.SGEMM_ARM: 20.0})
    rows[0]["k80"] = {"blocks": 2, "warps": 8}
    kernels.report({"device": "test", "prefill_long": rows}, tmp_path)
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "qs_f32_causal " in ln)
    assert "[K80: 2 blocks, 8 warps]" in line
    assert "K80" not in next(ln for ln in out.splitlines() if kernels.SGEMM_ARM in ln)


def test_decode_goals_shapes_and_head_dims_come_from_the_environment(monkeypatch):
    """decode_goals times the goals' shapes (GQA 4 and 8) and head sizes (128, 256) unless
    KGEN_BENCH_DECODE_SHAPES and KGEN_BENCH_HEAD_DIMS name others (a multi-head model's
    group count, head_dim 96)."""
    import importlib

    monkeypatch.delenv("KGEN_BENCH_DECODE_SHAPES", raising=False)
    monkeypatch.delenv("KGEN_BENCH_HEAD_DIMS", raising=False)
    assert importlib.reload(kernels).GOAL_SHAPES == ((32, 8), (16, 2))
    assert kernels._decode_head_dims() == (128, 256)
    monkeypatch.setenv("KGEN_BENCH_DECODE_SHAPES", "32/32,16/8")
    monkeypatch.setenv("KGEN_BENCH_HEAD_DIMS", "96,128")
    assert importlib.reload(kernels).GOAL_SHAPES == ((32, 32), (16, 8))
    assert kernels._decode_head_dims() == (96, 128)
    monkeypatch.delenv("KGEN_BENCH_DECODE_SHAPES")
    importlib.reload(kernels)
