"""`buckets.Packer`: buckets packed into flat buffers kept from push to push, round robin."""

from __future__ import annotations

import torch

from agentrl.weight_sync.buckets import Packer, iter_buckets, prefetch


def test_packs_in_flattened_layout_and_reuses_a_slot_only_three_buckets_later() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [(f"t{i}", torch.randn(8, generator=gen)) for i in range(10)]
    packer = Packer()
    flats = []
    for bucket in iter_buckets(tensors, 100):  # 3 tensors a bucket, the last one 1
        flat = packer.pack(bucket.tensors)
        want = torch.cat([t.view(torch.uint8) for t in bucket.tensors])
        assert torch.equal(flat, want)
        flats.append((flat.untyped_storage().data_ptr(), bucket.nbytes))
    assert len(flats) >= 4
    storages = [ptr for ptr, _ in flats]
    # the three buckets in use at once (broadcast, queued, packed) never share a buffer
    for i in range(len(storages) - 2):
        assert len(set(storages[i : i + 3])) == 3
    assert packer.nbytes <= 3 * max(n for _, n in flats)
    # the next push packs into the same buffers: nothing new is allocated when sizes repeat
    before = packer.nbytes
    again = {packer.pack(b.tensors).untyped_storage().data_ptr() for b in iter_buckets(tensors, 100)}
    assert again <= set(storages) and packer.nbytes == before


def test_packing_on_the_gather_thread_keeps_every_bucket_intact_until_the_next_two_are_packed() -> None:
    """Consumed as the engine does (one bucket at a time, the gather thread one ahead), each packed
    bucket still holds its own bytes while it is used, although slots are reused."""
    tensors = [(f"t{i}", torch.full((16,), float(i))) for i in range(24)]
    packer = Packer()

    def pack(bucket):
        bucket.flat = packer.pack(bucket.tensors)
        return bucket

    seen = 0
    for bucket in prefetch(map(pack, iter_buckets(tensors, 128))):  # two tensors a bucket
        want = torch.cat([t.view(torch.uint8) for t in bucket.tensors])
        assert torch.equal(bucket.flat, want)
        seen += 1
    assert seen == 12 and packer.packed == 12


def test_packing_runs_on_one_thread_and_leaves_every_threads_setting_as_it_was() -> None:
    """The copy runs with one intra-op thread (an OpenMP team would wait on a busy core); the
    packing thread's setting is restored after, and other threads' never change."""
    import threading

    seen = {}
    main_threads = torch.get_num_threads()

    def pack() -> None:
        torch.set_num_threads(2)
        packer = Packer()
        tensors = [torch.randn(1024), torch.randn(512)]
        original = torch.cat

        def cat(parts, **kw):  # the setting at the moment of the copy
            seen["during"] = torch.get_num_threads()
            return original(parts, **kw)

        torch.cat = cat
        try:
            flat = packer.pack(tensors)
        finally:
            torch.cat = original
        seen["after"] = torch.get_num_threads()
        seen["ok"] = torch.equal(flat, original([t.view(torch.uint8) for t in tensors]))

    thread = threading.Thread(target=pack)
    thread.start()
    thread.join()
    assert seen == {"during": 1, "after": 2, "ok": True}
    assert torch.get_num_threads() == main_threads


def test_tensors_already_back_to_back_in_one_storage_are_sent_as_a_view_without_a_copy() -> None:
    """A learner that keeps its weights in the push's buckets (`home_for_push`) is not copied; any
    gap, other order, other storage or non-contiguous tensor is packed as before."""
    flat = torch.arange(40, dtype=torch.float32)
    a, b, c = flat[0:8].view(2, 4), flat[8:20], flat[20:40].view(4, 5)
    packer = Packer()
    view = packer.pack([a, b, c])
    assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert torch.equal(view, flat.view(torch.uint8)) and packer.viewed == 1 and packer.packed == 0
    tail = packer.pack([b, c])  # starts inside the storage
    assert torch.equal(tail, flat[8:].view(torch.uint8)) and packer.viewed == 2
    for tensors in ([a, c], [b, a], [a, b.clone()], [flat[0:8], flat[8:40].view(4, 8).t()]):
        packed = packer.pack(tensors)
        assert packed.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
        assert torch.equal(packed, torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]))
    assert packer.viewed == 2 and packer.packed == 4


def test_the_gather_runs_ahead_through_buckets_that_hold_no_memory_and_one_ahead_otherwise() -> None:
    """`prefetch` holds at most one bucket of its own memory ahead of the consumer (the memory
    bound), while buckets of the learner's resident weights (`held=False`) run ahead freely."""
    import threading

    def gathered(held: bool, ran: list[int]):
        def mark(bucket):
            bucket.held = held
            ran.append(len(ran))
            return bucket

        return mark

    tensors = [(f"t{i}", torch.zeros(4)) for i in range(6)]  # one tensor a bucket
    # held: the one consumed, one queued, one gathered and waiting: 3; resident: all 6
    for held, ahead in ((True, 3), (False, 6)):
        ran: list[int] = []
        buckets = prefetch(map(gathered(held, ran), iter_buckets(tensors, 16)))
        first = next(buckets)  # the consumer holds the first bucket and takes no more
        for _ in range(500):  # let the gather thread go as far as it may
            if len(ran) >= ahead:
                break
            threading.Event().wait(0.01)
        threading.Event().wait(0.05)  # and a little further, were it not bounded
        assert len(ran) == ahead, (held, len(ran))
        assert first.names == ["t0"]
        assert [b.names[0] for b in buckets] == [f"t{i}" for i in range(1, 6)]
