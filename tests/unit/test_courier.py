"""``swarm.courier.Courier``: callbacks from another thread reach the trio thread in order, all of them by
``close``, none raised into a loop that has finished."""

import threading

import trio
import trio.testing

from swarm.courier import Courier


async def test_callbacks_run_on_the_trio_thread_in_the_order_posted() -> None:
    trio_thread = threading.get_ident()
    seen: list[tuple[int, int]] = []
    done = trio.Event()
    token = trio.lowlevel.current_trio_token()
    courier = Courier(token)

    def record(i: int) -> None:
        seen.append((i, threading.get_ident()))
        if i == 999:
            done.set()

    def producer() -> None:
        for i in range(1000):
            courier.post(record, i)

    await trio.to_thread.run_sync(producer)
    with trio.fail_after(10):
        await done.wait()
    await trio.to_thread.run_sync(courier.close)
    assert [i for i, _ in seen] == list(range(1000))
    assert {t for _, t in seen} == {trio_thread}


async def test_close_hands_over_what_was_posted() -> None:
    got: list[int] = []
    courier = Courier(trio.lowlevel.current_trio_token())
    for i in range(50):
        courier.post(got.append, i)
    await trio.to_thread.run_sync(courier.close)  # the thread has ended: its last run_sync_soon is queued
    await trio.testing.wait_all_tasks_blocked()
    assert got == list(range(50))


def test_a_finished_loop_drops_what_is_left() -> None:
    box: list[Courier] = []

    async def main() -> None:
        box.append(Courier(trio.lowlevel.current_trio_token()))

    trio.run(main)
    ran: list[int] = []
    box[0].post(ran.append, 1)  # run_sync_soon raises RunFinishedError in the courier's thread: caught
    box[0].close()
    assert ran == []
