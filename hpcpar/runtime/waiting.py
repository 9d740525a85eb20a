"""Waiting for MPI without taking a core another rank needs (the ``yield`` wait policy).

Shared by the communicator, the checkpoint writer and the parameter server's polling loop.
"""
from __future__ import annotations

import os
import time

YIELD_SLEEP_S = 50e-6  # long enough to give the core away, short next to any real transfer
YIELD_EAGER_S = 2e-3  # first poll eagerly (yielding the core between polls): quick collectives stay quick
IDLE_SLEEP_MAX_S = 10e-3  # a rank sitting out a long phase wakes at most this late


def polite_pause(waited: float) -> None:
    """Between two polls of a wait that has lasted ``waited`` seconds, give the core away.

    A non-blocking collective advances only inside MPI calls, one algorithm stage per poll:
    sleeping from the first poll on made an 8-byte all-reduce on 4 ranks cost ~450 us. So
    poll eagerly for a moment, handing the core over between polls (sched_yield), and only
    then sleep between polls.
    """
    if waited < YIELD_EAGER_S:
        os.sched_yield()
    else:
        time.sleep(YIELD_SLEEP_S)


def wait_politely(request) -> None:
    """Complete an MPI request without spinning on a core another rank needs."""
    start = time.perf_counter()
    while not request.Test():
        polite_pause(time.perf_counter() - start)


def wait_idle(request) -> None:
    """Complete a request that may take seconds: a rank sitting out another group's work
    (``hpcpar compare`` measuring a layout on fewer ranks). Sleeps between polls, doubling to
    ``IDLE_SLEEP_MAX_S``, so the waiting ranks leave the cores to the working ones: polling
    every 50 us still took a share of a core per waiting rank and slowed the layout measured."""
    pause = YIELD_SLEEP_S
    while not request.Test():
        time.sleep(pause)
        pause = min(2 * pause, IDLE_SLEEP_MAX_S)
