"""Slices of the real traces in ../shared/data load and replay (skipped where the data is absent)."""

from __future__ import annotations

import pytest

from scheduler.simulator.compare import compare
from scheduler.simulator.engine import SimOptions
from scheduler.simulator.loaders import load_alibaba, load_philly
from tests.scheduler.simulator.builders import ALIBABA_DIR, PHILLY_DIR

needs_philly = pytest.mark.skipif(
    not (PHILLY_DIR / "philly-jobs.csv").exists(),
    reason=f"the Philly trace is not at {PHILLY_DIR} (optional: README.md, section Data, says where to get it)",
)
needs_alibaba = pytest.mark.skipif(
    not (ALIBABA_DIR / "openb_pod_list_default.csv").exists(),
    reason=f"the Alibaba openb trace is not at {ALIBABA_DIR} (optional: README.md, section Data, says where to get it)",
)


@needs_philly
@pytest.mark.slow
def test_the_first_2000_philly_jobs_load_and_replay_with_every_job_finished():
    trace = load_philly(max_rows=2000)
    assert len(trace.jobs) == 1998  # two of the first 2,000 belong to a VC without nodes
    assert trace.total_gpus == 2816 and len(trace.tenants) == 11

    result = compare(trace, ["fifo-static", "ours"], SimOptions())
    for s in result.summaries:
        assert s.jobs == 1998 and s.unfinished == 0
    for name, r in result.results.items():
        assert all(o.jct_s >= o.duration_s for o in r.outcomes), name
        assert all(o.first_start_s >= o.submit_s for o in r.outcomes), name
    static, ours = result.summaries
    # Lending idle GPUs never makes the cluster as a whole wait longer than static partitions.
    assert ours.mean_queue_s <= static.mean_queue_s


@needs_philly
@pytest.mark.slow
def test_the_philly_vcs_without_nodes_are_the_15_jobs_anchors_md_dropped():
    trace = load_philly()
    assert len(trace.jobs) == 74152
    assert any(n.startswith("15 jobs of 4 VCs without nodes dropped") for n in trace.notes)


@needs_alibaba
def test_the_alibaba_trace_loads_with_every_skip_counted_and_a_slice_replays():
    trace = load_alibaba()
    notes = "\n".join(trace.notes)
    assert "1,088 tasks with num_gpu 0 skipped" in notes
    # 897 tasks never ran; 36 of them asked for no GPU and count as such
    assert "861 tasks never scheduled in the trace skipped" in notes
    assert len(trace.jobs) == 8152 - 1088 - 861
    assert trace.total_gpus == 6212

    result = compare(trace.limited(300), ["ours"], SimOptions(), reference=False)
    assert result.summaries[0].jobs + result.summaries[0].unfinished == 300
