"""A submit whose only fault is naming jobs or arrays the caller cannot see answers 404."""

from __future__ import annotations

from rest_framework import exceptions, status

from controlplane.jobs import dependencies


class UnknownDependency(exceptions.APIException):
    status_code = status.HTTP_404_NOT_FOUND
    default_code = "not_found"


class UnknownTargetsAreNotFound:
    """For the submitting viewsets: the body named, in `depends_on`, a job or an array that is
    unknown or another tenant's, and nothing else was wrong. That is a 404 as a URL naming such
    an object is, with the same body a 400 would have (the field at fault, named), and the
    same answer for unknown and foreign ids."""

    def handle_exception(self, exc):
        if isinstance(exc, exceptions.ValidationError) and dependencies.refers_only_to_unknown(
            exc.detail
        ):
            exc = UnknownDependency(exc.detail)
        return super().handle_exception(exc)  # type: ignore[misc]
