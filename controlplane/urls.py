from django.contrib import admin
from django.http import HttpRequest, HttpResponseRedirect
from django.templatetags.static import static
from django.urls import include, path
from django.views.decorators.cache import cache_control
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView


@cache_control(max_age=86400, public=True)
def favicon(request: HttpRequest) -> HttpResponseRedirect:
    """Browsers ask for /favicon.ico on pages without a <link rel=icon>, such as a job's plain
    text log: they get the icon the HTML pages name, instead of a 404 in every log."""
    return HttpResponseRedirect(static("frontend/favicon.svg"))


urlpatterns = [
    path("favicon.ico", favicon),
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
