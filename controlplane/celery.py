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


@signals.task_prerun.connect
def connections_fit_for_the_task(task=None, **kwargs) -> None:
    """Keep the worker's database connections across tasks, as Django keeps a web thread's
    across requests (CELERY_DB_REUSE_MAX in settings.py stops Celery's closing): close one
    that broke or aged past CONN_MAX_AGE, and check a kept one with a round trip, so that a
    task after a PostgreSQL restart connects again instead of failing on the dead socket.
    An eager task (tests) runs inside its caller's transaction: its connection is the
    caller's to manage."""
    if task is None or getattr(task.request, "is_eager", False):
        return
    from django.db import close_old_connections, connections

    close_old_connections()
    for conn in connections.all(initialized_only=True):
        if conn.connection is not None and not conn.is_usable():
            conn.close()


@signals.task_postrun.connect
def close_spent_connections(task=None, **kwargs) -> None:
    """After a task, close what Django would close after a request: a connection that broke,
    was left outside autocommit, or aged past CONN_MAX_AGE."""
    if task is None or getattr(task.request, "is_eager", False):
        return
    from django.db import close_old_connections

    close_old_connections()
