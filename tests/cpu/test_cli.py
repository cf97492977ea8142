"""The read-only commands: check (one file of a spec set), list, show."""

from __future__ import annotations

from pathlib import Path

from kgen.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_check_one_file_takes_its_parents_from_the_specs_beside_it(capsys):
    assert main(["check", str(ROOT / "specs" / "decode.kspec")]) == 0
    out = capsys.readouterr().out
    assert "8 kernels" in out and "parents from 1 other spec file" in out


def test_check_one_file_whose_parent_is_nowhere(tmp_path, capsys):
    f = tmp_path / "lone.kspec"
    f.write_text("kernel a : missing_base { module = m op = qz_split }\n")
    assert main(["check", str(f)]) == 2
    err = capsys.readouterr().err
    assert "inherits from unknown kernel 'missing_base'" in err and err.startswith(str(f))


def test_list_and_show(capsys):
    assert main(["list"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 21 and any("fc_attn_flash_prefill_q4_kvs" in r for r in rows)
    assert main(["show", "fc_attn_flash_prefill_q4_kvs"]) == 0
    out = capsys.readouterr().out
    assert "fc_attn_flash_prefill_q4_kvs <- fc_attn_flash_prefill_q4_kr" in out
    assert "v_stage         = shared_q4" in out and "specs/prefill.kspec" in out
    assert "expect bit_exact with fc_attn_flash_prefill_q4" in out
    assert main(["show", "no_such_kernel"]) == 1
