"""Loaded by the schemathesis process the API fuzz test starts (PYTHONPATH), and by no other.

CPython 3.11's AST constructor keeps its recursion depth in per-interpreter state, so two
threads building or reading Python AST objects at once can fail with "SystemError: AST
constructor recursion depth mismatch" (python/cpython#106905). Schemathesis's two workers do
both: Hypothesis parses lambda sources to describe filters (ast.parse), and a lazy import of
anyio parses its own source (compile(..., ast.PyCF_ONLY_AST)) — a run failed on each. Every
compile that makes or takes an AST goes one at a time, which covers ast.parse too (it calls the
builtin). Plain source-to-bytecode compiles, which touch no AST objects, are left alone. Nothing
of the server is touched.
"""

import ast
import builtins
import threading

_compile = builtins.compile
# Re-entrant: compiling an AST object can import a module that parses again on the same thread.
_lock = threading.RLock()


def _compile_one_ast_at_a_time(source, filename, mode, flags=0, *args, **kwargs):
    if flags & ast.PyCF_ONLY_AST or isinstance(source, ast.AST):
        with _lock:
            return _compile(source, filename, mode, flags, *args, **kwargs)
    return _compile(source, filename, mode, flags, *args, **kwargs)


builtins.compile = _compile_one_ast_at_a_time
