"""gunicorn's own lines in LOG_FORMAT: `--logger-class=controlplane.gunicorn_logging.Logger`.

gunicorn writes its lines (it starts, a worker boots or times out, and the access log when
--access-logfile asks for one) through handlers of its own, not through settings.LOGGING. With
this class, which the Dockerfile and docker-compose.yml name, they are JSON when the rest of the
web process's lines are (agents.logcontext); in plain they keep gunicorn's own format.

Read from the environment, not from Django's settings: gunicorn's master process sets up its
logging before, and without, loading the application.
"""

from __future__ import annotations

import os

from gunicorn.glogging import Logger as GunicornLogger  # type: ignore[import-untyped]  # no stubs

from agents.logcontext import JsonFormatter, check_format


class Logger(GunicornLogger):
    def setup(self, cfg) -> None:
        # An unknown LOG_FORMAT stops gunicorn at start, as it stops every other process.
        log_format = check_format(os.environ.get("LOG_FORMAT") or "plain")
        super().setup(cfg)
        if log_format != "json":
            return
        for logger in (self.error_log, self.access_log):
            for handler in logger.handlers:
                handler.setFormatter(JsonFormatter())
