"""The moe-swarm error tree (pure: no I/O).

Rules:
- Every error raised by our code on purpose is a ``SwarmError``.
- Foreign exceptions are translated at the boundary: ``raise Ours(...) from exc``.
- Every error carries a stable machine-readable ``code`` (used in HTTP error bodies and in error
  frames on libp2p); the message is for people.

Hierarchy::

    SwarmError
    ├── ConfigError                 bad flags, files or settings
    ├── ModelError                  a GGUF we cannot load
    │   ├── UnsupportedArchitecture
    │   └── UnsupportedTensorType
    ├── TokenizerError
    ├── SliceError                  a slice that cannot be cut, fetched or verified
    ├── ProtocolError               a peer broke the wire protocol
    │   ├── LocalProtocolError      we were about to send something invalid
    │   └── RemoteProtocolError     the peer sent something invalid (or an error frame)
    ├── TransportError
    │   ├── ClosedError
    │   ├── BrokenError
    │   └── TransportTimeout
    └── RequestError                an API request that is invalid (-> HTTP 4xx)
"""

from __future__ import annotations

__all__ = [
    "BrokenError",
    "ClosedError",
    "ConfigError",
    "LocalProtocolError",
    "ModelError",
    "ProtocolError",
    "RemoteProtocolError",
    "RequestError",
    "SliceError",
    "SwarmError",
    "TokenizerError",
    "TransportError",
    "TransportTimeout",
    "UnsupportedArchitecture",
    "UnsupportedTensorType",
]


class SwarmError(Exception):
    """Base of every error moe-swarm raises on purpose."""

    code: str = "swarm_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class ConfigError(SwarmError):
    code = "config_error"


class ModelError(SwarmError):
    code = "model_error"


class UnsupportedArchitecture(ModelError):
    code = "unsupported_architecture"


class UnsupportedTensorType(ModelError):
    code = "unsupported_tensor_type"


class TokenizerError(SwarmError):
    code = "tokenizer_error"


class SliceError(SwarmError):
    code = "slice_error"


class ProtocolError(SwarmError):
    code = "protocol_error"


class LocalProtocolError(ProtocolError):
    code = "local_protocol_error"


class RemoteProtocolError(ProtocolError):
    code = "remote_protocol_error"


class TransportError(SwarmError):
    code = "transport_error"


class ClosedError(TransportError):
    code = "closed"


class BrokenError(TransportError):
    code = "broken"


class TransportTimeout(TransportError):
    code = "timeout"


class RequestError(SwarmError):
    """An invalid API request; ``status`` is the HTTP status to answer with."""

    code = "invalid_request_error"

    def __init__(self, message: str, *, code: str | None = None, status: int = 400, param: str | None = None) -> None:
        super().__init__(message, code=code)
        self.status = status
        self.param = param
