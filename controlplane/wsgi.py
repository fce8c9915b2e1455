import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
application = get_wsgi_application()

# The query parameters every /api/v1/ request is checked against come from the OpenAPI schema,
# built once per process: here, not in the first request (about half a second of it).
from controlplane.api import warm_query_parameters  # noqa: E402

warm_query_parameters()

# Heartbeats skip Django's middleware stack (see controlplane.cluster.agent_wsgi).
from controlplane.cluster.agent_wsgi import with_agent_shortcut  # noqa: E402

application = with_agent_shortcut(application)
