"""Loaded by the schemathesis process the API fuzz test starts (PYTHONPATH), and by no other.

CPython 3.11's AST constructor keeps its recursion depth in per-interpreter state, so two
threads parsing at once can fail with "SystemError: AST constructor recursion depth mismatch"
(python/cpython#106905). Schemathesis's two workers both describe Hypothesis filters, which
parses lambda sources with ast.parse: one parse at a time keeps a CPython bug from failing a
run of our API. Nothing of the server is touched.
"""

import ast
import threading

_parse = ast.parse
_lock = threading.Lock()


def _parse_one_at_a_time(*args, **kwargs):
    with _lock:
        return _parse(*args, **kwargs)


ast.parse = _parse_one_at_a_time
