import threading

import pytest
from django.db import connection

from controlplane import wakeups as notify
from controlplane.scheduling.lock import cycle_transaction


def test_a_watcher_wakes_as_soon_as_its_node_is_signalled():
    seen = notify.node_version("watched")
    woke = []
    watcher = threading.Thread(
        target=lambda: woke.append(notify.wait_for_node_change("watched", seen, timeout_s=30))
    )
    watcher.start()
    assert notify.notify_nodes(["other", "watched", "watched"]) == 2
    watcher.join(timeout=30)
    assert woke == [True]
    assert notify.node_version("watched") == seen + 1


def test_a_watcher_of_an_unchanged_node_times_out():
    seen = notify.node_version("quiet")
    notify.notify_nodes(["noisy"])
    assert notify.wait_for_node_change("quiet", seen, timeout_s=0.05) is False


def test_a_change_signalled_before_the_wait_began_is_not_missed():
    seen = notify.node_version("early")
    notify.notify_nodes(["early"])
    assert notify.wait_for_node_change("early", seen, timeout_s=0) is True


@pytest.mark.django_db(transaction=True)
def test_a_second_cycle_skips_instead_of_waiting_while_the_first_holds_the_lock():
    assert connection.vendor == "postgresql"
    holding = threading.Event()
    release = threading.Event()
    first: list[bool] = []

    def hold():
        try:
            with cycle_transaction() as held:
                first.append(held)
                holding.set()
                release.wait(timeout=30)
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(timeout=30)
    with cycle_transaction() as second:
        assert second is False
    release.set()
    holder.join(timeout=30)
    assert first == [True]
    # Released by the first transaction's commit: the next cycle gets it.
    with cycle_transaction() as third:
        assert third is True
