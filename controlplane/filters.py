"""Query filters of the user API: refuse what they cannot use instead of ignoring it.

- `FilterSet` is the base of every filterset (controlplane/*/filtersets.py). Its form turns
  every date-time into UTC before any query (PostgreSQL refuses offsets past 15:59, and Python
  overflows converting 0001-01-01T00:00-19:35), refusing with a 400 naming the parameter the
  ones that fall outside the years 1 to 9999 in UTC; and a yes/no filter given anything but
  true or false is a 400, not "no filter".
- `OrderingFilter` answers 400 for an `ordering` it cannot sort by (DRF's drops it silently),
  and the schema lists the values it can.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import django_filters.rest_framework
from django import forms
from rest_framework import exceptions
from rest_framework import filters as drf_filters

from controlplane.validators import INT64_MAX, INT64_MIN


class BoundedValuesForm(forms.Form):
    """Mixed into each filterset's form: values as the database can take them, or an error."""

    def clean(self):
        cleaned = super().clean()
        for name, value in list(cleaned.items()):
            try:
                cleaned[name] = _bounded(value)
            except ValueError as exc:
                self.add_error(name, str(exc))
                continue
            field = self.fields.get(name)
            raw = self.data.get(self.add_prefix(name))
            if isinstance(field, forms.NullBooleanField) and value is None and raw:
                self.add_error(name, "Must be true or false.")
        return cleaned


def _bounded(value):
    if isinstance(value, slice):  # range filters: a (start, stop) pair
        return slice(_bounded(value.start), _bounded(value.stop))
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.UTC)
        try:
            return value.astimezone(dt.UTC)
        except OverflowError:
            raise ValueError(
                f"{value.isoformat()} is out of range: in UTC it falls outside the years 1 to 9999."
            ) from None
    if isinstance(value, int | Decimal) and not isinstance(value, bool):
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"Must lie between {INT64_MIN} and {INT64_MAX}.")
    return value


class FilterSet(django_filters.rest_framework.FilterSet):
    """Base of every filterset of the API (a test checks that each one derives from it)."""

    def get_form_class(self):
        base = super().get_form_class()
        return type(f"{type(self).__name__}Form", (BoundedValuesForm, base), {})


class OrderingFilter(drf_filters.OrderingFilter):
    ordering_description = (
        "Sort by these fields, comma-separated; a leading '-' sorts that field descending."
    )

    def get_ordering(self, request, queryset, view):
        raw = request.query_params.get(self.ordering_param)
        if not raw:
            return self.get_default_ordering(view)
        terms = [term.strip() for term in raw.split(",")]
        valid = [name for name, _ in self.get_valid_fields(queryset, view, {"request": request})]
        wrong = [term for term in terms if term.removeprefix("-") not in valid]
        if wrong:
            choices = ", ".join(valid)
            raise exceptions.ValidationError(
                {
                    self.ordering_param: [
                        f"Cannot sort by {', '.join(repr(t) for t in wrong)}; sort by any of "
                        f"{choices} (with '-' for descending), comma-separated."
                    ]
                }
            )
        return terms

    def get_schema_operation_parameters(self, view):
        fields = getattr(view, "ordering_fields", None)
        if not isinstance(fields, list | tuple) or not all(isinstance(f, str) for f in fields):
            return super().get_schema_operation_parameters(view)
        return [
            {
                "name": self.ordering_param,
                "required": False,
                "in": "query",
                "description": self.ordering_description,
                # OpenAPI's word for a comma-separated list in one parameter.
                "style": "form",
                "explode": False,
                "schema": {
                    "type": "array",
                    "items": {
                        "type": "string",
                        "enum": [t for f in fields for t in (f, f"-{f}")],
                    },
                },
            }
        ]
