"""What each part of the pipeline costs, in seconds: measured (`agentrl plan calibrate`) or analytic.

A `CostProfile` has one small model per component, each the shape the component's cost has:

- a server's decode step (continuous batching: every running sequence gains one token):
  `decode_base_s + decode_per_seq_s × batch + decode_per_ctx_token_s × Σ context` — fixed launch
  overhead, per-sequence work, and the KV cache read, which grows with every sequence's context;
- a prefill: `prefill_base_s + prefill_per_token_s × tokens`, added to the step it joins;
- the learner: `train_base_s + tokens / learner_tokens_per_s` per step (all learner ranks);
- a weight push: `push_base_s + push_bytes / push_bytes_per_s`, servers paused throughout;
- colocated only, per step: `reshard_s` (training layout → generation layout and back), the
  learner's step at `colocated_tokens_per_s` when measured (the colocated learner over its own
  ranks, at the calibration run's step size, its fixed cost folded into the rate; else `train_s`), and `colocated_loop_s`, the loop's own work between phases (sharing the groups
  over ranks, advantages, logging);
- on a CPU machine (`cores` > 0) the servers' steps and the learner's step share the cores: while
  more threads are busy than there are cores, each runs that much slower (processor sharing).

Each profile names where its numbers came from (`source`): the benches that measured them on a
machine, or the published device figures an analytic profile was derived from.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class CostProfile:
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float
    prefill_base_s: float
    prefill_per_token_s: float
    train_base_s: float
    learner_tokens_per_s: float
    push_base_s: float
    push_bytes: float
    push_bytes_per_s: float
    reshard_s: float = 0.0
    colocated_tokens_per_s: float = 0.0  # the colocated learner's tokens/s (0: use train_s)
    colocated_loop_s: float = 0.0
    max_batch: int = 256  # sequences a server decodes at once (KV-cache bound)
    turn_overhead_s: float = 0.0  # roller-side cost of one model turn (render, parse, HTTP)
    cores: int = 0  # CPU cores servers and learner share (a CPU machine); 0: each has its own device
    learner_threads: int = 1  # threads the learner keeps busy while it trains (its ranks)
    source: dict[str, str] = field(default_factory=dict)

    def decode_s(self, batch: int, ctx_sum: float) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_ctx_token_s * ctx_sum

    def prefill_s(self, tokens: float) -> float:
        return self.prefill_base_s + self.prefill_per_token_s * tokens if tokens > 0 else 0.0

    def train_s(self, tokens: float) -> float:
        return self.train_base_s + tokens / self.learner_tokens_per_s

    def colocated_train_s(self, tokens: float) -> float:
        if self.colocated_tokens_per_s > 0:
            return tokens / self.colocated_tokens_per_s
        return self.train_s(tokens)

    def push_s(self) -> float:
        return self.push_base_s + self.push_bytes / self.push_bytes_per_s

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> CostProfile:
        data = json.loads(Path(path).read_text())
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{path}: unknown cost-profile field(s) {unknown}")
        return cls(**data)


@dataclass(frozen=True)
class Device:
    """Published peak figures of one accelerator; `source` says where they are from."""

    name: str
    bf16_flops: float  # dense, per second
    hbm_bytes_per_s: float
    memory_bytes: float
    intra_node_bytes_per_s: float  # per device, one direction (NVLink)
    inter_node_bytes_per_s: float  # per device (its NIC)
    source: str


GB = 1e9
GIB = 1024**3

DEVICES = {
    "h100": Device(
        "H100 SXM 80GB", 989e12, 3.35e12, 80 * GIB, 450 * GB, 50 * GB,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM: 989 TFLOPS dense BF16, 3.35 TB/s, NVLink 900 GB/s "
        "bidirectional); 400 Gb/s InfiniBand NDR per GPU",
    ),
    "h200": Device(
        "H200 SXM 141GB", 989e12, 4.8e12, 141 * GIB, 450 * GB, 50 * GB,
        "NVIDIA H200 Tensor Core GPU datasheet (989 TFLOPS dense BF16, 4.8 TB/s, NVLink 900 GB/s); "
        "400 Gb/s InfiniBand NDR per GPU",
    ),
    "a100": Device(
        "A100 SXM 80GB", 312e12, 2.039e12, 80 * GIB, 300 * GB, 25 * GB,
        "NVIDIA A100 Tensor Core GPU datasheet (312 TFLOPS dense BF16, 2,039 GB/s, NVLink 600 GB/s); "
        "200 Gb/s HDR InfiniBand per GPU",
    ),
}  # fmt: skip


@dataclass(frozen=True)
class ModelShape:
    """What costs depend on: parameters, layers, KV width (bytes per token = 2 × layers × kv_dim × 2)."""

    params: float
    layers: int
    hidden: int
    kv_dim: int  # num_key_value_heads × head_dim

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_dim * 2  # K and V, bf16

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelShape:
        """From a Hugging Face `config.json` (Llama / Qwen2 / Qwen3 / Mistral field names)."""
        h = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads", heads))
        head_dim = int(cfg.get("head_dim") or h // heads)
        inter = int(cfg["intermediate_size"])
        vocab = int(cfg["vocab_size"])
        attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
        mlp = 3 * h * inter
        embed = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
        return cls(float(layers * (attn + mlp + 2 * h) + embed), layers, h, kv_heads * head_dim)


# Shares of peak that real kernels reach; named here so a reader can change them in one place.
DECODE_BANDWIDTH_SHARE = 0.6  # memory-bound decode reaches ~60% of HBM bandwidth
TRAIN_MFU = 0.35  # model FLOPs utilisation of a well-tuned FSDP/Megatron step
LINK_SHARE = 0.7  # share of a link's peak a large broadcast reaches


def analytic(
    model: ModelShape, device: Device, server_tp: int, learner_gpus: int, cross_node: bool
) -> CostProfile:
    """A profile for hardware not at hand: decode is memory-bound (weights once per step plus every
    sequence's KV cache), prefill and training compute-bound (2 and 6 FLOPs per parameter and token),
    the push bandwidth-bound over the slower link it crosses."""
    bw = device.hbm_bytes_per_s * DECODE_BANDWIDTH_SHARE * server_tp
    flops = device.bf16_flops * TRAIN_MFU
    weights = 2 * model.params
    kv_memory = device.memory_bytes * server_tp * 0.9 - weights
    max_batch = max(1, int(kv_memory / (model.kv_bytes_per_token * 2048))) if kv_memory > 0 else 0
    link = device.inter_node_bytes_per_s if cross_node else device.intra_node_bytes_per_s
    return CostProfile(
        decode_base_s=weights / bw + 20e-6 * model.layers,
        decode_per_seq_s=2 * model.params / (flops * server_tp),
        decode_per_ctx_token_s=model.kv_bytes_per_token / bw,
        prefill_base_s=1e-3,
        prefill_per_token_s=2 * model.params / (flops * server_tp),
        train_base_s=0.5,
        learner_tokens_per_s=flops * learner_gpus / (6 * model.params),
        push_base_s=0.2,
        push_bytes=weights,
        push_bytes_per_s=link * LINK_SHARE,
        reshard_s=weights / (device.intra_node_bytes_per_s * LINK_SHARE) * 2,
        max_batch=min(max_batch, 512),
        source={
            "kind": "analytic",
            "device": device.source,
            "efficiency": f"decode at {DECODE_BANDWIDTH_SHARE:.0%} of HBM bandwidth, training at "
            f"{TRAIN_MFU:.0%} MFU, links at {LINK_SHARE:.0%} of peak",
        },
    )
