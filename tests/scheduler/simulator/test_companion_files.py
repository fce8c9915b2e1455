"""--vc-nodes and --node-list: a trace file anywhere, with its node file given or found beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.simulator.__main__ import main
from scheduler.simulator.loaders import TraceError, load_trace

PHILLY_JOBS = (
    "timestamp,duration,num_gpus,gpu_time,cluster\n"
    "2017-10-01 00:00:00,50.0,1,50.0,vcA\n"
    "2017-10-01 00:00:10,100.0,2,200.0,vcB\n"
)
VC_NODES = "vc,node num\nvcA,1\nvcB,2\n"
OPENB_PODS = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
    "creation_time,deletion_time,scheduled_time\n"
    "p0,1000,1024,1,1000,,BE,Succeeded,0,100,10\n"
    "p1,1000,1024,2,1000,T4,LS,Running,5,200,20\n"
)
OPENB_NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,8,V100M32\nn1,32000,131072,2,T4\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_philly_format_file_loads_with_the_vc_nodes_file_given(tmp_path):
    jobs = write(tmp_path / "traces" / "my-jobs.csv", PHILLY_JOBS)
    nodes = write(tmp_path / "elsewhere" / "vcs.csv", VC_NODES)

    trace = load_trace(str(jobs), vc_nodes=nodes)

    assert {t.name: t.guaranteed_gpus for t in trace.tenants} == {"vcA": 8, "vcB": 16}
    assert [j.tenant for j in trace.jobs] == ["vcA", "vcB"]


def test_a_philly_format_file_without_its_vc_nodes_names_the_option(tmp_path):
    jobs = write(tmp_path / "my-jobs.csv", PHILLY_JOBS)

    with pytest.raises(TraceError, match="--vc-nodes"):
        load_trace(str(jobs))
    with pytest.raises(TraceError, match="--vc-nodes.*missing"):
        load_trace(str(jobs), vc_nodes=tmp_path / "nope.csv")


def test_the_vc_nodes_file_beside_a_philly_file_is_found_without_the_option(tmp_path):
    jobs = write(tmp_path / "my-jobs.csv", PHILLY_JOBS)
    write(tmp_path / "philly-vc-nodes.csv", "vc,node num\nvcA,3\nvcB,1\n")

    trace = load_trace(str(jobs))

    assert trace.total_gpus == 32


def test_an_openb_file_loads_with_the_node_list_given(tmp_path):
    pods = write(tmp_path / "pods" / "week.csv", OPENB_PODS)
    nodes = write(tmp_path / "nodes" / "list.csv", OPENB_NODES)

    trace = load_trace(str(pods), node_list=nodes)

    assert trace.total_gpus == 10
    assert [(j.gpus, j.gpu_type) for j in trace.jobs] == [(1, ""), (2, "T4")]


def test_an_openb_file_without_its_node_list_names_the_option(tmp_path):
    pods = write(tmp_path / "week.csv", OPENB_PODS)

    with pytest.raises(TraceError, match="--node-list"):
        load_trace(str(pods))


def test_a_companion_option_for_the_other_format_is_refused(tmp_path):
    jobs = write(tmp_path / "my-jobs.csv", PHILLY_JOBS)
    pods = write(tmp_path / "week.csv", OPENB_PODS)
    nodes = write(tmp_path / "n.csv", OPENB_NODES)

    with pytest.raises(TraceError, match="use --vc-nodes"):
        load_trace(str(jobs), node_list=nodes)
    with pytest.raises(TraceError, match="use --node-list"):
        load_trace(str(pods), vc_nodes=nodes)


def test_the_command_line_replays_a_trace_with_its_companion_given(tmp_path, capsys):
    jobs = write(tmp_path / "a" / "jobs.csv", PHILLY_JOBS)
    nodes = write(tmp_path / "b" / "vcs.csv", VC_NODES)

    assert (
        main(
            [
                "--trace",
                str(jobs),
                "--vc-nodes",
                str(nodes),
                "--policy",
                "fifo-shared",
                "--quiet",
                "--no-plots",
            ]
        )
        == 0
    )
    assert "fifo-shared" in capsys.readouterr().out


def test_the_command_line_says_which_option_a_missing_companion_needs(tmp_path, capsys):
    pods = write(tmp_path / "week.csv", OPENB_PODS)

    assert main(["--trace", str(pods), "--policy", "fifo-shared", "--quiet", "--no-plots"]) == 2
    assert "--node-list" in capsys.readouterr().err
