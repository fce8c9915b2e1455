from django.contrib.auth import views as auth_views
from django.urls import include, path

from frontend import arrays, audit, invitations, nodes, views, volumes

urlpatterns = [
    path(
        "login/",
        auth_views.LoginView.as_view(
            template_name="frontend/login.html", redirect_authenticated_user=True
        ),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", views.home, name="home"),
    path("t/<slug:slug>/", views.tenant_dashboard, name="tenant-dashboard"),
    path("t/<slug:slug>/members/", views.tenant_members, name="tenant-members"),
    path("memberships/<int:pk>/", views.membership_change, name="membership-change"),
    path("invitations/", invitations.my_invitations, name="my-invitations"),
    path(
        "invitations/<int:pk>/<slug:verb>/",
        invitations.invitation_answer,
        name="invitation-answer",
    ),
    path("jobs/", views.job_list, name="job-list"),
    path("jobs/new/", views.job_submit, name="job-submit"),
    path("jobs/new/preview/", views.job_submit_preview, name="job-submit-preview"),
    path("jobs/<int:pk>/", views.job_detail, name="job-detail"),
    path("jobs/<int:pk>/live/", views.job_live, name="job-live"),
    path("jobs/<int:pk>/log/", views.job_log, name="job-log"),
    path("jobs/<int:pk>/output/", views.job_output, name="job-output"),
    path("jobs/<int:pk>/cancel/", views.job_cancel, name="job-cancel"),
    path("arrays/", arrays.array_list, name="array-list"),
    path("arrays/<int:pk>/", arrays.array_detail, name="array-detail"),
    path("arrays/<int:pk>/cancel/", arrays.array_cancel, name="array-cancel"),
    path("tokens/", views.tokens, name="tokens"),
    path("tokens/<int:pk>/revoke/", views.token_revoke, name="token-revoke"),
    path("cluster/", views.cluster_overview, name="cluster-overview"),
    path("cluster/nodes/", nodes.node_list, name="node-list"),
    path("cluster/nodes/<str:name>/", views.node_detail, name="node-detail"),
    path("cluster/nodes/<str:name>/<slug:verb>/", views.node_action, name="node-action"),
    path("manage/tenants/", views.manage_tenants, name="manage-tenants"),
    path("manage/tenants/new/", views.tenant_create, name="manage-tenant-create"),
    path("manage/tenants/<slug:slug>/", views.tenant_edit, name="manage-tenant"),
    path("manage/tenants/<slug:slug>/quotas/new/", views.quota_create, name="manage-quota-create"),
    path("manage/quotas/<int:pk>/", views.quota_edit, name="manage-quota"),
    path("manage/quotas/<int:pk>/delete/", views.quota_delete, name="manage-quota-delete"),
    path(
        "manage/tenants/<slug:slug>/budgets/new/", views.budget_create, name="manage-budget-create"
    ),
    path("manage/budgets/<int:pk>/", views.budget_edit, name="manage-budget"),
    path("manage/budgets/<int:pk>/delete/", views.budget_delete, name="manage-budget-delete"),
    path("manage/pools/", views.manage_pools, name="manage-pools"),
    path("manage/audit/", audit.audit_list, name="manage-audit"),
    path("manage/volumes/", volumes.manage_volumes, name="manage-volumes"),
    path("manage/volumes/new/", volumes.volume_create, name="manage-volume-create"),
    path("manage/volumes/<slug:name>/", volumes.volume_edit, name="manage-volume"),
    path("manage/volumes/<slug:name>/delete/", volumes.volume_delete, name="manage-volume-delete"),
    path("volumes/", volumes.my_volumes, name="my-volumes"),
    path("", include("frontend.whatif_urls")),
]
