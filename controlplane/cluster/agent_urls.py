"""The agent API (docs/agent-protocol.md), mounted at /api/agent/v1/."""

from django.urls import path

from controlplane.cluster import agent_api

app_name = "agent"

urlpatterns = [
    path("register", agent_api.register, name="register"),
    path("heartbeat", agent_api.heartbeat, name="heartbeat"),
    path("watch", agent_api.watch, name="watch"),
    path("logs", agent_api.logs, name="logs"),
    path("volumes", agent_api.volumes, name="volumes"),
]
