"""The Python SDK and the `gpucp` command of the GPU control plane (see docs/cli.md).

from gpucp import Client
gpucp = Client("https://gpucp.example.org", token="gpucp_...")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from gpucp.client import Client
    from gpucp.errors import (
        ApiError,
        BadRequest,
        ConnectionFailed,
        Forbidden,
        GpucpError,
        NotFound,
        Unauthorized,
        WaitTimeout,
    )

__all__ = [
    "ApiError",
    "BadRequest",
    "Client",
    "ConnectionFailed",
    "Forbidden",
    "GpucpError",
    "NotFound",
    "Unauthorized",
    "WaitTimeout",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # Imported on first use: `gpucp --help` starts without loading the HTTP client.
    if name == "Client":
        from gpucp.client import Client

        return Client
    if name in __all__:
        from gpucp import errors

        return getattr(errors, name)
    raise AttributeError(f"module 'gpucp' has no attribute {name!r}")
