"""Message authentication for the TransferQueue: a MAC over every message.

Every ZeroMQ message of the queue protocol is `[mac, control, *payload]`. The MAC
frame authenticates the control frame and every payload frame (with their lengths,
so frames cannot be re-cut) under a secret shared by all peers, read from the
environment variable named in the config (`queue.secret_env`).

Two schemes, named by the first byte of the MAC frame:

- `P` (default when `cryptography` is installed): a one-time Poly1305 key is derived
  per message as HMAC-SHA256(secret, nonce) with a fresh random 16-byte nonce, and the
  Poly1305 tag (~10 GB/s here) covers the message. This is the construction of
  ChaCha20-Poly1305 with HMAC as the key derivation, so hashing 16 MiB groups does
  not cap the queue at SHA-256 speed (~1.6 GB/s).
- `H`: HMAC-SHA256 over the same bytes, the fallback without `cryptography`.

Replay of a captured message is not prevented by the MAC; it is harmless by design
(puts are deduplicated by group id, acks are idempotent). CURVE encryption is not
used: trajectories are not secret, their integrity and origin are what matter.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from typing import Any

try:
    from cryptography.hazmat.primitives.poly1305 import Poly1305
except ImportError:  # pragma: no cover - depends on the environment
    Poly1305 = None

NONCE_BYTES = 16
TAG_BYTES = {b"P"[0]: 16, b"H"[0]: 32}


class AuthError(ValueError):
    """A message whose MAC is missing, malformed or wrong."""


def load_secret(env_name: str) -> bytes:
    """The shared secret from the environment, or an error saying how to set it."""
    value = os.environ.get(env_name, "")
    if len(value) < 16:
        raise AuthError(
            f"queue authentication needs a shared secret of >= 16 characters in ${env_name} "
            f"(e.g. `export {env_name}=$(openssl rand -hex 32)` on every node), "
            "or queue.auth=none on a trusted network"
        )
    return value.encode()


def _buf(frame: Any) -> memoryview:
    return memoryview(getattr(frame, "buffer", frame)).cast("B")


class Authenticator:
    """Signs and verifies queue messages under one shared secret; `None` secret = no auth."""

    def __init__(self, secret: bytes | None, scheme: str | None = None) -> None:
        self.secret = secret
        self.scheme = scheme or ("P" if Poly1305 is not None else "H")
        self._prefix, self._counter = os.urandom(8), 0
        if self.scheme == "P" and Poly1305 is None:
            raise AuthError("the Poly1305 MAC needs the `cryptography` package")

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def _tag(self, scheme: int, nonce: bytes, control: bytes, payload: Sequence[Any]) -> bytes:
        lengths = struct.pack(f"<{len(payload) + 1}Q", len(control), *(len(_buf(f)) for f in payload))
        if scheme == b"P"[0]:
            if Poly1305 is None:
                raise AuthError("message signed with Poly1305 but `cryptography` is not installed here")
            key = hmac.new(self.secret, b"agentrl-queue-poly1305" + nonce, hashlib.sha256).digest()
            mac = Poly1305(key)
        else:
            mac = hmac.new(self.secret, b"agentrl-queue-hmac" + nonce, hashlib.sha256)
        mac.update(lengths)
        mac.update(control)
        for frame in payload:
            mac.update(_buf(frame))
        return mac.finalize() if scheme == b"P"[0] else mac.digest()

    def sign(self, control: bytes, payload: Sequence[Any] = ()) -> bytes:
        """The MAC frame for a message: scheme byte, nonce, tag (one empty byte without auth)."""
        if self.secret is None:
            return b"-"
        self._counter += 1  # unique per message: a random per-sender prefix and a counter
        nonce = self._prefix + self._counter.to_bytes(NONCE_BYTES - len(self._prefix), "little")
        scheme = self.scheme.encode()
        return scheme + nonce + self._tag(scheme[0], nonce, control, payload)

    def verify(self, mac_frame: Any, control: Any, payload: Sequence[Any] = ()) -> None:
        """Raise `AuthError` unless `mac_frame` authenticates control + payload."""
        if self.secret is None:
            return
        mac = bytes(_buf(mac_frame))
        if not mac or mac[0] not in TAG_BYTES:
            raise AuthError("message is not signed (unknown or missing MAC scheme)")
        if len(mac) != 1 + NONCE_BYTES + TAG_BYTES[mac[0]]:
            raise AuthError(f"MAC frame of {len(mac)} bytes is malformed")
        nonce, tag = mac[1 : 1 + NONCE_BYTES], mac[1 + NONCE_BYTES :]
        expected = self._tag(mac[0], nonce, bytes(_buf(control)), payload)
        if not hmac.compare_digest(tag, expected):
            raise AuthError("MAC mismatch: wrong secret or a corrupted message")
