"""The inference config section (`inference:`): the servers the rollers generate with.

Kept beside the inference code; `agentrl.config` assembles it into the run's `AgentRLConfig` and
re-exports it. `type` and `options` are checked against the backends `agentrl/inference/registry.py`
names (a table of names; the backends themselves are imported only when used).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from agentrl.section import Section


class VLLMLoRAConfig(Section):
    """vLLM's LoRA serving: adapters loaded at run time, named per request (`inference/lora.py`)."""

    max_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16
    """`--max-lora-rank` (vLLM 0.32 takes only these); an adapter of a larger rank is refused before
    it is sent. vLLM sizes its LoRA buffers by it, so keep it at the rank trained."""
    max_loras: int = Field(2, ge=1)
    """`--max-loras`: adapters one batch may use; 2 lets requests on the previous version finish
    beside the new one."""
    max_cpu_loras: int | None = Field(None, ge=1)
    """`--max-cpu-loras`: adapters kept in host memory (null: vLLM's default, `max_loras`)."""


class SGLangLoRAConfig(Section):
    """SGLang's LoRA serving (`--enable-lora`): adapters loaded at run time, named per request."""

    max_rank: int = Field(16, ge=1)
    """`--max-lora-rank`; an adapter of a larger rank is refused before it is sent."""
    target_modules: list[str] = Field(default_factory=lambda: ["all"])
    """`--lora-target-modules`: the modules SGLang allocates LoRA buffers for (`all`: every one it
    supports); an adapter targeting another is refused before it is sent."""
    max_loras_per_batch: int = Field(8, ge=1)
    """`--max-loras-per-batch` (SGLang's default, 8; base-model requests take a slot)."""
    max_loaded_loras: int | None = Field(None, ge=1)
    """`--max-loaded-loras`: adapters kept in host memory (null: no limit; SGLang evicts the least
    recently used above it)."""


class SGLangLaunchConfig(Section):
    """How `agentrl serve --backend sglang` starts SGLang, beyond the flags every server gets."""

    lora: SGLangLoRAConfig | None = None
    """Serve LoRA adapters (`--enable-lora` with these limits); null: no LoRA."""


class VLLMLaunchConfig(Section):
    """How `agentrl serve --backend vllm` (and `agentrl run` with `inference.type: vllm`) starts vLLM."""

    python: str | None = None
    """Python of the environment vLLM is installed in; null: `.venv-vllm/bin/python` (`make vllm`)."""
    enforce_eager: bool = True
    """Pass `--enforce-eager`: no torch.compile / graph capture (~35 s to healthy on CPU instead of ~175 s)."""
    kv_cache_gb: float | None = Field(None, gt=0)
    """CPU only: `VLLM_CPU_KVCACHE_SPACE` in GiB; null sizes it from this machine's available memory."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """GPU only: fraction of GPU memory vLLM may take (weights + KV cache)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs per vLLM server; the weight group then takes that many ranks per server."""
    startup_timeout_s: float = Field(900.0, gt=0)
    """Seconds to wait for a started vLLM server to answer `/health`."""
    lora: VLLMLoRAConfig | None = None
    """Serve LoRA adapters: `--enable-lora` with these limits, and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`
    for `/v1/load_lora_adapter`; null: no LoRA."""
    extra_args: list[str] = Field(default_factory=list)
    """More command-line flags for `vllm.entrypoints.openai.api_server`, passed as given."""


class InferenceConfig(Section):
    """Inference servers the rollers generate with and the weight sync updates."""

    type: str = "embedded"
    """Server kind: agentrl's embedded server, SGLang (native API), vLLM (OpenAI API), or a backend
    another package registers (entry-point group `agentrl.inference_backends`)."""

    @field_validator("type")
    @classmethod
    def _registered(cls, value: str) -> str:
        from agentrl.inference.registry import BACKENDS

        return BACKENDS.require(value)

    logprobs: Literal["full", "truncated"] = "full"
    """Which distribution the behaviour log-probs are of. "full": log_softmax(logits / temperature)
    over the whole vocabulary, before top-k/top-p (SGLang 0.5.23's default, srt/layers/sampler.py;
    what the learner recomputes). "truncated": the top-k/top-p-restricted, renormalised distribution
    the tokens are drawn from (embedded server; vLLM's processed log-probs); the learner cannot
    recompute it, so it needs roller.top_p: 1 and roller.top_k: -1. Truncation order: the embedded
    server (as SGLang) keeps a token when it is among the top_k most likely and the tempered mass
    strictly above it is at most top_p, both on the full distribution; vLLM 0.32 applies min_p, then
    top_k, then top_p on the top-k-renormalised distribution (`apply_top_k_top_p`), and has no mode
    that reports full tempered log-probs, so with inference.type: vllm top_p / top_k are refused."""
    servers: list[str] = Field(default_factory=list)
    """URLs of running servers; empty means `agentrl run` starts `num_servers` embedded ones."""
    num_servers: int = Field(1, ge=1)
    """Servers (embedded or vLLM) that `agentrl run` starts when `servers` is empty."""
    resources: dict[str, float] = Field(default_factory=dict)
    """`--launcher ray` only: what each server `agentrl run` starts asks Ray for, e.g. `{GPU: 1, CPU: 4}`."""
    model_path: str | None = None
    """Checkpoint the embedded servers load; defaults to `learner.model_path`."""
    device: str = "cpu"
    """Device of an embedded server: cpu, cuda or cuda:N."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weight dtype of an embedded server."""
    max_batch_size: int = Field(32, ge=1)
    """Requests decoded together by an embedded server."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Timeout of one generation request before it is retried elsewhere."""
    api_key_env: str = "AGENTRL_API_KEY"
    """Environment variable holding the servers' API key (unset: no key)."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """Timeout of opening a connection to a server (a dead server fails fast, then failover)."""
    max_retries: int = Field(2, ge=0)
    """Times the router retries a failed request on another server before counting it lost."""
    health_check_interval_s: float = Field(5.0, gt=0)
    """Seconds between the router's health checks of each server."""
    server_wait_s: float = Field(120.0, ge=0)
    """How long a roller's request waits for a usable server (up, and at a weight version inside the
    admissible window) when none is, e.g. while the only server restarts, before it is counted lost."""
    context_length: int | None = Field(None, ge=16)
    """Longest prompt + output an embedded server accepts; defaults to the model's max positions."""
    served_model_name: str | None = None
    """`model` field sent to vLLM's OpenAI API; null sends none (vLLM then uses its only model)."""
    cpu_threads: int | None = Field(1, ge=1)
    """torch threads of an embedded server on CPU (process-wide). 1 suits the small models served on
    CPU next to other processes (more threads thrash on a busy machine); null keeps torch's default."""
    routed_experts: bool = False
    """Mixture-of-experts models: the rollers ask for the experts each token was routed to (SGLang's
    `return_routed_experts`; the embedded server returns them, SGLang when started with
    `--enable-return-routed-experts`) and keep them in the episodes, which `learner.moe.router_replay`
    replays. vLLM: read from its replies (`VLLMClient`); a vLLM agentrl starts gets
    `--enable-return-routed-experts` and what that needs, and is refused where it has no Triton
    (`vllm_launch.ROUTED_EXPERTS_NEED_TRITON`: vllm-cpu)."""
    vllm: VLLMLaunchConfig = VLLMLaunchConfig()
    """How vLLM servers are started when agentrl starts them (`inference.type: vllm` without `servers`)."""
    sglang: SGLangLaunchConfig = SGLangLaunchConfig()
    """How `agentrl serve --backend sglang` starts SGLang."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Settings of a backend another package registers, checked by its descriptor's `options` model
    (a backend without one takes none)."""

    @model_validator(mode="after")
    def _backend_options(self) -> InferenceConfig:
        from agentrl.inference.registry import backend

        model = backend(self.type).options
        if model is None and self.options:
            raise ValueError(
                f"inference.options: the {self.type} backend takes no options (got {sorted(self.options)})"
            )
        if model is not None:
            try:
                model.model_validate(self.options)
            except ValidationError as exc:
                raise ValueError(f"inference.options for the {self.type} backend: {exc}") from None
        return self
