"""The client interfaces over SGLang, vLLM and the embedded server, and their result type.

Rollers generate through `InferenceClient`; weight sync drives each server through
`WeightUpdateClient` (what the disk engine needs), or `DistributedWeightUpdateClient` (that plus
the weight group and its sessions, what the broadcast engine needs);
`agentrl/inference/registry.py` builds them for the backend `InferenceConfig.type` names. Every
implementation returns the same `GenerateResult`: token ids exactly as sampled, the
behaviour log-prob of each, why generation stopped, and the weight version that produced
them. Errors fall into three kinds the router acts on: `BadRequestError` (the request is
wrong; retrying elsewhere will not help), `ServerUnavailableError` (connection refused,
timeout, 5xx; try another server; `ServerError` when the server answered with its own
failure) and `RequestLostError` (the router ran out of servers). A finish reason "abort" is
only ever a resumable interruption (a pause for a weight update, an abort call): an engine
failure is an error, never an abort.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

FINISH_REASONS = ("stop", "length", "abort")


class InferenceError(RuntimeError):
    """Base of the errors inference clients raise."""


class BadRequestError(InferenceError):
    """The server rejected the request (HTTP 4xx); the message says why."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class ServerUnavailableError(InferenceError):
    """The server could not be reached, timed out or failed (5xx); another server may succeed."""


class ServerError(ServerUnavailableError):
    """The server answered and failed the request (HTTP 5xx: its engine failed, e.g. on NaN weights);
    the message is the server's. Another server may succeed; the router holds this one back."""


class RequestLostError(InferenceError):
    """No server could complete the request within the router's retries (counted by the router)."""


@dataclass
class GenerateResult:
    """What one generation produced, whichever server made it."""

    output_ids: list[int]
    """Generated token ids, exactly as sampled (never re-tokenized)."""
    logprobs: list[float]
    """Behaviour log-prob of each generated token (empty if the server returned none)."""
    finish_reason: str
    """"stop" (EOS, stop token or string), "length" (max_new_tokens / context) or "abort"
    (aborted or paused, e.g. for a weight update: resubmit prompt + output_ids to continue; a
    failed request raises instead)."""
    weight_version: int
    """Weight version that generated the output. The embedded server reports the version behind
    the first generated token (older if an update landed mid-request, so staleness is never
    understated); SGLang reports its version at the end; the vLLM client the version read just
    before sending. Weight sync wraps updates in pause/continue, so normally all agree. A client
    that names a LoRA adapter per request (`lora.py`) reports that adapter's version: exact."""
    prompt_tokens: int
    completion_tokens: int
    matched: int | str | None = None
    """The stop token id or stop string that ended generation, if any."""
    text: str | None = None
    """Detokenized output where the server returns it (informational only)."""
    server: str | None = None
    """URL of the server that produced it (set by clients; the router reports it)."""
    routed_experts: Any = None
    """MoE models, when the client asked (`inference.routed_experts`): int32 [prompt + output − 1,
    layers·top_k], the experts of each token fed to the model (SGLang's `return_routed_experts`;
    vLLM's `routed_experts`, `vllm.routed_rows`). None from vLLM for a request aborted before any
    forward."""


def parse_weight_version(value: Any) -> int:
    """SGLang reports `weight_version` as a string ("default" before any update); we use ints."""
    if value is None or value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InferenceError(f"weight_version {value!r} is not an integer version") from None


class InferenceClient(abc.ABC):
    """Generation against one inference server (or, for the router, many): what rollers use."""

    url: str = ""

    @abc.abstractmethod
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
        session_id: str | None = None,
    ) -> GenerateResult:
        """Generate from token ids. `sampling_params` uses SGLang's names (max_new_tokens, temperature,
        top_p, top_k, stop, stop_token_ids, ignore_eos); `session_id` lets a router keep one episode's
        turns on one server."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when the server answers its health check."""

    @abc.abstractmethod
    async def get_weight_version(self) -> int:
        """The weight version the server generates with now."""

    @abc.abstractmethod
    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort one request by id, or all of them."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections."""

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class WeightUpdateClient(abc.ABC):
    """Weight-update control of one inference server that every weight-sync engine uses: liveness,
    the version read back, pause / continue, a load from disk, close.

    A separate interface from `InferenceClient` because servers differ here (SGLang's
    begin/update/end session, vLLM's worker extension, the embedded server). A disk push (the disk
    engine, `weight_sync/disk.py`) is `pause_generation`, `update_weights_from_disk`,
    `continue_generation`, then `get_weight_version` to read the version back. A server that can
    also join a weight group implements `DistributedWeightUpdateClient` as well."""

    url: str = ""

    @abc.abstractmethod
    async def alive(self) -> bool:
        """True when the server process answers; cheap, and answers while generation is paused."""

    @abc.abstractmethod
    async def get_weight_version(self) -> int:
        """The weight version the server generates with now."""

    @abc.abstractmethod
    async def pause_generation(self) -> None:
        """Abort in-flight requests (they return finish_reason "abort") and hold new ones."""

    @abc.abstractmethod
    async def continue_generation(self) -> None:
        """Resume after `pause_generation`."""

    @abc.abstractmethod
    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> None:
        """Load a checkpoint directory written by the learner."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections."""


class DistributedWeightUpdateClient(WeightUpdateClient):
    """A `WeightUpdateClient` whose server joins a weight group and takes broadcast buckets in a
    session: what the broadcast engine (`weight_sync/broadcast.py`) needs of every server.

    A broadcast push is `pause_generation`, `begin_weight_update`, one
    `update_weights_from_distributed` per bucket, `end_weight_update` (the commit),
    `continue_generation`; a push that fails midway ends with `abort_weight_update` instead."""

    flattened_buckets: bool = False
    """True when the server takes a bucket as one flat uint8 broadcast (`flattened=True`)."""
    stages_updates: bool = False
    """True when the server stages the buckets and applies them only at `end_weight_update`, so
    an aborted push leaves it whole on its previous weights and version; False when each bucket
    is loaded as it arrives (SGLang), so an aborted push may leave a mix."""
    ordered_buckets: bool = False
    """True when the server receives the buckets of a session in the order of their `bucket`
    index, whatever order their requests arrive in, so the next bucket may be announced before
    the last one's reply (the embedded server says so in its `/begin_weight_update` reply)."""
    bucket_batches: bool = False
    """True when one `update_weights_from_distributed` request may announce several buckets
    (`more`), broadcast one after the other and answered by one reply (the embedded server says so
    in its `/begin_weight_update` reply)."""
    session_control: bool = False
    """True when `begin_weight_update(pause=True)` pauses generation in the same round trip and
    `end_weight_update(resume=True)` continues it after the commit, answering with the version the
    server serves after it (the embedded server says so in its `/begin_weight_update` reply)."""

    @abc.abstractmethod
    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Make the server join a weight-update group (blocks until the trainer, rank 0, joins too)."""

    @abc.abstractmethod
    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """Leave the weight-update group."""

    @abc.abstractmethod
    async def begin_weight_update(self, pause: bool = False) -> None:
        """Open a weight-update session; `update_weights_from_distributed` calls go inside it.
        `pause` (asked only of servers with `session_control`): pause generation first, in the
        same round trip."""

    @abc.abstractmethod
    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: int | None = None,
        flattened: bool = False,
        bucket: int | None = None,
        more: list[dict[str, Any]] | None = None,
    ) -> None:
        """Receive one bucket broadcast by rank 0, then load it: one broadcast per tensor in the order
        of `names`, or with `flattened` one uint8 tensor holding them back to back (SGLang's
        `FlattenedTensorBucket` layout). `bucket`: its index in the session (0, 1, …), sent only
        to servers with `ordered_buckets`. `more` (only to servers with `bucket_batches`): the
        buckets broadcast right after it (each `{"names", "dtypes", "shapes", "load_format"}`),
        received with it and answered by this one reply."""

    @abc.abstractmethod
    async def end_weight_update(self, weight_version: int | None = None, resume: bool = False) -> int | None:
        """Commit the session opened by `begin_weight_update`: the server then generates with every
        bucket received (a staging server applies them here, all or none). `resume` (asked only of
        servers with `session_control`): continue generation after it, in the same round trip.
        Returns the version the server says it serves after the commit, where its reply carries
        one (None elsewhere: read it back with `get_weight_version`)."""

    @abc.abstractmethod
    async def abort_weight_update(self) -> None:
        """Close the session without committing: a staging server drops what it staged and keeps
        its weights and version; one that loads per bucket keeps what it loaded."""
