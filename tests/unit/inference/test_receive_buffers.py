"""Receive buffers kept between weight pushes and the commit that adopts the received tensors as the
model's parameters (agentrl/inference/receive_buffers.py, `Engine.load_weights(adopt=True)`).

The engine tests run a real `Engine` on the tiny checkpoint; the server test plays the trainer's
side of a real gloo group against the embedded server in this process (as test_server.py does)
and checks that a reused buffer never carries an aborted push's bytes into the served model, and
that indexed buckets (`ordered_buckets`) are received in index order."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from agentrl.inference.base import BadRequestError
from agentrl.inference.receive_buffers import ReceiveBuffers, storages_in_use
from agentrl.inference.sglang import SGLangClient
from tests.conftest import find_free_port
from tests.unit.inference.conftest import ServerThread

PROMPT = [5, 17, 42, 99, 3]
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def _weights(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """New values for every parameter (tied ones once, as a learner's `named_parameters()` gives)."""
    gen = torch.Generator().manual_seed(seed)
    return {n: (p.detach() + 0.1 * torch.randn(p.shape, generator=gen)).contiguous()
            for n, p in model.named_parameters()}  # fmt: skip


def _reference(tiny_model: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A separately loaded model holding `weights` by plain copies: what the served model must equal."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in weights:
                param.copy_(weights[name])
    return model


def test_adopting_keeps_tied_weights_tied_and_serves_the_pushed_weights(tiny_model: Path) -> None:
    from agentrl.inference.engine import Engine

    engine = Engine(str(tiny_model))
    model = engine.model
    assert engine.owns_params and model.lm_head.weight is model.model.embed_tokens.weight
    new = _weights(model, seed=1)
    engine.load_weights(new, "1", adopt=True)
    for name, param in model.named_parameters():
        assert param.data_ptr() == new[name].data_ptr(), f"{name} was copied, not adopted"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one parameter
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, _reference(tiny_model, new)(input_ids=ids).logits
    assert torch.equal(got, want)
    assert engine.weight_version == "1"


def test_a_given_module_and_storage_tied_parameters_are_copied_into(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    from agentrl.inference.engine import Engine

    # colocated mode: the engine serves a module it was given (its buffers are filled in place)
    given = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    engine = Engine(None, model=given, tokenizer=None)
    assert not engine.owns_params
    before = {n: p.data_ptr() for n, p in given.named_parameters()}
    new = _weights(given, seed=2)
    engine.load_weights(new, "2", adopt=True)
    for name, param in given.named_parameters():
        assert param.data_ptr() == before[name] and torch.equal(param, new[name]), name

    # a tie by shared storage between two parameter objects (not one shared parameter) stays a tie
    engine = Engine(str(tiny_model))
    model = engine.model
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.data)
    ptr = model.lm_head.weight.data_ptr()
    new = _weights(model, seed=3)
    engine.load_weights(new, "3", adopt=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr() == ptr
    # both names were pushed: the later one is what both hold, as with plain copies
    assert torch.equal(model.model.embed_tokens.weight, new["lm_head.weight"])
    # the other parameters were adopted
    assert model.model.norm.weight.data_ptr() == new["model.norm.weight"].data_ptr()


def test_settle_frees_only_buffers_the_model_does_not_use() -> None:
    model = torch.nn.Linear(4, 4, bias=False)
    pool = ReceiveBuffers()
    a, b = pool.take(64, torch.device("cpu")), pool.take(64, torch.device("cpu"))
    model.weight.data = a.view(torch.float32).view(4, 4)  # the model adopts a view of buffer a
    pool.settle(model, cap=1 << 20)
    assert [x.data_ptr() for x in pool.free] == [b.data_ptr()]
    assert pool.take(64, torch.device("cpu")) is b  # the free one is reused
    assert pool.take(64, torch.device("cpu")).data_ptr() not in storages_in_use(model)  # a new one
    pool.settle(model, cap=64)  # over the cap: free buffers are let go, newest kept
    assert pool.free_bytes == 64 and len(pool.owned) == 2
    pool.take(64, torch.device("cpu"))
    pool.take(64, torch.device("cpu"))
    pool.settle(model)  # the default cap: the model's parameter bytes (64), one copy of its weights
    assert pool.free_bytes == 64 and len(pool.owned) == 2


def _state(srv: ServerThread) -> dict:
    from agentrl.inference.protocol import STATE

    return srv._runner.app[STATE]


async def _send(client, group, weights: dict[str, torch.Tensor], names: list[str], version, flat: bool):
    """One bucket: the metadata, then the broadcast (one flat uint8 tensor, or tensor by tensor)."""
    from agentrl.inference.weight_group import dtype_name

    call = asyncio.create_task(
        client.update_weights_from_distributed(
            names,
            [dtype_name(weights[n].dtype) for n in names],
            [list(weights[n].shape) for n in names],
            "wg",
            weight_version=version,
            flattened=flat,
        )
    )
    if flat:
        packed = torch.cat([weights[n].reshape(-1).view(torch.uint8) for n in names])
        await asyncio.to_thread(group.broadcast, packed, 0)
    else:
        for n in names:
            await asyncio.to_thread(group.broadcast, weights[n].clone(), 0)
    await asyncio.wait_for(call, 30)


class _Trainer:
    """An embedded server in this process and the trainer's end (rank 0) of a gloo weight group
    "wg" with it, joined by `join`."""

    def __init__(self, tiny_model: Path) -> None:
        self.srv = ServerThread(tiny_model).start()
        self.port = find_free_port()
        self.group = None

    async def join(self, client: SGLangClient) -> None:
        from agentrl.inference.weight_group import join_group

        joined = asyncio.create_task(
            asyncio.to_thread(join_group, "127.0.0.1", self.port, 0, 2, "wg", "gloo", 30)
        )
        await client.init_weights_update_group("127.0.0.1", self.port, 1, 2, "wg", "gloo")
        self.group = await asyncio.wait_for(joined, 30)

    def close(self) -> None:
        self.srv.stop()
        if self.group is not None:
            self.group.close()


async def test_reused_buffers_never_leak_an_aborted_push_into_the_model(tiny_model: Path) -> None:
    trainer = _Trainer(tiny_model)
    srv = trainer.srv
    model = srv.engine.model
    names = [n for n, _ in model.named_parameters()]
    embed, rest = names[:1], names[1:]  # a one-tensor bucket (sent as it is) and a flattened one

    async def push(client, weights, version, commit=True):
        await client.begin_weight_update()
        await _send(client, trainer.group, weights, embed, None, flat=False)
        await _send(client, trainer.group, weights, rest, version, flat=True)
        if commit:
            await client.end_weight_update()
        else:
            await client.abort_weight_update()

    def served() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    try:
        async with SGLangClient(srv.url) as client:
            await trainer.join(client)
            a, b, c, d = (_weights(model, seed) for seed in (10, 11, 12, 13))
            await push(client, a, 1)
            assert all(torch.equal(t, a[n]) for n, t in served().items())
            out_a = await client.generate(PROMPT, GREEDY)
            pool = _state(srv)["receive_buffers"]
            owned_after_a = len(pool.owned)

            await push(client, b, 2, commit=False)  # received into fresh buffers, then discarded
            # the abort's settle runs in the engine thread before this generation does
            assert (await client.generate(PROMPT, GREEDY)).output_ids == out_a.output_ids
            assert await client.get_weight_version() == 1
            assert all(torch.equal(t, a[n]) for n, t in served().items())
            free_b = {x.untyped_storage().data_ptr() for x in pool.free}
            assert free_b and not free_b & storages_in_use(model)

            await push(client, c, 3)  # received into b's buffers: every byte of b overwritten
            in_model = {p.untyped_storage().data_ptr() for p in model.parameters()}
            assert in_model <= free_b, "the commit did not reuse the aborted push's buffers"
            assert len(pool.owned) == owned_after_a * 2  # a's buffers free now, c's in the model: no more
            assert all(torch.equal(t, c[n]) for n, t in served().items())
            assert model.lm_head.weight is model.model.embed_tokens.weight
            out_c = await client.generate(PROMPT, {**GREEDY, "temperature": 1.0, "sampling_seed": 7})
            ids = torch.tensor([PROMPT + out_c.output_ids])
            with torch.no_grad():
                logp = _reference(tiny_model, c)(input_ids=ids).logits[0].log_softmax(-1)
            want = logp[len(PROMPT) - 1 : -1].gather(1, torch.tensor(out_c.output_ids)[:, None]).squeeze(1)
            assert torch.allclose(torch.tensor(out_c.logprobs), want, atol=1e-5)

            # d arrives in a's old buffers and half of it is aborted: c stays, bit for bit
            await client.begin_weight_update()
            await _send(client, trainer.group, d, embed, None, flat=False)
            await client.abort_weight_update()
            assert await client.get_weight_version() == 3
            assert all(torch.equal(t, c[n]) for n, t in served().items())
    finally:
        trainer.close()


async def test_indexed_buckets_are_received_in_index_order_whatever_order_they_arrive(
    tiny_model: Path,
) -> None:
    """`ordered_buckets`: the trainer may announce bucket i+1 before bucket i's reply, so the two
    requests can reach the server in either order; the server receives them in index order (the
    order of the broadcasts), and refuses an index it has already passed."""
    from agentrl.inference.weight_group import dtype_name

    trainer = _Trainer(tiny_model)
    srv = trainer.srv
    model = srv.engine.model
    names = [n for n, _ in model.named_parameters()]
    first, second = names[:10], names[10:]
    new = _weights(model, seed=20)

    def announce(client, bucket_names, index, version=None):
        return asyncio.create_task(
            client.update_weights_from_distributed(
                bucket_names,
                [dtype_name(new[n].dtype) for n in bucket_names],
                [list(new[n].shape) for n in bucket_names],
                "wg",
                weight_version=version,
                flattened=True,
                bucket=index,
            )
        )

    def packed(bucket_names):
        return torch.cat([new[n].reshape(-1).view(torch.uint8) for n in bucket_names])

    try:
        async with SGLangClient(srv.url) as client:
            await trainer.join(client)
            await client.begin_weight_update()
            assert client.ordered_buckets
            later = announce(client, second, 1, version=5)  # bucket 1 announced first ...
            await asyncio.sleep(0.2)
            assert not later.done()  # ... waits for bucket 0
            earlier = announce(client, first, 0)
            await asyncio.to_thread(trainer.group.broadcast, packed(first), 0)
            await asyncio.to_thread(trainer.group.broadcast, packed(second), 0)
            await asyncio.wait_for(asyncio.gather(earlier, later), 30)
            await client.end_weight_update()
            assert await client.get_weight_version() == 5
            assert all(torch.equal(p, new[n]) for n, p in model.named_parameters())

            await client.begin_weight_update()
            done = announce(client, first, 0)
            await asyncio.to_thread(trainer.group.broadcast, packed(first), 0)
            await asyncio.wait_for(done, 30)
            with pytest.raises(BadRequestError, match="came after bucket 0"):
                await asyncio.wait_for(announce(client, first, 0), 30)  # a repeated index: refused unreceived
            with pytest.raises(BadRequestError, match="a bucket of this session failed"):
                await client.end_weight_update()
            assert await client.get_weight_version() == 5
    finally:
        trainer.close()


async def test_buckets_announced_together_are_received_in_order_and_answered_once(tiny_model: Path) -> None:
    """`bucket_batches`: one request announces a bucket and the ones broadcast after it (`more`);
    the server posts every receive, and one reply comes once all are staged; a bucket announced
    after the batch takes the index after its last."""
    from agentrl.inference.weight_group import dtype_name

    trainer = _Trainer(tiny_model)
    model = trainer.srv.engine.model
    names = [n for n, _ in model.named_parameters()]
    parts = [names[:1], names[1:8], names[8:]]  # one tensor sent as it is, then two flat buckets
    new = _weights(model, seed=40)

    def described(bucket_names, flat):
        return {"names": bucket_names, "dtypes": [dtype_name(new[n].dtype) for n in bucket_names],
                "shapes": [list(new[n].shape) for n in bucket_names],
                "load_format": "flattened_bucket" if flat else None}  # fmt: skip

    try:
        async with SGLangClient(trainer.srv.url) as client:
            await trainer.join(client)
            await client.begin_weight_update()
            assert client.bucket_batches
            head = described(parts[0], False)
            batch = asyncio.create_task(
                client.update_weights_from_distributed(
                    head["names"], head["dtypes"], head["shapes"], "wg", bucket=0,
                    more=[described(parts[1], True)],
                )
            )  # fmt: skip
            last = asyncio.create_task(
                client.update_weights_from_distributed(
                    parts[2], described(parts[2], True)["dtypes"], described(parts[2], True)["shapes"], "wg",
                    weight_version=9, flattened=True, bucket=2,
                )
            )  # fmt: skip
            await asyncio.to_thread(trainer.group.broadcast, new[parts[0][0]].clone(), 0)
            await asyncio.sleep(0.2)
            assert not batch.done()  # its reply waits for the batch's second bucket
            for bucket_names in parts[1:]:
                packed = torch.cat([new[n].reshape(-1).view(torch.uint8) for n in bucket_names])
                await asyncio.to_thread(trainer.group.broadcast, packed, 0)
            await asyncio.wait_for(asyncio.gather(batch, last), 30)
            assert await client.end_weight_update() == 9
            assert all(torch.equal(p, new[n]) for n, p in model.named_parameters())
    finally:
        trainer.close()


async def test_begin_pauses_and_the_commit_continues_and_answers_its_version_in_one_round_trip(
    tiny_model: Path,
) -> None:
    """`session_control`: `/begin_weight_update` with `pause_generation` pauses the engine before
    the session opens; `/end_weight_update` with `continue_generation` continues it after the commit
    and answers the version read after it, and continues it too when the commit is refused (staged
    buckets never leave a mix)."""
    trainer = _Trainer(tiny_model)
    srv = trainer.srv
    model = srv.engine.model
    names = [n for n, _ in model.named_parameters()]
    try:
        async with SGLangClient(srv.url) as client:
            await trainer.join(client)
            assert not client.session_control
            await client.begin_weight_update()  # the first begin's reply tells the client
            assert client.session_control and not srv.engine.paused
            await client.abort_weight_update()

            new = _weights(model, seed=30)
            await client.begin_weight_update(pause=True)
            assert srv.engine.paused
            await _send(client, trainer.group, new, names, 7, flat=True)
            assert srv.engine.paused  # still paused while staged
            assert await client.end_weight_update(resume=True) == 7
            assert not srv.engine.paused and await client.get_weight_version() == 7
            assert all(torch.equal(p, new[n]) for n, p in model.named_parameters())

            await client.begin_weight_update(pause=True)
            wrong = {names[0]: torch.zeros(3, 2)}  # a shape the model does not have: the bucket spoils
            with pytest.raises(BadRequestError, match="shape mismatch"):
                await _send(client, trainer.group, wrong, names[:1], None, flat=False)
            assert srv.engine.paused
            with pytest.raises(BadRequestError, match="a bucket of this session failed"):
                await client.end_weight_update(resume=True)
            assert not srv.engine.paused and await client.get_weight_version() == 7
    finally:
        trainer.close()


def test_full_weights_adopted_over_a_served_adapter_replace_its_base(tiny_model: Path) -> None:
    """After a LoRA adapter was served, a full-weight push adopts the base Linear weights under
    their injected names (`base_layer.weight`); the adapter is cleared and the model serves exactly
    the pushed weights."""
    pytest.importorskip("peft")
    from agentrl.inference.engine import Engine
    from tests.unit.inference.test_peft_adapter import CONFIG, peft_oracle

    engine = Engine(str(tiny_model))
    _, adapter = peft_oracle(tiny_model, seed=4)
    engine.load_adapter(adapter, CONFIG, "1")
    plain = _reference(tiny_model, {})  # the plain model's names, as a learner pushes them
    new = _weights(plain, seed=5)
    engine.load_weights(new, "2", adopt=True)
    params = dict(engine.model.named_parameters())
    q = "model.layers.0.self_attn.q_proj"
    assert params[f"{q}.base_layer.weight"].data_ptr() == new[f"{q}.weight"].data_ptr()
    assert engine.adapter_name is None
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        got, want = engine.model(input_ids=ids).logits, _reference(tiny_model, new)(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_buffer_still_being_received_into_is_not_freed_when_its_session_closes() -> None:
    """The embedded server posts a bucket's receive and waits for it off the engine thread, so a
    session can close (abort) while a receive may still write: that buffer stays out of the free
    list until the receive ended."""
    model = torch.nn.Linear(4, 4, bias=False)
    pool = ReceiveBuffers()
    receiving = pool.take(64, torch.device("cpu"), receiving=True)
    done = pool.take(64, torch.device("cpu"))
    pool.settle(model, cap=1 << 20)
    assert [x.data_ptr() for x in pool.free] == [done.data_ptr()]
    pool.received(receiving)
    pool.settle(model, cap=1 << 20)
    assert sorted(x.data_ptr() for x in pool.free) == sorted([done.data_ptr(), receiving.data_ptr()])
