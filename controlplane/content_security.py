"""django-csp's middleware, with the header of a plain response built once.

django-csp builds the Content-Security-Policy header anew for every response: it copies the
policy's parts, merges them with the settings, and joins the directives, about 25 us a
response, for a header that is the same on every response this site serves (no page uses a
nonce or changes the policy per view). Every API answer paid it (heartbeats and watches skip
Django's stack: cluster/agent_wsgi.py).

Here a response that could only get the settings' policy gets it from a cache, built by
django-csp's own `build_policy`, and rebuilt when a test changes the settings. Anything else
(a nonce used by the page, a view's `@csp_update`, `@csp_exempt`, a header already set, DEBUG's
error pages) takes django-csp's own path.
"""

from __future__ import annotations

import functools

from csp.constants import HEADER, HEADER_REPORT_ONLY
from csp.middleware import CheckableLazyObject
from csp.middleware import CSPMiddleware as LibraryCSPMiddleware
from csp.utils import build_policy
from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

# What a view or decorator puts on a response to change its policy (django-csp's names).
_PER_RESPONSE = (
    "_csp_config",
    "_csp_update",
    "_csp_replace",
    "_csp_exempt",
    "_csp_config_ro",
    "_csp_update_ro",
    "_csp_replace_ro",
    "_csp_exempt_ro",
)


@functools.cache
def _policies() -> tuple[tuple[str, tuple[str, ...]], tuple[str, tuple[str, ...]]]:
    """(header, excluded path prefixes) of the enforced policy, then of the report-only one."""
    out = []
    for name, report_only in (
        ("CONTENT_SECURITY_POLICY", False),
        ("CONTENT_SECURITY_POLICY_REPORT_ONLY", True),
    ):
        policy = getattr(settings, name, None) or {}
        excluded = tuple(policy.get("EXCLUDE_URL_PREFIXES", None) or ())
        out.append((build_policy(report_only=report_only), excluded))
    return out[0], out[1]


@receiver(setting_changed)
def _settings_changed(setting: str, **kwargs) -> None:
    if setting.startswith("CONTENT_SECURITY_POLICY"):
        _policies.cache_clear()


class CSPMiddleware(LibraryCSPMiddleware):
    def process_response(self, request, response):
        if (
            settings.DEBUG
            or getattr(request, "_csp_nonce", None) is not None
            or HEADER in response
            or HEADER_REPORT_ONLY in response
            or any(hasattr(response, name) for name in _PER_RESPONSE)
        ):
            return super().process_response(request, response)
        path = request.path_info
        for header, (policy, excluded) in zip(
            (HEADER, HEADER_REPORT_ONLY), _policies(), strict=True
        ):
            if policy and not (excluded and path.startswith(excluded)):
                response[header] = policy
        # As django-csp: a nonce asked for once the header is written is an error, not a nonce
        # the header lacks.
        request.csp_nonce = CheckableLazyObject(self._csp_nonce_post_response)
        return response
