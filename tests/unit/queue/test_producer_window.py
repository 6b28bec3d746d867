"""The producer's byte window: bounded, first come first served, and an ack wakes only who fits."""

from __future__ import annotations

import asyncio

from agentrl.queue.zmq_producer import ByteWindow


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_waiters_get_in_in_order_and_only_when_they_fit() -> None:
    async def main() -> None:
        window = ByteWindow(100)
        got: list[str] = []

        async def put(name: str, nbytes: int) -> None:
            await window.acquire(nbytes)
            got.append(name)

        await put("a", 60)
        tasks = [asyncio.create_task(put(name, n)) for name, n in (("b", 50), ("c", 10), ("d", 40))]
        await _settle()
        assert got == ["a"]  # c would fit, but b came first: no overtaking
        window.release(60)
        await _settle()
        assert got == ["a", "b", "c", "d"] and window.used == 100
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_a_release_wakes_only_the_waiters_that_fit() -> None:
    async def main() -> None:
        window = ByteWindow(100)
        await window.acquire(100)
        woken = 0

        async def put() -> None:
            nonlocal woken
            await window.acquire(50)
            woken += 1

        tasks = [asyncio.create_task(put()) for _ in range(10)]
        await _settle()
        window.release(100)
        await _settle()
        assert woken == 2 and window.used == 100
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def test_cancelled_waiters_give_back_what_they_were_granted() -> None:
    async def main() -> None:
        window = ByteWindow(100)
        await window.acquire(100)
        first = asyncio.create_task(window.acquire(30))
        second = asyncio.create_task(window.acquire(30))
        await _settle()
        second.cancel()  # cancelled while waiting: never counted
        window.release(100)  # grants `first`, skips `second`
        first.cancel()  # cancelled after the grant, before it ran: gives the bytes back
        await asyncio.gather(first, second, return_exceptions=True)
        assert window.used == 0
        await window.acquire(100)  # the whole window is free again
        assert window.used == 100

    asyncio.run(main())


def test_one_put_larger_than_the_window_goes_alone() -> None:
    async def main() -> None:
        window = ByteWindow(100)
        await window.acquire(500)
        waiting = asyncio.create_task(window.acquire(1))
        await _settle()
        assert not waiting.done()
        window.release(500)
        await asyncio.wait_for(waiting, 1)
        assert window.used == 1

    asyncio.run(main())
