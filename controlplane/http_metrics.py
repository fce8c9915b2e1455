"""Request rate and latency by URL pattern, recorded for /metrics (controlplane.event_metrics).

First in MIDDLEWARE, so its time covers the whole stack (sessions, authentication, CSRF) and it
sees every answer, including those another middleware gives before any view runs.

Labelled by the URL pattern that matched (`/api/v1/jobs/<pk>/`), never by the path: one series
per pattern, however many ids are asked for. A request no pattern matched is `unmatched` (a
scanner's thousand paths are one series), a file WhiteNoise served is `static`. Methods outside
HTTP's usual few are `other`, since a client may send any word there.

The agents' heartbeats and watches reach none of this: controlplane.cluster.agent_wsgi answers
them before Django, to keep the hottest request of the system free of per-request costs, and a
watch is a long poll whose duration says nothing of latency. Their volume is the nodes' count
times the heartbeat rate; gpucp_node_ready says whether each node answers.
"""

from __future__ import annotations

import functools
import re
import time

from django.conf import settings

from controlplane import event_metrics

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
UNMATCHED = "unmatched"
STATIC = "static"

_NAMED_GROUP = re.compile(r"\(\?P<(\w+)>")
_CONVERTER = re.compile(r"<\w+:(\w+)>")


@functools.lru_cache(maxsize=1024)
def route_label(route: str) -> str:
    """The pattern as a person writes it: `/api/v1/jobs/<pk>/` for DRF's router's regex
    `api/v1/jobs/(?P<pk>[^/.]+)/$` and for a path converter's `jobs/<int:pk>/` alike."""
    out, i = [], 0
    while (match := _NAMED_GROUP.search(route, i)) is not None:
        out.append(route[i : match.start()])
        out.append(f"<{match.group(1)}>")
        # Skip the group's own pattern, which may hold parentheses of its own.
        depth, j = 1, match.end()
        while j < len(route) and depth:
            if route[j] == "\\":
                j += 1
            elif route[j] == "[":  # a class may hold a parenthesis unescaped: skip it whole
                j = route.find("]", j + 2)
                j = len(route) if j < 0 else j
            elif route[j] == "(":
                depth += 1
            elif route[j] == ")":
                depth -= 1
            j += 1
        i = j
    out.append(route[i:])
    text = _CONVERTER.sub(r"<\1>", "".join(out))
    text = text.replace("^", "").replace("$", "").replace("\\.", ".").replace("/?", "/")
    return "/" + text.lstrip("/")


def request_route(request) -> str:
    match = getattr(request, "resolver_match", None)
    if match is not None and match.route is not None:
        return route_label(match.route)
    if request.path.startswith(settings.STATIC_URL):
        return STATIC
    return UNMATCHED


class RequestMetricsMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        began = time.perf_counter()
        response = self.get_response(request)
        if event_metrics.enabled():
            method = request.method if request.method in METHODS else "other"
            event_metrics.record_http_request(
                method,
                request_route(request),
                response.status_code,
                time.perf_counter() - began,
            )
        return response
