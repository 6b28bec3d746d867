"""The device of a learner rank or server from what its launcher (Ray, torchrun) gave it."""

from __future__ import annotations

import pytest

from agentrl.launch.devices import DEVICE_ENV, check_gpu_index, local_device, ray_device


def test_ray_device_is_the_actors_first_own_gpu_or_cpu_and_never_a_fallback():
    assert ray_device("learner rank 1", "learner.resources", 1, ["3"]) == "cuda:0"  # its GPU 3 is its cuda:0
    assert ray_device("learner rank 0", "learner.resources", 0, []) == "cpu"
    with pytest.raises(
        RuntimeError, match=r"learner rank 1: learner.resources asks for 1 GPU\(s\) but Ray gave"
    ):
        ray_device("learner rank 1", "learner.resources", 1, [])


def test_local_device_takes_what_the_launcher_gave_or_refuses():
    # Ray: each rank's actor sees only its own GPU, whatever LOCAL_RANK says
    env = {DEVICE_ENV: "cuda:0", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "1"}
    assert local_device(env, 1)[0] == "cuda:0"
    with pytest.raises(
        RuntimeError, match=r"AGENTRL_DEVICE=cuda:0 .* sees 0 CUDA device\(s\) \(CUDA_VISIBLE_DEVICES='1'\)"
    ):
        local_device(env, 0)  # a GPU was given but none is usable: no silent CPU
    assert local_device({DEVICE_ENV: "cpu", "CUDA_VISIBLE_DEVICES": ""}, 0)[0] == "cpu"
    with pytest.raises(RuntimeError, match="use cpu or cuda:N"):
        local_device({DEVICE_ENV: "gpu"}, 1)
    # torchrun: every rank sees the node's GPUs and takes its LOCAL_RANK
    assert local_device({"LOCAL_RANK": "1"}, 2)[0] == "cuda:1"
    with pytest.raises(RuntimeError, match="LOCAL_RANK=2 but this process sees 2"):
        local_device({"LOCAL_RANK": "2"}, 2)
    assert local_device({}, 0) == (
        "cpu",
        "no AGENTRL_DEVICE and this process sees 0 CUDA device(s) (CUDA_VISIBLE_DEVICES=None)",
    )


def test_a_servers_cuda_index_counts_only_the_gpus_ray_gave_it():
    check_gpu_index("server0", "inference.device", "cpu", [])
    check_gpu_index("server0", "inference.device", "cuda", ["5"])
    with pytest.raises(RuntimeError, match=r"inference.device=cuda:1 but Ray gave its actor 1 GPU"):
        check_gpu_index("server0", "inference.device", "cuda:1", ["5"])
    with pytest.raises(RuntimeError, match=r"inference.device=cuda but Ray gave its actor 0 GPU"):
        check_gpu_index("server0", "inference.device", "cuda", [])
