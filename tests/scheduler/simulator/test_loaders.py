"""Loaders: every row is loaded or rejected with its file, line and field; nothing vanishes."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.model import ANY_GPU_TYPE
from scheduler.simulator.loaders import TraceError, load_alibaba, load_philly, load_trace
from scheduler.simulator.trace import compress_arrivals, synthetic_trace

PHILLY_HEADER = "timestamp,duration,num_gpus,gpu_time,cluster\n"
VC_NODES = "vc,node num\nvc1,2\nvc2,1\n"
OPENB_NODES = (
    "sn,cpu_milli,memory_mib,gpu,model\n"
    "n0,64000,262144,8,V100M32\n"
    "n1,32000,131072,2,T4\n"
    "n2,96000,393216,0,\n"
)
OPENB_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
    "creation_time,deletion_time,scheduled_time\n"
)


def philly(tmp_path: Path, rows: str, vc_nodes: str = VC_NODES) -> tuple[Path, Path]:
    jobs = tmp_path / "philly-jobs.csv"
    jobs.write_text(PHILLY_HEADER + rows)
    nodes = tmp_path / "philly-vc-nodes.csv"
    nodes.write_text(vc_nodes)
    return jobs, nodes


def openb(tmp_path: Path, rows: str) -> tuple[Path, Path]:
    pods = tmp_path / "openb_pod_list_default.csv"
    pods.write_text(OPENB_HEADER + rows)
    nodes = tmp_path / "openb_node_list_gpu_node.csv"
    nodes.write_text(OPENB_NODES)
    return pods, nodes


def test_a_philly_file_loads_with_each_vc_a_tenant_guaranteed_its_nodes(tmp_path):
    jobs, nodes = philly(
        tmp_path,
        "2017-10-01 00:00:10,100.0,2,200.0,vc1\n2017-10-01 00:00:00,50.0,1,50.0,vc2\n",
    )
    trace = load_philly(jobs, nodes)

    assert [(j.tenant, j.gpus, j.duration_s) for j in trace.jobs] == [
        ("vc2", 1, 50.0),
        ("vc1", 2, 100.0),
    ]
    assert trace.jobs[1].submit_s - trace.jobs[0].submit_s == 10
    assert {t.name: t.guaranteed_gpus for t in trace.tenants} == {"vc1": 16, "vc2": 8}
    assert trace.total_gpus == 24
    assert {n.owner for n in trace.nodes} == {"vc1", "vc2"}


@pytest.mark.parametrize(
    ("row", "field", "says"),
    [
        ("2017-10-01 00:00:00,100.0,x,100.0,vc1", "num_gpus", "expected a whole number"),
        ("2017-10-01 00:00:00,100.0,0,0.0,vc1", "num_gpus", ">= 1"),
        ("2017-10-01,100.0,1,100.0,vc1", "timestamp", "YYYY-MM-DD HH:MM:SS"),
        ("2017-13-01 00:00:00,100.0,1,100.0,vc1", "timestamp", "YYYY-MM-DD HH:MM:SS"),
        ("2017-10-01 00:00:00,-5,1,-5,vc1", "duration", ">= 0"),
        ("2017-10-01 00:00:00,nan,1,1,vc1", "duration", ">= 0"),
        ("2017-10-01 00:00:00,100.0,1,100.0,", "cluster", "empty"),
        ("2017-10-01 00:00:00,100.0,1", "gpu_time", "3 values for 5 columns"),
    ],
)
def test_a_malformed_philly_row_is_an_error_naming_file_line_and_field(tmp_path, row, field, says):
    good = "2017-10-01 00:00:00,100.0,1,100.0,vc1\n"
    jobs, nodes = philly(tmp_path, good + row + "\n")
    with pytest.raises(TraceError) as caught:
        load_philly(jobs, nodes)
    err = caught.value
    assert (err.path.name, err.line, err.field) == ("philly-jobs.csv", 3, field)
    assert str(err).startswith(f"philly-jobs.csv line 3, field {field!r}: ")
    assert says in str(err)


def test_a_missing_column_is_an_error_naming_it(tmp_path):
    jobs = tmp_path / "philly-jobs.csv"
    jobs.write_text("timestamp,duration,cluster\n2017-10-01 00:00:00,1,vc1\n")
    nodes = tmp_path / "philly-vc-nodes.csv"
    nodes.write_text(VC_NODES)
    with pytest.raises(
        TraceError, match=r"philly-jobs.csv line 1, field 'num_gpus': column missing"
    ):
        load_philly(jobs, nodes)


def test_a_bad_node_count_names_the_vc_file(tmp_path):
    jobs, nodes = philly(tmp_path, "2017-10-01 00:00:00,1,1,1,vc1\n", "vc,node num\nvc1,two\n")
    with pytest.raises(TraceError, match=r"philly-vc-nodes.csv line 2, field 'node num'"):
        load_philly(jobs, nodes)


def test_jobs_of_vcs_without_nodes_are_dropped_and_counted_not_lost_in_silence(tmp_path):
    jobs, nodes = philly(
        tmp_path,
        "2017-10-01 00:00:00,1,1,1,vc1\n2017-10-01 00:00:01,1,1,1,tiny\n"
        "2017-10-01 00:00:02,1,1,1,tiny\n",
    )
    dropped = load_philly(jobs, nodes)
    assert [j.tenant for j in dropped.jobs] == ["vc1"]
    assert any(
        "2 jobs of 1 VCs without nodes dropped" in n and "tiny (2)" in n for n in dropped.notes
    )

    kept = load_philly(jobs, nodes, vcs_without_nodes="borrow")
    assert [j.tenant for j in kept.jobs] == ["vc1", "tiny", "tiny"]
    assert {t.name: t.guaranteed_gpus for t in kept.tenants}["tiny"] == 0


def test_openb_tasks_load_with_fractions_rounded_up_and_skips_counted(tmp_path):
    pods, nodes = openb(
        tmp_path,
        "p0,12000,16384,1,1000,,LS,Running,0,500,10\n"
        "p1,6000,12288,1,460,,BE,Running,100,400,100\n"
        "p2,4000,8192,0,0,,BE,Running,200,300,200\n"
        "p3,4000,8192,1,1000,,BE,Pending,300,900,\n"
        "p4,88000,327680,8,1000,V100M32,Burstable,Succeeded,400,1400,450\n"
        "p5,4000,8192,1,1000,T4|V100M32,LS,Running,500,800,500\n",
    )
    trace = load_alibaba(pods, nodes)

    by_name = {j.name: j for j in trace.jobs}
    assert sorted(by_name) == ["p0", "p1", "p4", "p5"]
    assert by_name["p1"].gpus == 1  # 0.46 of a GPU -> one whole GPU
    assert by_name["p0"].duration_s == 490 and by_name["p0"].submit_s == 0
    assert by_name["p4"].gpu_type == "V100M32" and by_name["p4"].cpus == 88.0
    assert by_name["p5"].gpu_type == ANY_GPU_TYPE
    assert by_name["p0"].priority > by_name["p1"].priority
    notes = "\n".join(trace.notes)
    assert "1 fractional-GPU tasks (gpu_milli < 1000) rounded up to one whole GPU" in notes
    assert "1 tasks with num_gpu 0 skipped" in notes
    assert "1 tasks never scheduled in the trace skipped" in notes
    assert "1 tasks allowed several GPU types" in notes
    assert {n.gpu_type for n in trace.nodes} == {
        "V100M32",
        "T4",
    }  # the GPU-less node is no GPU node
    assert {t.name for t in trace.tenants} == {"LS", "BE", "Burstable"}
    assert sum(t.guaranteed_gpus for t in trace.tenants) <= trace.total_gpus


@pytest.mark.parametrize(
    ("row", "field"),
    [
        ("p0,12000,16384,1,1000,,XX,Running,0,500,10", "qos"),
        ("p0,12000,16384,1,1000,,LS,Running,0,5,10", "deletion_time"),
        ("p0,12000,16384,1,1000,A100,LS,Running,0,500,10", "gpu_spec"),
        ("p0,12000,16384,1,1500,,LS,Running,0,500,10", "gpu_milli"),
        ("p0,12000,16384,one,1000,,LS,Running,0,500,10", "num_gpu"),
    ],
)
def test_a_malformed_openb_row_is_an_error_naming_file_line_and_field(tmp_path, row, field):
    pods, nodes = openb(tmp_path, "p9,1000,1024,1,1000,,LS,Running,0,10,0\n" + row + "\n")
    with pytest.raises(TraceError) as caught:
        load_alibaba(pods, nodes)
    assert (caught.value.path.name, caught.value.line, caught.value.field) == (
        "openb_pod_list_default.csv",
        3,
        field,
    )


def test_a_path_is_recognised_by_its_columns(tmp_path):
    jobs, _ = philly(tmp_path, "2017-10-01 00:00:00,1,1,1,vc1\n")
    assert load_trace(str(jobs)).name == "philly"
    assert load_trace(str(tmp_path)).name == "philly"
    with pytest.raises(TraceError, match="no such file"):
        load_trace(str(tmp_path / "nothing.csv"))


def test_the_synthetic_trace_is_the_same_for_the_same_seed_and_differs_for_another():
    assert synthetic_trace(3) == synthetic_trace(3)
    assert synthetic_trace(3).jobs != synthetic_trace(4).jobs


def test_a_load_factor_divides_the_time_since_the_first_submit():
    jobs = synthetic_trace(1, jobs=5).jobs
    fast = compress_arrivals(jobs, 2.0)
    t0 = jobs[0].submit_s
    assert [f.submit_s for f in fast] == pytest.approx([t0 + (j.submit_s - t0) / 2 for j in jobs])
    assert [f.duration_s for f in fast] == [j.duration_s for j in jobs]
    with pytest.raises(ValueError):
        compress_arrivals(jobs, 0)
