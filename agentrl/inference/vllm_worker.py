"""agentrl's weight receiver inside vLLM: a worker extension driven over `/collective_rpc`.

vLLM mixes this class into every worker when started with
`--worker-extension-cls agentrl.inference.vllm_worker.AgentRLWorkerExtension`
(`vllm/v1/worker/worker_base.py`); `POST /collective_rpc {"method": NAME, "kwargs": {...}}`
(dev mode) calls NAME on every worker and answers `{"results": [one per worker]}`. Every
method here takes one JSON string, `payload`, and answers a dict.

One protocol on CPU and GPU: the worker joins agentrl's own weight group
(`agentrl.inference.weight_group.join_group`; gloo on CPU, NCCL on GPU) at rank
`rank_offset + worker rank`, then per push:

1. `agentrl_receive` per bucket: receive the announced tensors, in order, from the
   learner's broadcast, and *stage* them (copies on the CPU); the model is not touched;
2. `agentrl_commit`: check the staged set is a whole, well-formed checkpoint (every name
   the model's own checkpoint has, same shapes), then load it with vLLM's in-place reload
   (`model_runner.reload_weights(weights_iterator=...)`, which re-runs the kernel-format
   processing), then re-tie the output layer;
3. `agentrl_discard`: drop what was staged (a push that failed midway).
So a push that fails before the commit leaves the model on its old weights. A commit whose
load fails inside vLLM is rolled back by reloading the last good weights (kept on the CPU:
one extra copy of the model in host memory), or the checkpoint the server started from.

Tied embeddings: vLLM's reload skips `lm_head.*` for a tied model, and on CPU the LM head
keeps its own pre-packed copy of the embedding matrix (`dispatch_cpu_unquantized_gemm` in
`vllm/model_executor/layers/utils.py`), which the reload does not refresh — so served
log-probs came from the new body and the old output layer. `_retie` re-points the head at
the embedding and re-runs its quant method's `process_weights_after_loading`.

The same commit path serves the disk fallback (`agentrl_load_from_disk`). LoRA adapters are
vLLM's own (`/v1/load_lora_adapter`, by path); `agentrl_write_adapter` only writes an adapter
sent over HTTP where the server can read it (`agentrl_remove_adapter` deletes it). Imports only torch
and agentrl's weight-group module, so it runs in vLLM's own environment.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from agentrl.inference.weight_group import WeightGroup, join_group, parse_dtype, unflatten


class AgentRLWorkerExtension:
    """Mixed into vLLM's Worker: `self.model_runner`, `self.rank`, `self.device` are vLLM's."""

    _agentrl_group: WeightGroup | None = None
    _agentrl_staged: dict[str, torch.Tensor] | None = None
    _agentrl_good: dict[str, torch.Tensor] | None = (
        None  # last committed weights (None: the start checkpoint)
    )
    _agentrl_shapes: dict[str, tuple[int, ...]] | None = None

    # ------------------------------------------------------------------ group

    def agentrl_join_group(self, payload: str) -> dict[str, Any]:
        """Join a weight group at rank `rank_offset + self.rank`; blocks until every rank joined."""
        args = json.loads(payload)
        self.agentrl_leave_group("{}")
        rank = int(args["rank_offset"]) + int(self.rank)
        self._agentrl_group = join_group(
            args["master_address"],
            int(args["master_port"]),
            rank,
            int(args["world_size"]),
            args["group_name"],
            args["backend"],
            float(args.get("timeout_s", 120.0)),
        )
        return {"rank": rank, "group_name": args["group_name"]}

    def agentrl_leave_group(self, payload: str = "{}") -> dict[str, Any]:
        if self._agentrl_group is not None:
            self._agentrl_group.close()
            self._agentrl_group = None
        self._agentrl_staged = None
        return {"left": True}

    # ------------------------------------------------------------------ push

    def agentrl_receive(self, payload: str) -> dict[str, Any]:
        """Receive one bucket into the staging area: one broadcast per tensor in the order of `names`
        or, with `flattened`, one uint8 tensor holding them back to back."""
        args = json.loads(payload)
        group = self._agentrl_group
        if group is None or group.group_name != args["group_name"]:
            raise RuntimeError(f"not in weight group {args['group_name']!r}; join it first")
        names, dtypes, shapes = args["names"], args["dtypes"], args["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("names, dtypes and shapes differ in length")
        # NCCL receives into this worker's own GPU (vLLM's `Worker.device`, `cuda:<local rank>`)
        device = (getattr(self, "device", None) or "cuda") if group.backend == "nccl" else "cpu"
        staged = self._agentrl_staged if self._agentrl_staged is not None else {}
        self._agentrl_staged = None  # a receive that fails below leaves nothing staged
        specs = [(n, parse_dtype(d), torch.Size(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        if args.get(
            "flattened"
        ):  # one uint8 broadcast, tensors back to back (SGLang's FlattenedTensorBucket)
            flat = torch.empty(sum(shape.numel() * dtype.itemsize for _, dtype, shape in specs),
                               dtype=torch.uint8, device=device)  # fmt: skip
            group.broadcast(flat, 0)
            staged.update(unflatten(flat.cpu(), specs))
        else:
            for name, dtype, shape in specs:
                buffer = torch.empty(shape, dtype=dtype, device=device)
                group.broadcast(buffer, 0)
                staged[name] = buffer.cpu()
        self._agentrl_staged = staged
        return {"staged": len(staged)}

    def agentrl_discard(self, payload: str = "{}") -> dict[str, Any]:
        dropped = len(self._agentrl_staged or {})
        self._agentrl_staged = None
        return {"discarded": dropped}

    def agentrl_commit(self, payload: str = "{}") -> dict[str, Any]:
        """Load the staged weights into the model (all or nothing), then forget them."""
        staged, self._agentrl_staged = self._agentrl_staged, None
        if not staged:
            raise RuntimeError("nothing staged to commit (the push sent no buckets, or a receive failed)")
        return self._agentrl_install(staged)

    def agentrl_load_from_disk(self, payload: str) -> dict[str, Any]:
        """Load a safetensors checkpoint directory through the same checked, re-tied commit."""
        from safetensors.torch import load_file

        directory = Path(json.loads(payload)["path"])
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {directory}")
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(load_file(str(file), device="cpu"))
        return self._agentrl_install(tensors)

    # ------------------------------------------------------------------ LoRA adapters

    def agentrl_write_adapter(self, payload: str) -> dict[str, Any]:
        """Write a PEFT adapter directory sent over HTTP (`config`, the `adapter_model.safetensors`
        bytes in base64) where this server can read it, `<tmp>/agentrl-adapters/<name>.<digest>`,
        and answer its path: vLLM loads adapters by path (`/v1/load_lora_adapter`), so a server on
        another host needs no shared filesystem. Named by content, so the workers of one server
        agree on the path and a name sent again with other weights gets a directory of its own;
        written under a temporary name and renamed (the first worker's rename wins)."""
        import base64
        import hashlib
        import os
        import shutil

        args = json.loads(payload)
        config = json.dumps(args["config"], sort_keys=True)
        weights = base64.b64decode(args["safetensors"])
        digest = hashlib.sha256(config.encode() + weights).hexdigest()[:16]
        target = _adapter_root(args["name"]) / f"{args['name']}.{digest}"
        if target.is_dir():
            return {"path": str(target)}
        partial = target.with_name(f".{target.name}.{os.getpid()}.{self.rank}")
        partial.mkdir(parents=True, exist_ok=True)
        (partial / "adapter_config.json").write_text(config)
        (partial / "adapter_model.safetensors").write_bytes(weights)
        try:
            os.rename(partial, target)
        except OSError:  # another worker of this server renamed its copy first
            shutil.rmtree(partial, ignore_errors=True)
            if not target.is_dir():
                raise
        return {"path": str(target)}

    def agentrl_remove_adapter(self, payload: str) -> dict[str, Any]:
        """Delete the directories `agentrl_write_adapter` wrote for `name` (after vLLM stopped serving it)."""
        import shutil

        name = json.loads(payload)["name"]
        written = list(_adapter_root(name).glob(f"{name}.*"))
        for directory in written:
            shutil.rmtree(directory, ignore_errors=True)
        return {"removed": len(written)}

    # ------------------------------------------------------------------ internals

    def _agentrl_install(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        start = time.perf_counter()
        self._agentrl_check(tensors)
        try:
            self._agentrl_reload(tensors)
        except Exception as exc:
            self._agentrl_reload(self._agentrl_good)  # back to the last good weights, whole
            raise RuntimeError(f"loading the new weights failed, kept the previous ones: {exc}") from exc
        self._agentrl_good = tensors
        return {"loaded": len(tensors), "seconds": time.perf_counter() - start}

    def _agentrl_reload(self, tensors: dict[str, torch.Tensor] | None) -> None:
        runner = self.model_runner
        if tensors is None:  # the checkpoint this server started from
            runner.reload_weights(weights_path=runner.model_config.model, is_checkpoint_format=True)
        else:
            runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        self._agentrl_retie()

    def _agentrl_retie(self) -> None:
        model = self.model_runner.get_model()
        config = self.model_runner.model_config.hf_config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if not getattr(text, "tie_word_embeddings", False):
            return
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or not hasattr(head, "weight"):
            raise RuntimeError(
                f"{type(model).__name__}: tied embeddings, but no lm_head / model.embed_tokens"
            )
        if head.weight is not embed.weight:
            head.weight = embed.weight
        method = getattr(head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(head)  # refreshes the CPU head's packed copy

    def _agentrl_check(self, tensors: dict[str, torch.Tensor]) -> None:
        """The names and shapes of the server's own checkpoint (tied `lm_head.weight` optional)."""
        expected = self._agentrl_expected()
        missing = sorted(set(expected) - set(tensors) - {"lm_head.weight"})
        unknown = sorted(set(tensors) - set(expected))
        wrong = sorted(
            f"{n}: {tuple(t.shape)} != {expected[n]}"
            for n, t in tensors.items()
            if n in expected and tuple(t.shape) != expected[n]
        )
        problems = [
            f"{label} {items[:5]}{' …' if len(items) > 5 else ''}"
            for label, items in (("missing", missing), ("unknown", unknown), ("wrong shape", wrong))
            if items
        ]
        if problems:
            raise ValueError("weights do not fit the served model: " + "; ".join(problems))

    def _agentrl_expected(self) -> dict[str, tuple[int, ...]]:
        if self._agentrl_shapes is None:
            from safetensors import safe_open

            directory = Path(self.model_runner.model_config.model)
            shapes: dict[str, tuple[int, ...]] = {}
            for file in sorted(directory.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open has keys(), not iteration)
                        shapes[name] = tuple(f.get_slice(name).get_shape())
            if not shapes:
                raise FileNotFoundError(f"no *.safetensors in {directory} to check pushed weights against")
            self._agentrl_shapes = shapes
        return self._agentrl_shapes


def _adapter_root(name: str) -> Path:
    """Where `agentrl_write_adapter` keeps adapters on this host (after checking `name` is a plain name)."""
    import tempfile

    if not name or "/" in name or name.startswith(".") or "*" in name:
        raise ValueError(f"adapter name {name!r}: a plain file name is required")
    return Path(tempfile.gettempdir()) / "agentrl-adapters"
