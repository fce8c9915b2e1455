"""What a reader of the simulator's reports notices: ties drawn as one line with every name,
colours that stay with their policy, per-class counts that add up, preempted jobs and their
preemption counts, per-tenant series over time, and no path of the machine in report.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scheduler.simulator import plots
from scheduler.simulator.__main__ import main
from scheduler.simulator.engine import JobOutcome, Result
from scheduler.simulator.metrics import (
    Summary,
    class_metrics,
    job_class,
    summarize,
    tenant_series,
)
from scheduler.simulator.report import (
    class_rows,
    command_line,
    strip_paths,
    summary_table,
    write_report,
)
from scheduler.simulator.sweep import main as sweep_main
from scheduler.simulator.sweep import relative_table, sweep_plot
from tests.scheduler.simulator.builders import job, run, trace

PHILLY_JOBS = "timestamp,duration,num_gpus,gpu_time,cluster\n" + "".join(
    f"2017-10-01 00:{m:02d}:00,{600 + 60 * m}.0,{1 + m % 3},{600 + 60 * m}.0,vc{'AB'[m % 2]}\n"
    for m in range(12)
)
VC_NODES = "vc,node num\nvcA,1\nvcB,1\n"
# Anything that looks like a path from the root of a machine (or a home folder).
ABSOLUTE = re.compile(r"(^|[\s(`'\"=])(/|~/)[\w.-]+/")


def outcome(
    job_id: int,
    tenant: str,
    *,
    submit: float,
    start: float,
    finish: float,
    held: float | None = None,
    gpus: int = 1,
    duration: float | None = None,
    preemptions: int = 0,
) -> JobOutcome:
    held = finish - start if held is None else held
    return JobOutcome(
        job_id, tenant, gpus, submit, start, finish, duration or held, held, preemptions, 0.0
    )


def result(outcomes: list[JobOutcome], tenants: tuple[str, ...] = ("a", "b")) -> Result:
    return Result(
        outcomes=outcomes,
        unfinished_job_ids=[],
        tenants=tenants,
        total_gpus=8,
        timeline_t_s=[],
        timeline_busy_gpus=[],
        timeline_power_w=[],
        energy_j=0.0,
        peak_power_w=0.0,
        power_budget_w=None,
        over_budget_s=0.0,
        preemptions=sum(o.preemptions for o in outcomes),
        preempted_gpu_s_lost=0.0,
        plan_calls=0,
        cycles_skipped=0,
        events=0,
        wall_s=0.0,
        cpu_s=0.0,
        plan_wall_s=0.0,
        power_wall_s=0.0,
        first_submit_s=0.0,
    )


def test_tied_policies_are_one_line_labelled_with_every_name_in_the_first_ones_colour():
    plt = plots.pyplot()
    fig, ax = plt.subplots()
    loads = [4.0, 6.0, 8.0]
    groups = plots.draw_lines(
        ax,
        {"fifo-shared": loads, "ours": loads, "srtf-shared": loads},
        # ours differs from fifo-shared only past the 3 significant digits a figure shows
        {
            "fifo-shared": [100.0, 200.0, 300.0],
            "ours": [100.01, 200.0, 300.0],
            "srtf-shared": [50.0, 60.0, 70.0],
        },
    )
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["fifo-shared = ours", "srtf-shared"]
    assert lines[0].get_color() == plots.policy_color("fifo-shared")
    assert groups == [("fifo-shared", "ours"), ("srtf-shared",)]
    plt.close(fig)


def test_a_policy_keeps_its_colour_whatever_else_a_report_shows():
    plt = plots.pyplot()
    colours = []
    for names in (["fifo-shared", "ours"], ["ours", "srtf-shared", "fifo-shared", "my-variant"]):
        fig, ax = plt.subplots()
        plots.draw_lines(
            ax, {n: [0.0, 1.0] for n in names}, {n: [k, k + 1.0] for k, n in enumerate(names)}
        )
        colours.append({line.get_label(): line.get_color() for line in ax.get_lines()})
        plt.close(fig)
    assert colours[0]["ours"] == colours[1]["ours"]
    assert colours[0]["fifo-shared"] == colours[1]["fifo-shared"]
    assert len(set(colours[1].values())) == 4
    # A name no preset has gets its colour from its name alone (no per-process hash salt).
    assert plots.policy_color("my-variant") == plots.policy_color("my-variant") != "#000000"
    assert plots.policy_linestyle("srtf-shared") == "--" and plots.policy_linestyle("ours") == "-"


def test_job_classes_bin_gpus_and_run_time_and_their_counts_add_up():
    assert job_class(1, 59.0) == ("1 GPU", "< 10 min")
    assert job_class(3, 2 * 3600.0) == ("2-4 GPUs", "1 - 8 h")
    assert job_class(8, 3600.0) == ("5-8 GPUs", "1 - 8 h")
    assert job_class(16, 9 * 3600.0) == ("> 8 GPUs", ">= 8 h")
    outcomes = [
        outcome(i, "a", submit=0, start=10 * i, finish=10 * i + d, gpus=g)
        for i, (g, d) in enumerate([(1, 60), (1, 60), (2, 4000), (16, 40000), (8, 900)])
    ]
    rows = class_metrics(outcomes)
    assert sum(r.jobs for r in rows) == len(outcomes)
    assert [(r.gpu_bin, r.duration_bin, r.jobs) for r in rows] == [
        ("1 GPU", "< 10 min", 2),
        ("2-4 GPUs", "1 - 8 h", 1),
        ("5-8 GPUs", "10 min - 1 h", 1),
        ("> 8 GPUs", ">= 8 h", 1),
    ]
    assert rows[0].mean_queue_s == pytest.approx(5.0)  # jobs 0 and 1 waited 0 and 10 s


def test_the_report_table_counts_preempted_jobs_and_preemptions_per_victim_and_shows_max_rho():
    outcomes = [
        outcome(1, "a", submit=0, start=0, finish=100),
        outcome(2, "a", submit=0, start=0, finish=300, held=200, preemptions=1),
        outcome(3, "b", submit=0, start=0, finish=500, held=200, preemptions=3),
        outcome(4, "b", submit=0, start=0, finish=500, held=300, preemptions=2),
    ]
    s = summarize("ours", result(outcomes))
    assert s.preemptions == 6 and s.preempted_jobs == 3
    assert s.preemptions_per_victim_mean == pytest.approx(2.0)
    assert s.preemptions_per_victim_max == 3
    table = summary_table([s])
    assert "max rho" in table and "Jain" not in table
    header = table.splitlines()[0].split(" | ")
    # the number of preempted jobs sits beside the preemptions and the GPU-hours lost
    at = header.index("preempted jobs")
    assert header[at - 1] == "preempt" and header[at + 2] == "GPU-h lost"
    assert "| 6 | 3 | 2.0 / 3 / 3 |" in table


def test_per_tenant_queue_length_and_gpus_held_are_rebuilt_from_the_outcomes():
    outcomes = [
        # queued 0-100, holds 2 GPUs 100-300
        outcome(1, "a", submit=0, start=100, finish=300, gpus=2),
        # preempted once: held 4 GPUs for half of 0-200, so 2 GPUs and half a job queued on average
        outcome(2, "b", submit=0, start=0, finish=200, held=100, gpus=4, preemptions=1),
    ]
    series = tenant_series(result(outcomes), 0.0, 400.0, 100.0)
    assert series["a"].queued_jobs == [1.0, 0.0, 0.0, 0.0]
    assert series["a"].held_gpus == [0.0, 2.0, 2.0, 0.0]
    assert series["b"].queued_jobs == pytest.approx([0.5, 0.5, 0.0, 0.0])
    assert series["b"].held_gpus == pytest.approx([2.0, 2.0, 0.0, 0.0])


def test_absolute_paths_are_cut_to_the_file_name():
    text = "read /home/someone/data/philly-jobs.csv and ~/x/vcs.csv (see /tmp/out/)"
    assert strip_paths(text) == "read philly-jobs.csv and vcs.csv (see out)"
    kept = "mean / p99 queue, 1/L, https://example.com/a/b, L4/report.md"
    assert strip_paths(kept) == kept
    inside = str(Path.cwd() / "sweeps" / "x")
    assert command_line("prog", ["--out", inside, "--trace", "/elsewhere/t.csv"]) == (
        "prog --out sweeps/x --trace t.csv"
    )


def test_the_report_names_the_trace_file_and_no_path_of_the_machine(tmp_path):
    jobs = tmp_path / "traces" / "my-jobs.csv"
    jobs.parent.mkdir()
    jobs.write_text(PHILLY_JOBS)
    nodes = tmp_path / "vcs.csv"
    nodes.write_text(VC_NODES)
    out = tmp_path / "report"
    argv = ["--trace", str(jobs), "--vc-nodes", str(nodes), "--policy", "fifo-shared,ours"]
    assert main([*argv, "--quiet", "--no-plots", "--out", str(out)]) == 0

    report = (out / "report.md").read_text()
    assert report.startswith("# my-jobs.csv: 12 jobs, load factor 1\n")
    assert not ABSOLUTE.search(report), ABSOLUTE.search(report)
    assert str(tmp_path) not in report
    assert "--trace my-jobs.csv --vc-nodes vcs.csv" in report
    # the per-class table's counts add up to the jobs replayed
    section = report.split("## Per job class")[1].split("\n## ")[0]
    rows = [r.split(" | ") for r in section.splitlines() if r.startswith("| ") and "---" not in r]
    counts = [int(r[2]) for r in rows[1:-1]]
    assert sum(counts) == 12 and rows[-1][2] == "12"


def test_a_tie_in_the_report_is_named_with_both_policies(tmp_path):
    # Jobs that never contend: FIFO shared and ours do exactly the same.
    t = trace([job(i, "a", 1000 * i, 100) for i in range(1, 6)], {"a": (1, 4), "b": (1, 4)})
    results = {name: run(t, name) for name in ("fifo-shared", "ours")}
    reference = run(t, "fifo-static")
    summaries = [summarize(name, r, reference) for name, r in results.items()]
    report = write_report(tmp_path, summaries, results, title="by hand").read_text()
    assert "fifo-shared = ours (JCT CDF)" in report
    assert "fifo-shared = ours (queueing CDF)" in report
    for png in ("queue_cdf.png", "rho_cdf.png", "tenant_queue.png", "tenant_gpus.png"):
        assert f"]({png})" in report and (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    _, rows = class_rows(summaries, results)
    assert rows[-1][2] == "5"


def test_the_sweep_writes_the_load_sweep_plot_and_every_replays_figures(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["--trace", "synthetic", "--policy", "fifo-shared,ours", "--loads", "2,1"]
    assert sweep_main([*argv, "--limit", "40", "--quiet", "--no-plots", "--out", str(out)]) == 0

    report = (out / "report.md").read_text()
    assert report.startswith("# synthetic (seed 0): 40 jobs, load factors 1, 2\n")
    assert "## Per job class at L = 2" in report
    for load in ("1", "2"):
        for policy in ("fifo-shared", "ours"):
            assert f"| {load} | {policy} |" in report
        assert (out / f"L{load}" / "report.md").exists()
    header = report.split("## Every replay")[1].split("\n")[2]
    for column in (
        "mean JCT",
        "p99 JCT",
        "mean queue",
        "p99 queue",
        "max rho",
        "preempt / victim",
        "within guarantee",
        "tenants owed",
        "wall (s)",
        "CPU (s)",
    ):
        assert column in header
    # Every replay of this run recorded its jobs within their guarantee: jobs / over / max wait.
    rows = report.split("## Every replay")[1].strip().split("\n\n")[0].splitlines()
    at = [c.strip() for c in rows[0].split("|")].index(
        "within guarantee: jobs / over bound (gangs) / max wait (s)"
    )
    for row in rows[2:]:
        assert re.fullmatch(r"[\d,]+ / [\d,]+ \([\d,]+\) / [\d,]+", row.split("|")[at].strip()), row
    csv_lines = (out / "sweep.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + 4 and csv_lines[0].startswith("load,policy,mean_jct_s")
    assert not ABSOLUTE.search(report)


def test_the_load_sweep_plot_draws_tied_policies_as_one_line(tmp_path):
    same = [outcome(1, "a", submit=0, start=50, finish=22_437)]
    # 6 s apart in 22,437: equal to 3 significant digits, but not in the table beside the plot
    other = [outcome(1, "a", submit=0, start=50, finish=22_443)]
    runs = {
        load: [
            summarize("fifo-shared", result(same)),
            summarize("ours", result(same)),
            summarize("srtf-shared", result(other)),
        ]
        for load in (4.0, 6.0)
    }
    ties = sweep_plot(tmp_path / "sweep.png", runs)
    assert "fifo-shared = ours (mean JCT (s))" in ties
    assert "fifo-shared = ours = srtf-shared (preempted jobs)" in ties
    assert "fifo-shared = ours = srtf-shared (mean queue (s))" in ties
    assert not any("srtf-shared" in t for t in ties if "JCT" in t)
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_the_sweep_compares_each_policy_with_fifo_shared_and_the_gap_to_oracle_srtf():
    def run_of(name: str, finish: float) -> Summary:
        return summarize(name, result([outcome(1, "a", submit=0, start=0, finish=finish)]))

    runs = {6.0: [run_of("fifo-shared", 200), run_of("ours", 150), run_of("srtf-shared", 100)]}
    table = relative_table(runs)
    # ours: mean JCT 150 against 200 (-25 %), half of the way to SRTF's 100
    assert "| 6 | ours | -25.0 % | -25.0 % |" in table and table.splitlines()[2].endswith(
        "| 50 % |"
    )
    assert relative_table({6.0: [run_of("ours", 150)]}) == ""
    # without oracle SRTF there is no gap to close: no such column
    assert "gap" not in relative_table({6.0: [run_of("fifo-shared", 200), run_of("ours", 150)]})


def test_the_sweep_keeps_its_replays_and_reuses_them(tmp_path, capsys):
    argv = ["--trace", "synthetic", "--policy", "ours", "--loads", "2", "--limit", "30"]
    argv += ["--quiet", "--no-plots", "--results", str(tmp_path / "res")]
    assert sweep_main([*argv, "--out", str(tmp_path / "a")]) == 0
    kept = sorted(p.name for p in (tmp_path / "res").iterdir())
    assert kept == ["L2-fifo-static-n30.pkl", "L2-ours-n30.pkl"]
    capsys.readouterr()
    assert sweep_main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert "reused L2-ours-n30.pkl" in capsys.readouterr().err
    table = [(tmp_path / d / "sweep.csv").read_text() for d in ("a", "b")]
    assert table[0] == table[1]


def test_the_sweep_draws_what_long_replays_have_finished_and_replays_nothing(tmp_path, capsys):
    res = tmp_path / "res"
    argv = ["--trace", "synthetic", "--policy", "fifo-shared,ours", "--limit", "30", "--quiet"]
    argv += ["--no-plots", "--results", str(res)]
    assert sweep_main([*argv, "--loads", "1,2", "--out", str(tmp_path / "a")]) == 0
    (res / "L2-ours-n30.pkl").unlink()  # a replay still running elsewhere
    kept = sorted(p.name for p in res.iterdir())
    capsys.readouterr()
    out = tmp_path / "b"
    assert sweep_main([*argv, "--loads", "1,2", "--cached-only", "--out", str(out)]) == 0
    assert "L2-ours-n30.pkl, left out" in capsys.readouterr().err
    assert sorted(p.name for p in res.iterdir()) == kept  # nothing replayed
    report = (out / "report.md").read_text()
    assert "L = 2: no replay of ours (--cached-only)" in report
    assert "| 1 | ours |" in report and "| 2 | ours |" not in report
    assert "| 2 | fifo-shared |" in report
    # Without the reference there is no rho to measure: refused, naming what is missing.
    (res / "L1-fifo-static-n30.pkl").unlink()
    assert sweep_main([*argv, "--loads", "1", "--cached-only", "--out", str(out)]) == 2
    assert "no replay of fifo-static (the reference)" in capsys.readouterr().err
    assert sweep_main([*argv[:-2], "--loads", "1", "--cached-only", "--out", str(out)]) == 2
    assert "--results" in capsys.readouterr().err
