"""Names and bodies the API tests share."""

ROLES = ("anonymous", "other_tenant", "viewer", "member", "tenant_admin", "cluster_admin")


def job_body(**overrides) -> dict:
    body = {
        "tenant": "vision",
        "name": "train",
        "image": "registry.local/team/train:1",
        "command": ["python", "train.py"],
        "gpus": 1,
        "gpu_type": "H100-SXM-80GB",
    }
    body.update(overrides)
    return body


def results(response) -> list:
    """The rows of a list answer, paginated or not."""
    data = response.json()
    return data["results"] if isinstance(data, dict) and "results" in data else data
