"""The FSDP2 backend through the seam's own methods on the tiny model (a real world-size-1 gloo
group): `local_shards` gives every parameter's local shard in place with its DTensor placement
(what a colocated engine reads), consistent with `full_tensors`; a frozen part has no optimizer
and no gradients."""

import torch

from agentrl.config import OptimConfig
from agentrl.learner.registry import create


def test_local_shards_are_the_parameters_in_place_with_their_placements(tiny_model):
    backend = create("fsdp2")
    actor = backend.build("policy", tiny_model, optim=OptimConfig(lr=1e-3))
    shards = list(backend.local_shards(actor))
    full = dict(backend.full_tensors(actor))
    assert [s.name for s in shards] == list(full)
    params = dict(actor.module.named_parameters())
    for shard in shards:
        assert type(shard.placements[0]).__name__ == "Shard" and shard.mesh.size() == backend.world_size
        assert shard.global_shape == full[shard.name].shape
        assert shard.local.data_ptr() == params[shard.name].to_local().data_ptr()  # no copy
        if backend.world_size == 1:
            torch.testing.assert_close(shard.local, full[shard.name], rtol=0, atol=0)
    ref = backend.build("policy", tiny_model, name="ref")
    assert not ref.trainable and not ref.module.training
    assert not any(p.requires_grad for p in ref.module.parameters())
