"""Logging filters named in settings.LOGGING."""

from __future__ import annotations

import logging


class ClientErrorsWithoutTraceback(logging.Filter):
    """A 4xx answer (a 403 for a page someone may not see, a 404) is the client's mistake, not
    the server's: Django logs it with the exception that made it, and its traceback buried the
    console of the embedded mode. The line stays; the traceback goes. 5xx keep theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", None)
        if isinstance(status, int) and 400 <= status < 500:
            record.exc_info = None
            record.exc_text = None
        return True
