"""`make bench-counters` off the GPU: ncu's CSV (a fixture cut from a real run on an H200,
two launches) read into one row per launch, the busiest unit named, and the launches
attributed to the items that made them, refusing a run whose launches do not match."""

from __future__ import annotations

from pathlib import Path

import pytest

from kgen.bench import counters

CSV = (Path(__file__).resolve().parents[1] / "fixtures" / "ncu_counters.csv").read_text()


def test_every_metric_of_every_launch_is_read_in_launch_order():
    rows = counters.parse_csv(CSV)
    assert [r["kernel"] for r in rows] == ["dq_q8_0_d128_g8_host", "dq_f16_d128_g4_host"]
    columns = {col for col, _ in counters.METRICS.values()}
    for r in rows:
        assert set(r) == columns | {"kernel"}
    q8, f16 = rows
    assert q8["us"] == pytest.approx(32.672)        # "32,672" ns
    assert q8["regs"] == 177 and f16["regs"] == 123
    assert q8["inst"] == 12895488
    assert f16["dram"] == pytest.approx(58.50)


def test_the_busiest_unit_is_the_bound():
    q8, f16 = counters.parse_csv(CSV)
    assert counters.busiest(q8) == ("issue", pytest.approx(56.39))
    assert counters.busiest({"issue": 40.0, "fma": 20.0, "shared": 10.0, "dram": 80.0}) == \
        ("dram", 80.0)
    assert counters.busiest({"issue": 40.0, "fma": 20.0, "shared": 90.0, "dram": 1.0})[0] == \
        "shared"


def _item(kernels, keys=32768, n_kv=2):
    return {"what": "decode", "kv": "q8_0", "head_dim": 128, "n_head": 16, "n_kv": n_kv,
            "keys": keys, "bytes": 2 * n_kv * keys * 136, "kernels": kernels}


def test_launches_are_attributed_to_their_items():
    launches = counters.parse_csv(CSV)
    rows = counters.attribute([_item(["dq_q8_0_d128_g8_host", "dq_f16_d128_g4_host"])],
                              launches)
    (row,) = rows
    assert row["kernel"] == "dq_q8_0_d128_g8_host"
    assert row["others_us"] == pytest.approx(launches[1]["us"])
    assert row["inst_per_key"] == pytest.approx(12895488 / (32768 * 2))
    assert row["GBps"] == pytest.approx(2 * 2 * 32768 * 136 / (32.672e-6) / 1e9)
    assert row["bound"] == "issue"


@pytest.mark.parametrize("items", [
    [_item(["dq_f16_d128_g4_host", "dq_q8_0_d128_g8_host"])],   # other kernels ran
    [_item(["dq_q8_0_d128_g8_host"])],                          # a launch left over
    [_item(["dq_q8_0_d128_g8_host", "dq_f16_d128_g4_host"]), _item(["x"])],  # one missing
])
def test_a_run_whose_launches_do_not_match_is_refused(items):
    with pytest.raises(SystemExit, match="bench-counters"):
        counters.attribute(items, counters.parse_csv(CSV))


def test_ncu_is_found_from_the_environment_first(tmp_path, monkeypatch):
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("NCU", str(fake))
    assert counters.find_ncu() == str(fake)
