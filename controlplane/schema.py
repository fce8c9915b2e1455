"""The OpenAPI schema states every answer an operation can give, errors included.

drf-spectacular documents the success answer and whatever a view declares with
`extend_schema`. The error answers follow from rules that hold for every endpoint alike
(controlplane.permissions): so they are derived here from the same declarations the views are
authorized by, and a client generated from the schema (or schemathesis) meets no status code
the schema did not announce.
"""

from __future__ import annotations

from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class ErrorSerializer(serializers.Serializer):
    """DRF's error body: `detail` for the request as a whole, else field name -> messages."""

    detail = serializers.CharField(required=False)

    class Meta:
        ref_name = "Error"


class ControlPlaneAutoSchema(AutoSchema):
    def _get_response_bodies(self, direction="response"):
        responses = super()._get_response_bodies(direction)
        if direction != "response":
            return responses
        for code, description in self._error_answers().items():
            if str(code) not in responses:
                responses[str(code)] = self._get_response_for_code(
                    OpenApiResponse(ErrorSerializer, description=description), str(code)
                )
        return responses

    def _error_answers(self) -> dict[int, str]:
        view = self.view
        action = getattr(view, "action", None)
        answers = {
            # Every operation validates its query parameters (and its body, if it has one).
            400: "Invalid input: the body names each field at fault",
            401: "No credentials, or credentials that are not (or no longer) valid",
            429: "Too many requests; retry after the time in Retry-After",
        }
        need_for_action = getattr(view, "need_for_action", None)
        need = need_for_action() if need_for_action is not None else None
        if self.method not in SAFE_METHODS or need is None or need.role == "staff":
            # A write: a role too low in the object's tenant, a read-only token. A read: one
            # for cluster admins only. (Every role may read what its tenant owns; reads of
            # other tenants' objects are 404.)
            answers[403] = "Your role, or your token's scope, does not allow this"
        if "{" in self.path or self._creates_in_a_tenant(view, action):
            # Unknown objects and other tenants' objects (or a create naming such a tenant).
            answers[404] = "No such object, or not one you may see"
        if self._may_conflict(view, action):
            answers[409] = "The request conflicts with the object's current state"
        return answers

    @staticmethod
    def _may_conflict(view, action) -> bool:
        from controlplane.permissions import ScopedCreateMixin, ScopedDestroyMixin

        # A create racing an identical one; a delete of an object others still reference; and
        # whatever else a view declares (`conflict_actions`).
        return (
            (action == "create" and isinstance(view, ScopedCreateMixin))
            or (action == "destroy" and isinstance(view, ScopedDestroyMixin))
            or action in getattr(view, "conflict_actions", ())
        )

    @staticmethod
    def _creates_in_a_tenant(view, action) -> bool:
        from controlplane.permissions import TenantScope

        return action == "create" and isinstance(getattr(view, "scope", None), TenantScope)
