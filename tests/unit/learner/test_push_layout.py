"""`fsdp.home_for_push`: an FSDP2 actor on one rank lays its weights out in the weight push's
buckets (a real world-size-1 gloo group, the tiny model). Training is unchanged, bit for bit,
against a twin built without it; after the steps the pushed tensors still lie back to back per
bucket, so the push sends each bucket as a view of the weights (no packing copy) holding the
trained values; tied weights stay one parameter."""

import torch

from agentrl.config import OptimConfig
from agentrl.learner.registry import create
from agentrl.weight_sync.base import Resident
from agentrl.weight_sync.buckets import Packer, iter_buckets


def _steps(backend, actor, steps: int = 2) -> list[float]:
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, actor.module.config.vocab_size, (2, 12), generator=gen)
        loss = actor.module(input_ids=ids).logits.float().log_softmax(-1).mean()
        loss.backward()
        backend.optimizer_step(actor, max_grad_norm=1.0)
        losses.append(loss.item())
    return losses


def test_an_actor_laid_out_in_push_buckets_trains_alike_and_is_pushed_without_a_copy(tiny_model):
    backend = create("fsdp2")
    plain = backend.build("policy", tiny_model, optim=OptimConfig(lr=1e-2))
    nbytes = sum(p.numel() * p.element_size() for p in plain.module.parameters())
    bucket = nbytes // 4
    homed = backend.build("policy", tiny_model, optim=OptimConfig(lr=1e-2), push_buckets=bucket)
    config = homed.module.config
    if config.tie_word_embeddings:
        assert homed.module.get_output_embeddings().weight is homed.module.get_input_embeddings().weight

    assert _steps(backend, homed) == _steps(backend, plain)
    # on one rank the pushed tensors are the parameters in place: the push may gather ahead freely
    assert isinstance(backend.full_tensors(homed), Resident)
    params = {p.to_local().data_ptr() for p in homed.module.parameters()}
    assert all(t.data_ptr() in params for _, t in backend.full_tensors(homed))
    pushed, want = dict(backend.full_tensors(homed)), dict(backend.full_tensors(plain))
    assert list(pushed) == list(want)
    for name in want:
        assert torch.equal(pushed[name], want[name]), name

    packer, multi = Packer(), 0
    for b in iter_buckets(backend.full_tensors(homed), bucket):
        if len(b.tensors) < 2:
            continue
        multi += 1
        flat = packer.pack(b.tensors)
        assert flat.untyped_storage().data_ptr() == b.tensors[0].untyped_storage().data_ptr()
        assert torch.equal(flat, torch.cat([want[n].reshape(-1).view(torch.uint8) for n in b.names]))
    assert multi >= 2 and packer.viewed == multi and packer.packed == 0

    # a checkpoint load (in place, as DCP's `set_state_dict` does) keeps the layout
    homed.module.load_state_dict(homed.module.state_dict())
    for b in iter_buckets(backend.full_tensors(homed), bucket):
        if len(b.tensors) > 1:
            packer.pack(b.tensors)
    assert packer.viewed == 2 * multi and packer.packed == 0
