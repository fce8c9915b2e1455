"""Pages of every list endpoint: `limit` (1 to MAX_PAGE_SIZE) and `offset`, or a 400 naming them.

DRF's own LimitOffsetPagination ignores a limit it cannot read (the whole default page comes
back) and passes any offset to the database, where one past a bigint is a server error. Here a
limit or offset that is not a whole number in range is refused, and the schema says the range.
A limit above the maximum is refused too rather than quietly cut: a client that asked for
everything should learn it did not get it.
"""

from __future__ import annotations

import re

from rest_framework import exceptions, pagination

from controlplane.validators import INT64_MAX

MAX_PAGE_SIZE = 1000

_WHOLE_NUMBER = re.compile(r"[0-9]{1,19}")


class LimitOffsetPagination(pagination.LimitOffsetPagination):
    max_limit = MAX_PAGE_SIZE

    def get_limit(self, request):
        raw = request.query_params.get(self.limit_query_param)
        if raw in (None, ""):
            return self.default_limit
        return _whole_number(
            self.limit_query_param,
            raw,
            1,
            self.max_limit,
            f"Must be a whole number from 1 to {self.max_limit} (the most one page holds); "
            "page through the rest with offset.",
        )

    def get_offset(self, request):
        raw = request.query_params.get(self.offset_query_param)
        if raw in (None, ""):
            return 0
        return _whole_number(
            self.offset_query_param, raw, 0, INT64_MAX, "Must be a whole number, 0 or more."
        )

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            schema = parameter["schema"]
            if parameter["name"] == self.limit_query_param:
                schema.update(minimum=1, maximum=self.max_limit)
                parameter["description"] = (
                    f"Results per page, 1 to {self.max_limit}; {self.default_limit} by default."
                )
            elif parameter["name"] == self.offset_query_param:
                schema.update(minimum=0, maximum=INT64_MAX)
        return parameters


def _whole_number(name: str, raw: str, low: int, high: int, message: str) -> int:
    value = int(raw) if _WHOLE_NUMBER.fullmatch(raw) else None
    if value is None or not low <= value <= high:
        raise exceptions.ValidationError({name: [message]})
    return value
