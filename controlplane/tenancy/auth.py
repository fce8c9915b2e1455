"""Bearer-token authentication for people's automation (not for agents: see cluster.agent_auth).

The token's scopes are enforced here, at the one place every user-API request passes with a
token, so no view can forget them: a token without `write` may only use safe methods (GET, HEAD,
OPTIONS) on every endpoint. Failed checks are counted per client address and answered 429 past
the `bearer_failure` rate (controlplane.tenancy.throttling).
"""

from django.utils import timezone
from rest_framework import authentication, exceptions
from rest_framework.permissions import SAFE_METHODS

from controlplane.tenancy import reads
from controlplane.tenancy.models import ApiToken, TokenScope, hash_token
from controlplane.tenancy.throttling import bearer_failures, client_ip

# How stale a token's last_used_at may be: it is written at most once per this many seconds.
LAST_USED_RESOLUTION_S = 60.0


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode(errors="replace")
        if not header:
            return None
        parts = header.split()
        if len(parts) != 2 or parts[0] != self.keyword:
            return None
        ip = client_ip(request)
        if bearer_failures.full(bearer_failures.count(ip)):
            raise exceptions.Throttled(
                wait=bearer_failures.retry_after_s(),
                detail="Too many invalid tokens from your address; try again later.",
            )
        # A write reads the person's roles with the token (a submit checks them at once); a
        # read, most requests, needs none.
        token = self._token(parts[1], with_memberships=request.method not in SAFE_METHODS)
        if token is None or not token.is_usable or not token.user.is_active:
            bearer_failures.add(ip)
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid token.")
        if not token.is_usable:
            raise exceptions.AuthenticationFailed("Token revoked or expired.")
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("User inactive.")
        if request.method not in SAFE_METHODS and not token.allows(TokenScope.WRITE):
            raise exceptions.PermissionDenied(
                f"This token may only read (scopes: {', '.join(token.scopes)}); "
                "use a token with the write scope to change anything."
            )
        now = timezone.now()
        last_used_at = token.last_used_at
        if last_used_at is None or (now - last_used_at).total_seconds() >= LAST_USED_RESOLUTION_S:
            # A write and a commit on every request would cost more than the rest of a submit;
            # "last used" is for spotting stale tokens, which a minute's resolution serves.
            ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        return token.user, token

    @staticmethod
    def _token(raw: str, *, with_memberships: bool) -> ApiToken | None:
        if not raw.startswith("gcp_"):
            # Node tokens (gcpn_), join tokens (gcpj_) and anything else are not user credentials.
            return None
        return reads.token_with_user(hash_token(raw), with_memberships=with_memberships)

    def authenticate_header(self, request):
        return self.keyword
