"""Bearer-token authentication for people's automation (not for agents: see cluster.agent_auth)."""

from django.utils import timezone
from rest_framework import authentication, exceptions

from controlplane.tenancy.models import ApiToken, hash_token


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode(errors="replace")
        if not header:
            return None
        parts = header.split()
        if len(parts) != 2 or parts[0] != self.keyword:
            return None
        raw = parts[1]
        if not raw.startswith("gcp_"):
            # Node tokens (gcpn_) and anything else are not user credentials.
            raise exceptions.AuthenticationFailed("Invalid token.")
        try:
            token = ApiToken.objects.select_related("user").get(token_hash=hash_token(raw))
        except ApiToken.DoesNotExist:
            raise exceptions.AuthenticationFailed("Invalid token.") from None
        if not token.is_usable:
            raise exceptions.AuthenticationFailed("Token revoked or expired.")
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("User inactive.")
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
        return token.user, token

    def authenticate_header(self, request):
        return self.keyword
