"""The agent's attempt records in one append-only log (agents.journal), and the agent on it."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents import journal as journal_mod
from agents.journal import AttemptJournal
from tests.agents.conftest import kept_records, wait_until
from tests.agents.test_daemon import attempt, ended, finishes_adopted_once, make_agent, uuids


def record(attempt_id: int, **fields) -> dict:
    return {"attempt_id": attempt_id, **fields}


def test_the_last_record_of_each_attempt_wins_and_a_drop_forgets_it(tmp_path):
    j = AttemptJournal(tmp_path / "attempts.log")
    j.put([record(1, n=1), record(2, n=1)], durable=True)
    j.put([record(1, n=2)], durable=False)
    j.drop([2])
    j.put([record(3, n=1)], durable=False)
    j.close()

    assert AttemptJournal(tmp_path / "attempts.log").load() == {
        1: record(1, n=2),
        3: record(3, n=1),
    }


def test_a_line_cut_by_a_crash_is_skipped_and_the_next_append_starts_a_line_of_its_own(tmp_path):
    path = tmp_path / "attempts.log"
    j = AttemptJournal(path)
    j.put([record(1, n=1)], durable=True)
    j.close()
    with open(path, "ab") as f:  # a crash in the middle of the next record's write
        f.write(b'{"attempt_id":2,"n":')

    again = AttemptJournal(path)
    assert again.load() == {1: record(1, n=1)}
    again.put([record(3, n=1)], durable=True)
    again.close()

    assert AttemptJournal(path).load() == {1: record(1, n=1), 3: record(3, n=1)}


def test_a_write_cut_short_by_a_full_disk_raises_and_loses_no_earlier_record(tmp_path, monkeypatch):
    path = tmp_path / "attempts.log"
    j = AttemptJournal(path)
    j.put([record(1, n=1)], durable=True)
    real_write = os.write
    monkeypatch.setattr(journal_mod.os, "write", lambda fd, data: real_write(fd, data[:7]))
    with pytest.raises(OSError, match="wrote 7 of"):
        j.put([record(2, n=1)], durable=True)
    monkeypatch.setattr(journal_mod.os, "write", real_write)
    j.put([record(3, n=1)], durable=True)  # the disk has room again

    assert AttemptJournal(path).load() == {1: record(1, n=1), 3: record(3, n=1)}


def test_a_flood_of_attempts_keeps_the_log_a_few_lines_per_attempt_kept(tmp_path):
    path = tmp_path / "attempts.log"
    j = AttemptJournal(path, compact_at_lines=50)
    kept: dict[int, dict] = {}
    for attempt_id in range(2000):
        for n in range(3):  # started, ended, logs shipped
            kept[attempt_id] = record(attempt_id, n=n)
            j.put([kept[attempt_id]], durable=False)
            j.compact_if_due(lambda: list(kept.values()))
        if attempt_id >= 5:  # a few stay, the rest are acknowledged and forgotten
            del kept[attempt_id - 5]
            j.drop([attempt_id - 5])

    lines = path.read_bytes().count(b"\n")
    assert lines <= 50 + 3
    assert AttemptJournal(path).load() == kept


ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.lists(st.integers(0, 9), min_size=1, max_size=3)),
        st.tuples(st.just("drop"), st.lists(st.integers(0, 9), min_size=1, max_size=3)),
        st.tuples(st.just("reopen"), st.just([])),
        st.tuples(st.just("cut"), st.just([])),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, compact_at=st.integers(1, 12))
def test_the_log_reads_back_what_was_put_and_not_dropped_whatever_the_order(
    tmp_path_factory, ops, compact_at
):
    """Against a dict: puts, drops, compactions, restarts, and crashes that cut a last line
    (the cut record was never acknowledged to its writer: it is as if never put)."""
    path = tmp_path_factory.mktemp("j") / "attempts.log"
    j = AttemptJournal(path, compact_at_lines=compact_at)
    j.load()
    model: dict[int, dict] = {}
    version = 0
    for op, ids in ops:
        if op == "put":
            version += 1
            records = [record(i, v=version) for i in ids]
            j.put(records, durable=False)
            for r in records:
                model[r["attempt_id"]] = r
            j.compact_if_due(lambda: list(model.values()))
        elif op == "drop":
            j.drop(ids)
            for i in ids:
                model.pop(i, None)
        elif op == "reopen":
            j.close()
            j = AttemptJournal(path, compact_at_lines=compact_at)
            assert j.load() == model
        else:
            j.close()
            with open(path, "ab") as f:
                f.write(b'{"attempt_id":3,"v":-1')
            j = AttemptJournal(path, compact_at_lines=compact_at)
            assert j.load() == model
    j.close()
    assert AttemptJournal(path).load() == model


def test_an_agent_takes_over_the_records_of_an_agent_before_the_log(
    control_plane, state_dir, tmp_path
):
    """An upgrade while a job runs: the former agent kept its record in attempts/<id>.json."""
    runs, marker = tmp_path / "runs", tmp_path / "go"
    first = make_agent(control_plane, state_dir)
    job = f"echo run >> {runs}; while [ ! -e {marker} ]; do sleep 0.05; done"
    control_plane.set_desired([attempt(4, "sh", "-c", job, gpus=uuids(first)[:1])])
    first.cycle()
    wait_until(lambda: runs.exists(), what="the job to start")
    # As the former agent left it: the record in a file of its own, no log.
    legacy = state_dir / "attempts" / "4.json"
    legacy.write_text(json.dumps(kept_records(state_dir)[4]))
    (state_dir / "attempts.log").unlink()
    gone = state_dir / "attempts" / "3.json"  # acknowledged, its file's deletion cut short
    gone.write_text(json.dumps({"attempt_id": 3}))
    first._add_tombstones([3])

    second = make_agent(control_plane, state_dir)
    assert sorted(kept_records(state_dir)) == [4]
    assert not legacy.exists() and not gone.exists()
    finishes_adopted_once(second, control_plane, 4, marker, runs)
    assert control_plane.reported(3) == []


def test_the_attempts_started_together_are_recorded_before_the_first_starts(
    control_plane, state_dir, tmp_path, monkeypatch
):
    """One fsync for a reconcile's starts: every record is on disk before any job runs, so an
    agent killed part-way never starts one of them twice."""
    agent = make_agent(control_plane, state_dir)
    seen_at_start: list[set[int]] = []
    real_start = agent.runtime.start

    def start(spec, extra_env=None):
        seen_at_start.append(set(kept_records(state_dir)))
        return real_start(spec, extra_env)

    monkeypatch.setattr(agent.runtime, "start", start)
    control_plane.set_desired(
        [attempt(a, "true", gpus=[gpu]) for a, gpu in zip((11, 12), uuids(agent), strict=True)]
    )
    agent.cycle()

    assert seen_at_start == [{11, 12}, {11, 12}]


def test_starts_whose_records_could_not_be_written_are_started_by_a_later_cycle(
    control_plane, state_dir, tmp_path, monkeypatch
):
    """A full disk when the records are written: nothing starts, and once there is room the
    next cycle starts each attempt, once."""
    runs = tmp_path / "runs"
    agent = make_agent(control_plane, state_dir)
    real_put = agent._journal.put

    def full(records, *, durable):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(agent._journal, "put", full)
    control_plane.set_desired(
        [
            attempt(a, "sh", "-c", f"echo {a} >> {runs}", gpus=[gpu])
            for a, gpu in zip((21, 22), uuids(agent), strict=True)
        ]
    )
    with pytest.raises(OSError, match="No space"):
        agent.cycle()
    assert agent.runtime.statuses() == [] and not runs.exists()

    monkeypatch.setattr(agent._journal, "put", real_put)
    agent.cycle()
    for a in (21, 22):
        ended(agent, a)
    agent.cycle()
    assert sorted(runs.read_text().split()) == ["21", "22"]
    assert {r["state"] for a in (21, 22) for r in control_plane.reported(a)} == {"exited"}
