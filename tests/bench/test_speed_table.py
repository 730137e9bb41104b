"""The README's speed tables are what bench/speed_table.py makes of bench/results.jsonl, and every row
of that file has the fields the tables and readers rely on."""

import math

from bench import common, speed_table


def test_readme_tables_are_current():
    text = speed_table.README.read_text()
    assert speed_table.BEGIN in text and speed_table.END in text
    assert speed_table.render(text, common.read_rows()) == text, "run python -m bench.speed_table"


def test_every_row_has_the_required_fields():
    rows = common.read_rows()
    assert rows
    for number, row in enumerate(rows, 1):
        assert not common.missing_fields(row), f"row {number} lacks or mistypes {common.missing_fields(row)}: {row}"
        values = [row["ours"], *row["peers"].values(), *row["baselines"].values()]
        values += [] if row["roofline"] is None else [row["roofline"]]
        assert all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in values), row
        assert row["date"][:4].isdigit() and len(row["date"]) == 10, row["date"]
        assert row["source"] == "measured" or row["source"].startswith("transcribed from bench/RESULTS.md"), row["source"]


def test_render_replaces_only_the_marked_section():
    rows = [dict(date="2026-01-01", commit="abc", device=speed_table.DEVICE, op="kda_decode", shape="B=64 H=64 D=128",
                 metric="GPU kernel ms", unit="ms", ours=0.15, peers={"fla": 0.146, "other": 0.2},
                 baselines={"XLA pass": 0.127}, roofline=0.125, command="x", source="measured"),
            dict(date="2026-01-02", commit="abc", device="compile-only NVIDIA H200 (no GPU)", op="kda_decode",
                 shape="B=64 H=64 D=128", metric="GPU kernel ms", unit="ms", ours=9.0, peers={}, baselines={},
                 roofline=None, command="x", source="measured")]
    text = f"before\n{speed_table.BEGIN}\nstale\n{speed_table.END}\nafter\n"
    out = speed_table.render(text, rows)
    assert out.startswith("before\n") and out.endswith("\nafter\n") and "stale" not in out
    assert "| B=64 H=64 D=128 | 0.15 | 0.146 fla | 0.127 XLA pass | 0.125 | 2026-01-01 |" in out  # not the compile-only row
