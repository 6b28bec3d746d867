"""Message authentication for the TransferQueue: a MAC over every message.

Every ZeroMQ message of the queue protocol is `[mac, control, *payload]`. The MAC
frame authenticates the control frame and every payload frame (with their lengths,
so frames cannot be re-cut) under a secret shared by all peers, read from the
environment variable named in the config (`queue.secret_env`).

Three schemes, named by the first byte of the MAC frame; a receiver accepts all three,
a sender uses the fastest it has:

- `G` (default when `cryptography` is installed): a one-time AES-128 key is derived per
  message as HMAC-SHA256(secret, nonce) with a unique 16-byte nonce; each payload frame
  (in chunks of at most 1 GiB) gets a GMAC tag (AES-GCM with the frame as associated
  data, no plaintext) under its own index as the GCM nonce, and a final GMAC under a
  nonce no index uses covers the lengths, the control frame and those tags in order.
  GMAC runs at ~23 GB/s here (AES-NI + carry-less multiply), so the MAC costs a 4 MiB
  group ~0.2 ms per side instead of ~0.35 ms.
- `P`: the same per-message key derivation with a Poly1305 tag (~10-13 GB/s here), the
  construction of ChaCha20-Poly1305 with HMAC as the key derivation.
- `H`: HMAC-SHA256 over the same bytes (~1.6 GB/s), the fallback without `cryptography`.

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

import msgpack

from agentrl.log import get_logger
from agentrl.wire import byte_view

log = get_logger("queue.auth")

try:
    from cryptography.hazmat.primitives.poly1305 import Poly1305
except ImportError:  # pragma: no cover - depends on the environment
    Poly1305 = None
try:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
except ImportError:  # pragma: no cover - depends on the environment
    AESGCM = None

NONCE_BYTES = 16
TAG_BYTES = {b"G"[0]: 16, b"P"[0]: 16, b"H"[0]: 32}
GMAC_CHUNK = 1 << 30  # AES-GCM takes at most 2^31-1 bytes of associated data per call
_FINAL_NONCE = b"\xff" * 12  # the chunk indices below never reach it


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


class Authenticator:
    """Signs and verifies queue messages under one shared secret; `None` secret = no auth."""

    def __init__(self, secret: bytes | None, scheme: str | None = None) -> None:
        self.secret = secret
        self.scheme = scheme or ("G" if AESGCM is not None else "P" if Poly1305 is not None else "H")
        self._prefix, self._counter = os.urandom(8), 0
        if (self.scheme == "P" and Poly1305 is None) or (self.scheme == "G" and AESGCM is None):
            raise AuthError(f"the {self.scheme!r} MAC needs the `cryptography` package")

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def _tag(self, scheme: int, nonce: bytes, control: bytes, payload: Sequence[Any]) -> bytes:
        payload = [byte_view(f) for f in payload]
        lengths = struct.pack(f"<{len(payload) + 1}Q", len(control), *map(len, payload))
        if scheme == b"G"[0]:
            return self._gmac(nonce, lengths, control, payload)
        if scheme == b"P"[0]:
            if Poly1305 is None:
                raise AuthError("message signed with Poly1305 but `cryptography` is not installed here")
            key = hmac.digest(self.secret, b"agentrl-queue-poly1305" + nonce, "sha256")
            mac = Poly1305(key)
        else:
            mac = hmac.new(self.secret, b"agentrl-queue-hmac" + nonce, hashlib.sha256)
        mac.update(lengths)
        mac.update(control)
        for view in payload:
            mac.update(view)
        return mac.finalize() if scheme == b"P"[0] else mac.digest()

    def _gmac(self, nonce: bytes, lengths: bytes, control: bytes, payload: list[memoryview]) -> bytes:
        if AESGCM is None:
            raise AuthError("message signed with GMAC but `cryptography` is not installed here")
        key = hmac.digest(self.secret, b"agentrl-queue-gmac" + nonce, "sha256")[:16]
        gcm = AESGCM(key)
        tags, index = [lengths, control], 0
        for view in payload:
            for start in range(0, len(view), GMAC_CHUNK) if len(view) else ():
                tags.append(gcm.encrypt(index.to_bytes(12, "little"), b"", view[start : start + GMAC_CHUNK]))
                index += 1
        return gcm.encrypt(_FINAL_NONCE, b"", b"".join(tags))

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
        mac = bytes(byte_view(mac_frame))
        if not mac or mac[0] not in TAG_BYTES:
            raise AuthError("message is not signed (unknown or missing MAC scheme)")
        if len(mac) != 1 + NONCE_BYTES + TAG_BYTES[mac[0]]:
            raise AuthError(f"MAC frame of {len(mac)} bytes is malformed")
        nonce, tag = mac[1 : 1 + NONCE_BYTES], mac[1 + NONCE_BYTES :]
        expected = self._tag(mac[0], nonce, bytes(byte_view(control)), payload)
        if not hmac.compare_digest(tag, expected):
            raise AuthError("MAC mismatch: wrong secret or a corrupted message")

    def read_reply(self, msg: Sequence[Any], who: str) -> dict | None:
        """The control map of a reply `[mac, control, *payload]` from the queue server, or None
        (logged at WARNING, as ignored by `who`) when it fails its MAC or is not a msgpack map."""
        try:
            self.verify(msg[0], msg[1], msg[2:])
            ctl = msgpack.unpackb(msg[1].buffer, raw=False)
        except (AuthError, ValueError, IndexError) as exc:
            log.warning("%s ignored a reply that failed its check: %s", who, exc)
            return None
        return ctl
