"""The moe-swarm error tree: every exception the project raises on purpose (pure: no I/O).

Rules:
- Every error raised by our code on purpose is a ``SwarmError``; every project exception class is
  defined here, nowhere else.
- Foreign exceptions are translated at the boundary: ``raise Ours(...) from exc``.
- Every error carries a stable machine-readable ``code`` (used in HTTP error bodies and in error
  frames on libp2p); the message is for people.
- A *refusal* (``Refused``: the peer understood a well-formed request and declined it on purpose --
  it is draining, does not hold the slice, does not serve us) is not a protocol breach
  (``RemoteProtocolError``: the peer sent something invalid). Callers retry a refusal elsewhere
  without counting it against the peer's honesty; ``remote_error`` builds the right class from an
  error frame's code.

Hierarchy::

    SwarmError
    ├── ConfigError                 bad flags, files or settings (also: the wrong py-libp2p version)
    ├── ModelError                  a GGUF we cannot load
    │   ├── UnsupportedArchitecture
    │   ├── UnsupportedTensorType
    │   └── KernelError             bad arguments to a native kernel (checked before ggml asserts)
    ├── TokenizerError
    ├── SliceError                  a slice that cannot be cut, fetched or verified
    ├── UnsafePath                  a path built from a peer's string that would leave its directory
    ├── StoreError                  the market's durable store cannot be used
    ├── DispatchFailed              a layer's experts could not be computed anywhere (no replica, not held)
    ├── ProtocolError
    │   ├── LocalProtocolError      we were about to send something invalid
    │   └── RemoteProtocolError     the peer sent something invalid (or an error frame)
    │       └── WireError           a broken expert-stream frame (``fatal``: framing lost)
    │           ├── FrameTooLarge, MalformedHeader, UnexpectedMessage, BadShape, BadIndex,
    │           └── NonFinite, TooManyRows, UnsupportedDtype, VersionMismatch
    ├── Refused                     a well-formed request declined on purpose (not a breach)
    │   ├── Draining                the volunteer is shutting down
    │   ├── SliceNotHeld            the volunteer does not serve that slice
    │   ├── NotAuthorized           the volunteer does not serve this caller (not a coordinator it knows)
    │   └── SliceRefused            a volunteer declined to send slice bytes (``/moe-swarm/slice/1``'s codes)
    ├── TransportError
    │   ├── ClosedError
    │   ├── BrokenError
    │   ├── TransportTimeout
    │   └── DialError               a stream could not be opened
    └── RequestError                an API request that is invalid (-> HTTP 4xx)
        └── IdentityError           a peer id without an Ed25519 key, or a bad signature
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "BadIndex",
    "BadShape",
    "BrokenError",
    "ClosedError",
    "ConfigError",
    "DialError",
    "DispatchFailed",
    "Draining",
    "FrameTooLarge",
    "IdentityError",
    "KernelError",
    "LocalProtocolError",
    "MalformedHeader",
    "ModelError",
    "NonFinite",
    "NotAuthorized",
    "ReceiverBusy",
    "Busy",
    "ProtocolError",
    "Refused",
    "RemoteProtocolError",
    "RequestError",
    "SliceError",
    "SliceNotHeld",
    "SliceRefused",
    "StoreError",
    "SwarmError",
    "TokenizerError",
    "TooManyRows",
    "TransportError",
    "TransportTimeout",
    "UnexpectedMessage",
    "UnsupportedArchitecture",
    "UnsupportedDtype",
    "UnsupportedTensorType",
    "UnsafePath",
    "VersionMismatch",
    "WireError",
    "remote_error",
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


class KernelError(ModelError):
    """Bad arguments to a native kernel, refused before they reach ggml (whose asserts abort)."""

    code = "kernel_error"


class TokenizerError(SwarmError):
    code = "tokenizer_error"


class SliceError(SwarmError):
    code = "slice_error"


class UnsafePath(SwarmError):
    """A file name from the network (a model id, a slice) that is not a plain name, or a path built
    from one that would resolve outside its data directory: refused before anything is created."""

    code = "unsafe_path"


class StoreError(SwarmError):
    code = "store_error"


class DispatchFailed(SwarmError):
    """A range of experts the coordinator does not hold had no replica that answered."""

    code = "dispatch_failed"


class ProtocolError(SwarmError):
    code = "protocol_error"


class LocalProtocolError(ProtocolError):
    code = "local_protocol_error"


class RemoteProtocolError(ProtocolError):
    code = "remote_protocol_error"


class WireError(RemoteProtocolError):
    """The peer broke the wire protocol. ``fatal``: the framing is lost, close the stream.

    ``request_id``/``attempt`` are set when the offending frame could be attributed to a request,
    so the answer can be routed to the caller waiting for it.
    """

    code = "remote_protocol_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        fatal: bool = False,
        request_id: int | None = None,
        attempt: int | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.fatal = fatal
        self.request_id = request_id
        self.attempt = attempt


class FrameTooLarge(WireError):
    code = "frame_too_large"


class ReceiverBusy(WireError):
    """A request whose bytes the receiver would not hold now (its byte budget): answered ``busy``."""

    code = "busy"


class MalformedHeader(WireError):
    code = "malformed_header"


class UnexpectedMessage(WireError):
    code = "unexpected_message"


class BadShape(WireError):
    code = "bad_shape"


class BadIndex(WireError):
    code = "bad_index"


class NonFinite(WireError):
    code = "non_finite"


class TooManyRows(WireError):
    code = "too_many_rows"


class UnsupportedDtype(WireError):
    code = "unsupported_dtype"


class VersionMismatch(WireError):
    code = "version_mismatch"


class Refused(SwarmError):
    """The peer declined a well-formed request on purpose; try elsewhere, it is not a breach."""

    code = "refused"


class Draining(Refused):
    code = "draining"


class SliceNotHeld(Refused):
    code = "slice_not_held"


class NotAuthorized(Refused):
    """The volunteer answers expert calls only from coordinators it knows (DESIGN §12)."""

    code = "not_authorized"


class Busy(Refused):
    """The volunteer holds as many request bytes as it accepts (per peer or in all): try later."""

    code = "busy"


class SliceRefused(Refused):
    """A volunteer declined a slice-stream request (``code``: not_assigned, not_held, too_large,
    rate_limited, busy, opted_out, ...); ``retry_after_s`` when it said when to come back."""

    code = "slice_refused"

    def __init__(self, message: str, *, code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


_REFUSALS: Final[dict[str, type[Refused]]] = {
    cls.code: cls for cls in (Draining, SliceNotHeld, NotAuthorized, Busy)
}


def remote_error(code: str, message: str) -> Refused | RemoteProtocolError:
    """The error for a peer's error frame with ``code``: a refusal or a protocol breach."""
    cls = _REFUSALS.get(code)
    if cls is not None:
        return cls(message)
    return RemoteProtocolError(message, code=code)


class TransportError(SwarmError):
    code = "transport_error"


class ClosedError(TransportError):
    code = "closed"


class BrokenError(TransportError):
    code = "broken"


class TransportTimeout(TransportError):
    code = "timeout"


class DialError(TransportError):
    """A stream could not be opened: unknown or unreachable peer, partition, protocol not spoken."""

    code = "dial_failed"


class RequestError(SwarmError):
    """An invalid API request; ``status`` is the HTTP status to answer with."""

    code = "invalid_request_error"

    def __init__(self, message: str, *, code: str | None = None, status: int = 400, param: str | None = None) -> None:
        super().__init__(message, code=code)
        self.status = status
        self.param = param


class IdentityError(RequestError):
    """A peer id that cannot carry an Ed25519 key, or a signature that does not verify."""

    code = "bad_peer_id"
