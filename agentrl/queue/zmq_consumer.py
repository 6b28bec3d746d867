"""The learner's side of the ZeroMQ TransferQueue: `ZmqConsumer` (blocking, one per rank).

A DEALER socket talking to the server's ROUTER with `[mac, control, *payload]` messages (see
`zmq_server.py`; the rollers' side is `zmq_producer.py`). Every request carries an id and is
kept until answered; every reply carries the server's *epoch* (random per server start). When
the consumer sees a new epoch, the server restarted: it re-sends what is unanswered, so a
consumer waiting in `get_batch` or `ack` survives a server crash and restart. A consumer in the
process that hosts the server (`server=`) takes the server's validated groups over an inproc
socket; one elsewhere decodes the frames (`agentrl.wire`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from agentrl.log import get_logger
from agentrl.queue.auth import Authenticator
from agentrl.queue.base import (
    Batch,
    Consumer,
    QueueError,
    QueueUnavailable,
    check_drop_reason,
)
from agentrl.queue.frames import unpack
from agentrl.types import Group
from agentrl.wire import decode_group

log = get_logger("queue.consumer")

PING_S = 0.5
SILENT_WARN_S = 30.0


@dataclasses.dataclass
class _Held:
    """A delivered group the learner has not taken yet, with the staleness the queue computed for it
    at the learner `version` it was asked for. At that version it is admissible (the queue checked)
    and its staleness is the queue's; only at another version is it judged again from its tokens'
    versions, a pass that costs ~0.2 ms per MiB of group (so not once per group per step)."""

    group: Group
    age: float
    staleness: int
    version: int | None

    def staleness_at(self, learner_version: int) -> int:
        if learner_version == self.version:
            return self.staleness
        return self.group.staleness(learner_version)


class ZmqConsumer(Consumer):
    """A learner rank's handle on the queue; blocking calls, one rank per `name`."""

    def __init__(
        self,
        address: str,
        name: str,
        auth: Authenticator,
        server: Any = None,
        hello: dict | None = None,
        connect_timeout_s: float = 30.0,
    ) -> None:
        """With `server` (a `QueueServer` in this process) batches come as the server's already
        validated `Group` objects over its inproc socket: no frames copied, nothing decoded twice.
        `hello`: what the queue checks this learner against (groups per step and
        staleness as `gps`, `ms`, per-token staleness as `pt`; `r`: run id); no answer within `connect_timeout_s` raises `QueueUnavailable`."""
        self.name = name
        self.address = address
        self._server = server
        context = server.context if server is not None else None
        self.auth = auth
        self._own_context = context is None
        self._ctx = context or zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self._epoch: str | None = None
        self._buffer: list[_Held] = []  # delivered, not yet returned
        self._held: set[str] = set()  # delivered to this consumer and not acked
        self._resume_tasks = 0
        try:
            reply, _ = self._call({"k": "hello", "c": name, **(hello or {})}, timeout_s=connect_timeout_s)
        except TimeoutError:
            self.close()
            raise QueueUnavailable(
                f"no answer from the queue at {address} within queue.connect_timeout_s={connect_timeout_s:g}s: "
                "check queue.address, that `agentrl queue` is running there, and the secret in "
                "queue.secret_env"
            ) from None
        except QueueError:
            self.close()
            raise
        self.run_id = reply.get("r")

    def _send(self, ctl: dict) -> None:
        body = msgpack.packb(ctl)
        self._sock.send_multipart([self.auth.sign(body), body], copy=False)

    def _call(self, ctl: dict, timeout_s: float | None = None) -> tuple[dict, list]:
        """Send a request and wait for its answer, re-sending it if the server restarted."""
        ctl["rid"] = next(self._ids)
        self._send(ctl)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last_heard = warned = time.monotonic()
        while True:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"queue server did not answer {ctl['k']!r} within {timeout_s:.1f}s")
            if not self._sock.poll(int(PING_S * 1000)):
                silent = time.monotonic() - last_heard
                if silent > PING_S:
                    self._send({"k": "ping", "rid": 0})
                if silent > SILENT_WARN_S and time.monotonic() > warned + SILENT_WARN_S:
                    warned = time.monotonic()
                    log.warning(
                        "queue server has not answered for %.0fs; still waiting for %r", silent, ctl["k"]
                    )
                continue
            msg = self._sock.recv_multipart(copy=False)
            if (reply := self.auth.read_reply(msg, "consumer")) is None:
                continue
            last_heard = time.monotonic()
            if self._epoch is not None and reply.get("e") != self._epoch:
                log.warning("queue server restarted: re-sending %r", ctl["k"])
                self._epoch = reply.get("e")
                self._send(ctl)
                continue
            self._epoch = reply.get("e")
            if reply["k"] == "batch" and reply["rid"] != ctl["rid"]:
                self._take(reply, msg[2:], None)  # answer to an earlier request that timed out
            elif reply.get("rid") == ctl["rid"] and reply["rid"] != 0:
                if reply["k"] == "err":
                    cls = QueueUnavailable if reply.get("code") in ("run", "config") else QueueError
                    raise cls(f"queue server refused {ctl['k']!r}: {reply['msg']}")
                return reply, msg[2:]

    def _take(self, reply: dict, segments: list, version: int | None) -> None:
        """Buffer the groups of a `batch` reply to a get at learner `version` (None: not known)."""
        if self._server is not None:
            local = self._server.local_groups([meta[0] for meta in reply["groups"]])
        else:
            frames = unpack(reply["lens"], reply["segs"], segments)
        pos = 0
        for gid, nframes, age, staleness in reply["groups"]:
            group_frames = None if self._server is not None else frames[pos : pos + nframes]
            pos += nframes
            if gid in self._held:
                continue  # redelivered after a server restart; we already have it
            self._held.add(gid)
            group = local[gid] if group_frames is None else decode_group(group_frames, max_bytes=1 << 62)
            self._buffer.append(_Held(group, age, staleness, version))

    def get_batch(
        self, num_groups: int, learner_version: int, max_staleness: int, timeout_s: float | None = None
    ) -> Batch:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        dropped = self._drop_stale_buffered(learner_version, max_staleness)
        while len(self._buffer) < num_groups:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ctl = {"k": "get", "n": num_groups - len(self._buffer), "v": learner_version, "s": max_staleness}
            reply, frames = self._call(
                {**ctl, "t": left, "c": self.name}, None if left is None else left + 30
            )
            dropped += reply.get("dropped", 0)
            if reply["k"] == "empty":
                raise TimeoutError(
                    f"no {num_groups} admissible groups within {timeout_s}s "
                    f"({len(self._buffer)} held, {dropped} dropped as stale)"
                )
            self._take(reply, frames, learner_version)
        taken, self._buffer = self._buffer[:num_groups], self._buffer[num_groups:]
        return self._hand_out(
            [h.group for h in taken],
            [h.age for h in taken],
            learner_version,
            max_staleness,
            dropped,
            staleness=[h.staleness_at(learner_version) for h in taken],
        )

    def _drop_stale_buffered(self, version: int, max_staleness: int) -> int:
        per_token = self.per_token_staleness
        stale = [
            h.group.group_id
            for h in self._buffer
            if h.version != version and not h.group.is_admissible(version, max_staleness, per_token)
        ]
        if stale:
            self._buffer = [h for h in self._buffer if h.group.group_id not in stale]
            self.ack(stale, dropped="stale")  # leaves the queue; counted as dropped
        return len(stale)

    def ack(self, group_ids: list[str], dropped: str | None = None) -> None:
        """Trained on (or dropped for `dropped` = "stale" / "skipped"): the queue forgets these groups."""
        check_drop_reason(dropped)
        if group_ids:
            self._call({"k": "ack", "ids": list(group_ids), "drop": dropped})
            self._held.difference_update(group_ids)

    def publish_version(self, version: int) -> None:
        """The learner's version, and a resumed learner's task cursor (the queue keeps the larger)."""
        self._call({"k": "pub", "v": int(version), "t": self._resume_tasks})

    def finish(self) -> None:
        self._call({"k": "fin"}, timeout_s=10.0)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the queue: its task cursor (so a resumed run does not replay tasks)."""
        return {"tasks_issued": int(self.metrics().get("tasks_issued", 0))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume_tasks = int(state.get("tasks_issued", 0))

    def metrics(self) -> dict[str, Any]:
        return self._call({"k": "stats"})[0]["m"]

    def follow_servers(self, path: Any) -> None:
        """Hand the launcher's live list in `path` on to this (standalone) queue, which carries it
        to the producers: a `server_list.Publisher` thread, with its own socket and signer."""
        from agentrl.inference.server_list import Publisher

        self._sl = {"sock": None, "auth": Authenticator(self.auth.secret)}
        self._publisher = Publisher(path, self._send_servers).start()

    def _send_servers(self, sl: list) -> None:
        if self._sl["sock"] is None:  # created and used by the publisher's thread only
            self._sl["sock"] = sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
        sock, body = self._sl["sock"], msgpack.packb({"k": "sl", "sl": sl, "rid": 0})
        sock.send_multipart([self._sl["auth"].sign(body), body])
        while sock.poll(5000):  # its answer (or an earlier one, late); none: sent again next round
            msg = sock.recv_multipart()
            reply = msgpack.unpackb(msg[1], raw=False) if len(msg) > 1 else {}
            if reply.get("k") == "err":
                raise QueueError(f"queue refused the server list: {reply.get('msg')}")
            if not sock.poll(0):
                return
        raise TimeoutError("no answer from the queue within 5s")

    def close(self) -> None:
        publisher = getattr(self, "_publisher", None)
        if publisher is not None:
            publisher.stop()
            if self._sl["sock"] is not None:
                self._sl["sock"].close(linger=0)
        self._sock.close(linger=0)
        if self._own_context:
            self._ctx.term()
