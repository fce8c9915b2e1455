from django.apps import AppConfig
from django.db.backends.signals import connection_created


def _tune_sqlite(sender, connection, **kwargs):
    """The embedded mode serves web requests, the agent API and the loop from threads.

    WAL lets readers carry on while one thread writes; synchronous=NORMAL is safe under WAL
    and spares an fsync per commit. Both only matter on SQLite.
    """
    if connection.vendor != "sqlite":
        return
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")


class SchedulingConfig(AppConfig):
    name = "controlplane.scheduling"
    label = "scheduling"

    def ready(self):
        connection_created.connect(_tune_sqlite, dispatch_uid="gpucp-sqlite-wal")
