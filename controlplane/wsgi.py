import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
application = get_wsgi_application()

# Heartbeats skip Django's middleware stack (see controlplane.cluster.agent_wsgi).
from controlplane.cluster.agent_wsgi import with_agent_shortcut  # noqa: E402

application = with_agent_shortcut(application)
