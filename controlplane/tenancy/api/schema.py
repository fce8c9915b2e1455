"""How the OpenAPI schema describes the API's bearer tokens (registered by importing this)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.tenancy.auth.BearerTokenAuthentication"
    name = "bearerAuth"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A personal API token (gcp_...), issued by POST /api/v1/api-tokens/.",
        }
