"""The Celery app. It reads its configuration from Django settings (CELERY_ namespace)."""

import logging
import logging.config
import os

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.setup_logging.connect
def use_settings_logging(loglevel=None, **kwargs) -> None:
    """Worker and beat log as every process of the control plane does (settings.LOGGING:
    LOG_FORMAT, and the ids of the work on each line). Without a receiver of this signal Celery
    replaces the root logger's handlers with its own (worker_hijack_root_logger), and a JSON
    deployment would get text lines from the process that runs the scheduling cycle. Its
    --loglevel still sets the level, as it did."""
    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)
    if loglevel:
        logging.getLogger().setLevel(loglevel)


@signals.celeryd_init.connect
def json_from_the_start(instance=None, **kwargs) -> None:
    """In JSON, what the worker would print before its logging is set up goes through logging
    too, or is left out: the lines a log pipeline could not parse. Its start-up banner is
    printed to stdout, not logged, so it starts as with --quiet; its warnings (running as root,
    say) come before Celery sends them to logging, so they go there now."""
    from django.conf import settings

    if settings.LOG_FORMAT == "json" and instance is not None:
        instance.quiet = True
        logging.captureWarnings(True)
