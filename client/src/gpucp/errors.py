"""The exceptions the SDK raises: one class per kind of refusal, each carrying the API's words.

A 400 names every field at fault (`{"gpus": ["..."]}`, for a list of jobs `{"1": {"gpus":
[...]}}`); `field_errors` holds them flattened to dotted names (`gpus`, `1.gpus`,
`mounts.0.target`) and `str()` of the exception is one line that names them.
"""

from __future__ import annotations

from typing import Any

NON_FIELD = "non_field_errors"


class GpucpError(Exception):
    """Anything the SDK raises."""


class ConnectionFailed(GpucpError):
    """The control plane could not be reached (after the retries allowed)."""


class WaitTimeout(GpucpError):
    """A wait ran past its timeout; the job is still going."""


class ApiError(GpucpError):
    """The API refused a request. `status`: the HTTP status; `body`: the decoded answer."""

    status: int = 0

    def __init__(self, status: int, body: Any, method: str = "", url: str = ""):
        self.status = status
        self.body = body
        self.method = method
        self.url = url
        self.field_errors: dict[str, list[str]] = flatten_errors(body)
        super().__init__(self.one_line())

    @property
    def detail(self) -> str:
        """The refusal in words: the API's `detail`, or the field errors in one line."""
        if isinstance(self.body, dict) and isinstance(self.body.get("detail"), str):
            return str(self.body["detail"])
        if self.field_errors:
            return "; ".join(
                f"{name}: {' '.join(messages)}" if name != NON_FIELD else " ".join(messages)
                for name, messages in self.field_errors.items()
            )
        if isinstance(self.body, str) and self.body.strip():
            return self.body.strip().splitlines()[0][:300]
        return f"HTTP {self.status}"

    def one_line(self) -> str:
        return " ".join(self.detail.split())


class BadRequest(ApiError):
    """400: the request's fields (named in `field_errors`) are not acceptable."""


class Unauthorized(ApiError):
    """401: no token, or one that is unknown, expired or revoked."""


class Forbidden(ApiError):
    """403: your role (or your token's scopes) does not allow this."""


class NotFound(ApiError):
    """404: no such object, or not one of your tenants'."""


class Conflict(ApiError):
    """409: the object's state does not allow it (say, cancelling a finished job)."""


class IdempotencyKeyReused(ApiError):
    """422: this Idempotency-Key was used before with another body."""


class RateLimited(ApiError):
    """429: too many requests; `retry_after_s` says when to try again, when the API says."""

    retry_after_s: float | None = None


class ServerError(ApiError):
    """5xx: the control plane failed (503: it is unavailable for now)."""


_BY_STATUS: dict[int, type[ApiError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    422: IdempotencyKeyReused,
    429: RateLimited,
}


def error_for(status: int, body: Any, method: str = "", url: str = "") -> ApiError:
    cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else ApiError)
    return cls(status, body, method, url)


def flatten_errors(body: Any, prefix: str = "") -> dict[str, list[str]]:
    """{"dotted.name": [messages]} of a DRF error body; {} when it is not one."""
    found: dict[str, list[str]] = {}
    if isinstance(body, dict):
        for key, value in body.items():
            if key == "detail" and not prefix and isinstance(value, str):
                continue
            name = f"{prefix}.{key}" if prefix else str(key)
            if prefix and key == NON_FIELD:
                name = prefix
            found.update(flatten_errors(value, name))
    elif isinstance(body, list):
        if all(isinstance(item, str) for item in body):
            if body:
                found[prefix or NON_FIELD] = [str(item) for item in body]
        else:
            for i, item in enumerate(body):
                if item:
                    found.update(flatten_errors(item, f"{prefix}.{i}" if prefix else str(i)))
    elif isinstance(body, str) and prefix:
        found[prefix] = [body]
    return found
