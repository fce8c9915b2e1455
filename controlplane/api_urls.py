"""/api/v1/: the user-facing REST API. Authorization lives in controlplane.permissions."""

from django.urls import include, path
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import APIRootView, DefaultRouter

from controlplane.audit_views import AuditEventViewSet
from controlplane.cluster.api.views import (
    GpuClaimConflictViewSet,
    GpuViewSet,
    JoinTokenViewSet,
    NodeViewSet,
    PoolViewSet,
)
from controlplane.jobs.api.arrays import ArrayViewSet
from controlplane.jobs.api.views import JobViewSet
from controlplane.storage.api.views import VolumeViewSet
from controlplane.tenancy.api.views import (
    ApiTokenViewSet,
    BudgetViewSet,
    InvitationViewSet,
    MembershipViewSet,
    QuotaViewSet,
    TenantViewSet,
)


class ApiRoot(APIRootView):
    """GET /api/v1/: a link to each collection, under /api/v1/.

    DRF's own root reverses each collection's URL name, and the web pages have the same names
    (`job-list`, `node-list`), so it linked a token client to HTML pages behind the login. The
    links are built from the router's prefixes instead, which are exactly the API's paths.
    """

    def get(self, request: Request, *args, **kwargs) -> Response:
        return Response(
            {
                prefix: request.build_absolute_uri(f"{prefix}/")
                for prefix in self.api_root_dict or {}
            }
        )


class Router(DefaultRouter):
    APIRootView = ApiRoot


router = Router()
# Django tries the patterns in order, two per route (with and without a format suffix), so a
# collection registered late costs every one of its requests the failed matches of all before
# it (a submit paid about 0.05 ms for them): the busiest collections come first.
router.register("jobs", JobViewSet, basename="job")
router.register("arrays", ArrayViewSet, basename="array")
router.register("tenants", TenantViewSet, basename="tenant")
router.register("memberships", MembershipViewSet, basename="membership")
router.register("invitations", InvitationViewSet, basename="invitation")
router.register("quotas", QuotaViewSet, basename="quota")
router.register("budgets", BudgetViewSet, basename="budget")
router.register("pools", PoolViewSet, basename="pool")
router.register("nodes", NodeViewSet, basename="node")
router.register("gpus", GpuViewSet, basename="gpu")
router.register("join-tokens", JoinTokenViewSet, basename="join-token")
router.register("audit", AuditEventViewSet, basename="audit")
router.register("gpu-claim-conflicts", GpuClaimConflictViewSet, basename="gpu-claim-conflict")
router.register("api-tokens", ApiTokenViewSet, basename="api-token")
router.register("volumes", VolumeViewSet, basename="volume")

urlpatterns = [path("", include(router.urls))]
