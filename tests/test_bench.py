"""qla-bench's bookkeeping (the timing itself needs a GPU)."""
from qla_compiler.bench import ROWS, _table, parse_row


def test_rows_follow_the_baseline_table():
    assert parse_row("2/8:1x32768") == (2, 8, [32768])
    assert parse_row("16/64:8x4096") == (16, 64, [4096] * 8)
    assert len(ROWS) == 9 and all(parse_row(r)[1] % parse_row(r)[0] == 0 for r in ROWS)


def test_table_reports_times_and_ratios():
    libs = {"qla": None, "FLA": None}
    rows = [{"row": "2/8:1x8192", "qla device": 0.1, "qla eager": 0.4, "FLA device": 0.2, "FLA eager": 0.8}]
    text = _table(rows, libs)
    header, rule, line = text.splitlines()
    assert "qla/FLA device" in header and "qla/FLA eager" in header
    assert line.split(" | ")[-2:] == ["0.50", "0.50 |"]
