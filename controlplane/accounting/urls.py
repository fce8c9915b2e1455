from django.urls import path

from controlplane.accounting import views

urlpatterns = [
    path("api/v1/accounting/usage/", views.UsageView.as_view(), name="accounting-usage"),
    path("api/v1/accounting/usage.csv", views.UsageCsvView.as_view(), name="accounting-usage-csv"),
    path("metrics", views.metrics_view, name="metrics"),
]
