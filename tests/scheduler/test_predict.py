"""Duration prediction from history, Helios style, with its fallbacks."""

import pytest

from scheduler.predict import normalise_name
from tests.scheduler.builders import cluster


@pytest.mark.parametrize(
    "a, b",
    [
        ("resnet50-lr0.1-seed3", "resnet18-lr0.01-seed1"),
        ("bert_large_run12", "bert_large_run3"),
        ("train-v2", "Train-v7"),
        ("sweep-3 final", "sweep-4"),
    ],
)
def test_names_that_differ_only_in_numbers_or_rerun_suffixes_are_the_same_kind(a, b):
    assert normalise_name(a) == normalise_name(b)


def test_different_experiments_stay_different_kinds():
    assert normalise_name("bert-pretrain") != normalise_name("bert-finetune")


def predicted(c, job_id=1) -> float:
    return c.plan().predicted_duration_s[job_id]


def with_history():
    return (
        cluster()
        .node("n1", gpus=8)
        .tenant("vision", 8, 8)
        .history("vision", "resnet50-seed1", 4, 1000.0, user="alice")
        .history("vision", "resnet50-seed2", 4, 1400.0, user="alice")
        .history("vision", "resnet50-seed3", 4, 9000.0, user="alice")
        .history("vision", "resnet50-seed1", 4, 5000.0, user="bob")
        .history("vision", "resnet50-seed1", 8, 300.0, user="alice")
    )


def test_the_same_users_runs_of_that_kind_and_size_predict_the_duration():
    c = with_history().pending(1, "vision", 4, name="resnet18-seed9", user="alice")
    assert predicted(c) == 1400.0  # the median of alice's 4-GPU runs, not bob's or 8-GPU ones


def test_the_tenants_runs_stand_in_for_a_user_without_history():
    c = with_history().pending(1, "vision", 4, name="resnet50-seed4", user="carol")
    assert predicted(c) == 1400.0 + (5000.0 - 1400.0) / 2  # median of all four 4-GPU runs


@pytest.mark.parametrize(
    "kw, expected_s",
    [
        (dict(estimated_s=777.0, max_runtime_s=5000.0), 777.0),
        (dict(max_runtime_s=5000.0), 5000.0),
        (dict(), 1234.0),
        (dict(predicted_s=42.0, estimated_s=777.0), 42.0),  # given (the simulator's oracle)
    ],
)
def test_without_history_the_estimate_then_the_runtime_limit_then_the_default_is_used(
    kw, expected_s
):
    c = with_history().pending(1, "vision", 2, name="other", **kw)
    assert c.plan(default_duration_s=1234.0).predicted_duration_s[1] == expected_s


def test_a_prediction_never_exceeds_the_runtime_limit():
    c = with_history().pending(
        1, "vision", 4, name="resnet-seed0", user="alice", max_runtime_s=600.0
    )
    assert predicted(c) == 600.0


def test_every_pending_job_gets_a_prediction_whether_it_starts_or_not():
    c = cluster().node("n1", gpus=1).tenant("vision", 1, 1)
    c.pending(1, "vision", 1).pending(2, "vision", 1).pending(3, "vision", 9)
    assert set(c.plan().predicted_duration_s) == {1, 2, 3}


def sweep(finished_siblings: int):
    """alice's usual runs of the kind last about 1400 s; this sweep's tasks about 200 s."""
    c = with_history()
    for i in range(finished_siblings):
        c = c.history("vision", f"resnet50-seed{i}", 4, 200.0 + 10 * i, user="alice", group=7)
    # Another sweep's tasks, of the same kind and size, are no siblings of this one.
    for i in range(5):
        c = c.history("vision", f"resnet50-seed{i}", 4, 50_000.0, user="alice", group=8)
    return c.pending(1, "vision", 4, name="resnet50-seed99", user="alice", group=7)


def test_an_array_task_is_predicted_from_its_finished_siblings_first():
    assert predicted(sweep(finished_siblings=3)) == 210.0  # median of 200, 210, 220


def test_too_few_finished_siblings_fall_back_to_the_users_history():
    # Two siblings are not trusted yet: alice's runs of the kind predict, the siblings and the
    # other sweep's tasks among them (they are her runs too).
    alice = sorted([1000.0, 1400.0, 9000.0, 200.0, 210.0] + [50_000.0] * 5)
    assert predicted(sweep(finished_siblings=2)) == (alice[4] + alice[5]) / 2


def test_siblings_of_another_size_do_not_count():
    c = (
        with_history()
        .history("vision", "resnet50-seed7", 8, 10.0, user="alice", group=7)
        .history("vision", "resnet50-seed8", 8, 10.0, user="alice", group=7)
        .history("vision", "resnet50-seed9", 8, 10.0, user="alice", group=7)
        .pending(1, "vision", 4, name="resnet50-seed99", user="alice", group=7)
    )
    assert predicted(c) == 1400.0
