"""The report's table: subtracted times that mean nothing say so, every column is explained, and a backend
that cannot run here is one line under the table, its reason whole."""

import dataclasses

import msda_core
from msda_benchmarks import report
from msda_testkit.cases import case


def test_a_subtracted_time_inside_the_noise_is_not_printed_as_a_figure():
    assert report.subtracted([1.0, 1.1, 0.9], [1.2, 1.2, 1.2]) == "< noise"  # negative
    assert report.subtracted([1.2, 1.0, 1.4], [1.0, 1.0, 1.0]) == "< noise"  # 0.2 against a spread of 0.2
    assert report.subtracted([3.0, 3.1, 2.9], [1.0, 1.05, 0.95]) == "2"


def test_the_legend_explains_every_figure_column():
    for name, _ in report.COLUMNS[3:]:
        assert f"\n{name}: " in "\n" + report.LEGEND, name
    assert '"of scale"' in report.LEGEND


def test_a_backend_that_cannot_run_here_is_one_line_not_a_row_per_case(monkeypatch):
    gather = msda_core.backends()["gather"]
    elsewhere = dataclasses.replace(gather, name="elsewhere", devices=frozenset({"no_such_device"}))
    monkeypatch.setattr(msda_core, "backends", lambda: {"gather": gather, "elsewhere": elsewhere})
    rows, skipped = [], {}
    for dtype in report.DTYPES:
        rows += report.rows_for(case("tiny"), dtype, report.torch.device("cpu"), 0.01, skipped)
    assert [r[2] for r in rows] == ["gather"] * 3 and all(r[-1].startswith("ok") for r in rows)
    assert report.skip_lines(skipped, ["tiny"]) == [
        "elsewhere skipped on every case and dtype: device type 'cpu' not in ['no_such_device']"]


def test_skip_reasons_wrap_between_words():
    reason = "the deterministic mode's exact fp32 sums need Q*L*P < 2^23 terms per element, got 8388608"
    lines = report.skip_lines({("triton", reason): [("deterministic", "tiny", "float16")]}, ["tiny", "other"],
                              width=40)
    assert len(lines) > 2 and all(len(line) <= 40 for line in lines)
    assert " ".join(line.strip() for line in lines) == f"triton (deterministic) skipped on tiny (float16): {reason}"
