"""Metrics on replays whose figures are known by hand, and the command's report."""

from __future__ import annotations

import math

import pytest

from scheduler.simulator.__main__ import main
from scheduler.simulator.metrics import jain_index, percentile, step_average, step_peak, summarize
from tests.scheduler.simulator.builders import job, run, trace


def test_finish_time_fairness_compares_each_tenant_with_its_own_static_partition():
    # a: 8 jobs of 100 s on 4 GPUs. Alone: JCTs 100 x4 and 200 x4 (mean 150). Borrowing b's idle
    # GPUs: all 100 (rho 100/150). b's one job is the same either way (rho 1).
    jobs = [job(i, "a", 0, 100) for i in range(1, 9)] + [job(9, "b", 5000, 10)]
    t = trace(jobs, {"a": (1, 4), "b": (1, 4)})
    reference = run(t, "fifo-static")
    shared = summarize("ours", run(t, "ours"), reference)

    rho = {row.tenant: row.rho for row in shared.tenants}
    assert rho["a"] == pytest.approx(100 / 150)
    assert rho["b"] == pytest.approx(1.0)
    assert shared.max_rho == pytest.approx(1.0)
    assert shared.jain_rho == pytest.approx((2 / 3 + 1) ** 2 / (2 * ((2 / 3) ** 2 + 1)))

    alone = summarize("fifo-static", reference, reference)
    assert alone.mean_queue_s == pytest.approx(4 * 100 / 9)
    assert alone.waited_share == pytest.approx(4 / 9)
    assert alone.makespan_s == 5010
    # 8 x 100 + 10 GPU-seconds over 8 GPUs x 5,010 s
    assert alone.utilization == pytest.approx(810 / (8 * 5010))
    assert {row.tenant: row.mean_queue_s for row in alone.tenants} == {"a": 50, "b": 0}


def test_percentiles_interpolate_between_order_statistics():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 99) == 10
    assert percentile(list(range(101)), 99) == 99
    assert math.isnan(percentile([], 50))


def test_jain_index_is_one_when_equal_and_one_over_n_when_one_takes_all():
    assert jain_index([2, 2, 2]) == 1
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)


def test_a_step_series_is_averaged_and_peaked_per_bucket():
    # 4 busy for 0..50, 0 for 50..100, 2 for 100..200
    times, values = [0.0, 50.0, 100.0], [4, 0, 2]
    mids, avg = step_average(times, values, 0.0, 200.0, 100.0)
    assert mids == [50.0, 150.0] and avg == [2.0, 2.0]
    _, peak = step_peak(times, values, 0.0, 200.0, 100.0)
    assert peak == [4, 2]


@pytest.mark.slow
def test_the_command_writes_a_report_with_the_table_and_the_plots(tmp_path, capsys):
    out = tmp_path / "report"
    code = main(
        [
            "--trace",
            "synthetic",
            "--policy",
            "fifo-static,sjf,ours",
            "--limit",
            "80",
            "--power-budget",
            "20000",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    report = (out / "report.md").read_text()
    assert "| fifo-static |" in report and "| sjf |" in report and "| ours |" in report
    assert "only the first 80 of 200 jobs" in report
    for png in ("jct_cdf.png", "queue_per_tenant.png", "utilization.png", "power.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
        assert f"]({png})" in report
    printed = capsys.readouterr()
    assert "mean queue (s)" in printed.out
    assert "100.0%" in printed.err  # the progress bar reached the end


def test_the_command_refuses_an_unknown_policy_by_name(capsys):
    assert main(["--trace", "synthetic", "--policy", "fifo,ours"]) == 2
    assert "unknown policy fifo" in capsys.readouterr().err
