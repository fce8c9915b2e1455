"""How the SDK reads refusals, and how the CLI reads job files and --set."""

import pytest
from gpucp import errors, jobfile
from gpucp.cli import EXIT_NO_JOB_EXIT_CODE, job_exit_code


@pytest.mark.parametrize(
    ("body", "fields", "line"),
    [
        ({"gpus": ["Must be at least 1."]}, {"gpus": ["Must be at least 1."]}, "gpus: Must"),
        (
            {"mounts": [{}, {"target": ["Absolute path."]}]},
            {"mounts.1.target": ["Absolute path."]},
            "mounts.1.target: Absolute path.",
        ),
        (
            {"1": {"gpus": ["Too many."]}, "non_field_errors": ["Two bad."]},
            {"1.gpus": ["Too many."], "non_field_errors": ["Two bad."]},
            "1.gpus: Too many.; Two bad.",
        ),
        ({"detail": "Not found."}, {}, "Not found."),
        ("<html>proxy\nerror</html>", {}, "<html>proxy"),
    ],
)
def test_refusals_carry_their_field_errors_in_one_line(body, fields, line):
    error = errors.error_for(400 if fields else 404, body)
    assert error.field_errors == fields
    assert str(error).startswith(line) and "\n" not in str(error)


def test_each_status_has_its_exception():
    assert isinstance(errors.error_for(401, {}), errors.Unauthorized)
    assert isinstance(errors.error_for(409, {}), errors.Conflict)
    assert isinstance(errors.error_for(503, {}), errors.ServerError)
    assert isinstance(errors.error_for(418, {}), errors.ApiError)


def test_a_job_file_with_comments_and_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(
        "# a comment\nname: a  # trailing\nimage: img:1\ncommand: python train.py --lr 3e-4\n"
        "env: {DEBUG: 1, FAST: true}\n"
    )
    spec = jobfile.apply_sets(
        jobfile.load(str(path)), ["gpus=4", "env.LR=0001", "command=[sh, -c, 'exit 0']"]
    )
    assert spec == {
        "name": "a",
        "image": "img:1",
        "command": ["sh", "-c", "exit 0"],
        "env": {"DEBUG": "1", "FAST": "true", "LR": "0001"},
        "gpus": 4,
    }
    assert jobfile.load(str(path))["command"] == ["python", "train.py", "--lr", "3e-4"]


@pytest.mark.parametrize(
    ("text", "problem"),
    [("- a\n- b\n", "mapping"), ("a: [\n", "line"), (None, "cannot read")],
)
def test_a_job_file_that_cannot_be_used_is_named(tmp_path, text, problem):
    path = tmp_path / "job.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(jobfile.JobFileError, match=problem):
        jobfile.load(str(path))
    with pytest.raises(jobfile.JobFileError, match="key=value"):
        jobfile.apply_sets({}, ["no-equals-sign"])


@pytest.mark.parametrize(
    ("state", "exit_code", "expected"),
    [
        ("SUCCEEDED", 0, 0),
        ("FAILED", 3, 3),
        ("FAILED", -9, 137),
        ("FAILED", None, EXIT_NO_JOB_EXIT_CODE),
        ("CANCELLED", 143, EXIT_NO_JOB_EXIT_CODE),
    ],
)
def test_wait_ends_with_the_jobs_exit_code(state, exit_code, expected):
    assert job_exit_code({"state": state, "exit_code": exit_code}) == expected
