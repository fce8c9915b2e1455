from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", include("controlplane.api_urls")),
    path("api/agent/v1/", include("controlplane.cluster.agent_urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    # The split view serves its start-up script as a file (?script): the CSP forbids inline ones.
    path(
        "api/docs/",
        SpectacularSwaggerSplitView.as_view(
            url_name="schema", template_name="frontend/api_docs.html"
        ),
        name="api-docs",
    ),
    path("", include("controlplane.accounting.urls")),
    path("", include("frontend.urls")),
]
