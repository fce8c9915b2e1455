"""A what-if run's stored summaries read back as the simulator's Summaries, figures added to
Summary since the run was stored included."""

import dataclasses
import math

from controlplane.scheduling.whatif.report import _summary_dict, summaries_from_json
from scheduler.simulator.metrics import summarize
from tests.scheduler.simulator.builders import job, run, trace


def _summary():
    t = trace([job(1, "a", 0, 100), job(2, "b", 5, 50, gpus=2)], {"a": (1, 2), "b": (1, 2)})
    return summarize("ours", run(t, "ours"))


def test_a_stored_summary_reads_back_the_same():
    s = _summary()
    assert summaries_from_json([_summary_dict(s)]) == [s]


def test_a_row_stored_before_a_figure_existed_reads_it_as_not_recorded():
    row = _summary_dict(_summary())
    for name in ("guaranteed_jobs", "guaranteed_over_bound", "guaranteed_wait_max_s"):
        del row[name]
    (back,) = summaries_from_json([row])
    assert back.guaranteed_jobs == -1
    assert back.guaranteed_over_bound == -1
    assert math.isnan(back.guaranteed_wait_max_s)
    kept = {f.name for f in dataclasses.fields(back)} - set(row)
    assert kept == {"guaranteed_jobs", "guaranteed_over_bound", "guaranteed_wait_max_s"}
