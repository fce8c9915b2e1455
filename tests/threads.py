"""Fakes of process-wide functions that only the test's own thread sees."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def in_this_thread(fake: Callable[..., Any], real: Callable[..., Any]) -> Callable[..., Any]:
    """`fake` for calls from the thread that makes it, `real` for every other thread.

    time.sleep is one function for the whole process: patched outright, it is patched for
    the background threads too (the HTTP metrics flusher sleeps between flushes), which then
    spin, record sleeps the test did not make, or die on an assertion meant for the test.
    """
    owner = threading.current_thread()

    def chosen(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is owner:
            return fake(*args, **kwargs)
        return real(*args, **kwargs)

    return chosen
