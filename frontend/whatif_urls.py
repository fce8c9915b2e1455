"""Routes of the what-if pages (cluster admins), included from frontend.urls."""

from django.urls import path

from frontend import whatif_views

urlpatterns = [
    path("manage/whatif/", whatif_views.whatif_list, name="whatif-list"),
    path("manage/whatif/<int:pk>/", whatif_views.whatif_detail, name="whatif-detail"),
    path("manage/whatif/<int:pk>/report.md", whatif_views.whatif_markdown, name="whatif-markdown"),
]
