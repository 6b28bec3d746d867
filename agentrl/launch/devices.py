"""Which device a learner rank (or a server) uses: from what its launcher gave it, never a guess.

Ray gives an actor that asks for GPUs exactly those GPUs: it sets the actor's
`CUDA_VISIBLE_DEVICES` to their ids (`ray.get_gpu_ids()`), which the actor's child inherits, so
inside the child its first GPU is `cuda:0` whatever its index on the node, and an index counted
over the node's ranks (torchrun's `LOCAL_RANK`) names a device that child cannot see. An actor
that asks for none gets `CUDA_VISIBLE_DEVICES=''`. So the Ray launcher tells each rank its
device (`AGENTRL_DEVICE`, from `ray_device`), and the rank takes it or refuses to start
(`local_device`): a rank asked to use a GPU that sees none stops with an error naming what it
was given, instead of falling back to the CPU and gloo.

Pure functions (no torch, no ray), so the launcher and the learner share them and tests check them.
"""

from __future__ import annotations

from collections.abc import Mapping

DEVICE_ENV = "AGENTRL_DEVICE"
"""Set by the Ray launcher for each learner rank: "cpu" or "cuda:0"."""


def ray_device(what: str, field: str, asked_gpus: float, gpu_ids: list[str]) -> str:
    """The device of `what` (a learner rank, a server) from the GPUs its Ray actor asked for
    (`asked_gpus`, from `field`) and those Ray gave it (`gpu_ids`, its `ray.get_gpu_ids()`):
    "cuda:0" (its first own GPU) or "cpu". Raises when it asked for GPUs and got none."""
    if asked_gpus > 0 and not gpu_ids:
        raise RuntimeError(
            f"{what}: {field} asks for {asked_gpus:g} GPU(s) but Ray gave its actor none "
            "(ray.get_gpu_ids() is empty); it will not fall back to the CPU"
        )
    return "cuda:0" if asked_gpus > 0 else "cpu"


def check_gpu_index(what: str, field: str, device: str, gpu_ids: list[str]) -> None:
    """Raise when `device` (`field`'s value: cpu, cuda or cuda:N) names a GPU outside the `gpu_ids`
    Ray gave the actor: Ray hides every other GPU from it, so N counts only its own."""
    if not device.startswith("cuda"):
        return
    index = int(device.partition(":")[2] or 0)
    if index >= len(gpu_ids):
        raise RuntimeError(
            f"{what}: {field}={device} but Ray gave its actor {len(gpu_ids)} GPU(s) and hides the others: "
            "ask for GPUs in its resources (e.g. {GPU: 1}) and count devices from cuda:0"
        )


def local_device(env: Mapping[str, str], cuda_devices: int) -> tuple[str, str]:
    """(device, why) of this process, given its environment and the CUDA devices it sees.

    `AGENTRL_DEVICE` when its launcher set it (the Ray launcher does); else `cuda:<LOCAL_RANK>`
    when CUDA devices are visible (torchrun: each rank sees the node's GPUs), else "cpu". Raises
    when the device it is told to use is not there."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    sees = f"this process sees {cuda_devices} CUDA device(s) (CUDA_VISIBLE_DEVICES={visible!r})"
    asked = env.get(DEVICE_ENV)
    if asked is not None:
        if asked == "cpu":
            return "cpu", f"{DEVICE_ENV}=cpu (its resources ask for no GPU)"
        kind, _, index = asked.partition(":")
        if kind != "cuda" or not (index or "0").isdigit():
            raise RuntimeError(f"{DEVICE_ENV}={asked!r}: use cpu or cuda:N")
        if int(index or 0) >= cuda_devices:
            raise RuntimeError(
                f"{DEVICE_ENV}={asked} (the GPU its launcher gave it) but {sees}; it will not fall "
                "back to the CPU: check the node's CUDA driver and what Ray reports for it (ray status)"
            )
        return f"cuda:{int(index or 0)}", f"{DEVICE_ENV}={asked}; {sees}"
    if cuda_devices == 0:
        return "cpu", f"no {DEVICE_ENV} and {sees}"
    local = int(env.get("LOCAL_RANK", 0))
    if local >= cuda_devices:
        raise RuntimeError(f"LOCAL_RANK={local} but {sees}: one GPU per rank on a node is needed")
    return f"cuda:{local}", f"LOCAL_RANK={local}; {sees}"
