"""/api/v1/: the user-facing REST API. Authorization lives in controlplane.permissions."""

from django.urls import include, path
from rest_framework.routers import DefaultRouter

from controlplane.cluster.api.views import (
    GpuClaimConflictViewSet,
    GpuViewSet,
    JoinTokenViewSet,
    NodeViewSet,
    PoolViewSet,
)
from controlplane.jobs.api.views import JobViewSet
from controlplane.tenancy.api.views import (
    ApiTokenViewSet,
    BudgetViewSet,
    InvitationViewSet,
    MembershipViewSet,
    QuotaViewSet,
    TenantViewSet,
)

router = DefaultRouter()
router.register("tenants", TenantViewSet, basename="tenant")
router.register("memberships", MembershipViewSet, basename="membership")
router.register("invitations", InvitationViewSet, basename="invitation")
router.register("quotas", QuotaViewSet, basename="quota")
router.register("budgets", BudgetViewSet, basename="budget")
router.register("pools", PoolViewSet, basename="pool")
router.register("nodes", NodeViewSet, basename="node")
router.register("gpus", GpuViewSet, basename="gpu")
router.register("jobs", JobViewSet, basename="job")
router.register("join-tokens", JoinTokenViewSet, basename="join-token")
router.register("gpu-claim-conflicts", GpuClaimConflictViewSet, basename="gpu-claim-conflict")
router.register("api-tokens", ApiTokenViewSet, basename="api-token")

urlpatterns = [path("", include(router.urls))]
