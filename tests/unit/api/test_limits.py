"""Admission bound, pixel budget, token buckets and route scopes, without a server."""

from __future__ import annotations

import asyncio
import math
import random
import time

import pytest

from facegate.api.limits import Admission, PixelBudget
from facegate.api.security import TokenBuckets, required_scope
from facegate.config import Limits, Settings


def _slot_start(t: float) -> float:
    width = Admission.WINDOW_S / Admission._SLOTS
    return math.ceil(t / width) * width


def _admission(max_admitted: int, deadline_s: float) -> Admission:
    return Admission(Settings(device="cpu", limits=Limits(max_admitted=max_admitted, request_timeout_s=deadline_s)))


FLOOR = Admission.FLOOR
QUEUE_S = Admission.QUEUE_S


def test_admission_limit_follows_the_completion_rate() -> None:
    adm = _admission(1000, 30.0)  # queue target: QUEUE_S
    t = _slot_start(1000.0)
    assert adm.bound(t) == 1000  # nothing measured yet
    adm.busy(t - 10)
    for i in range(40):  # 10 requests/s over the window before t
        adm.finished(t - Admission.WINDOW_S + i * 0.1)
    assert adm.bound(t) == math.ceil(10 * QUEUE_S)  # 35 completions in the 3.5 s of completed slots: 10/s
    assert _admission(1000, 1.0).target_s == 0.25  # a short deadline: a quarter


def test_admission_limit_remembers_the_rate_through_idle_time() -> None:
    """A quiet hour, then a burst: the burst is admitted up to the rate shown before, not a decayed one."""
    adm = _admission(1000, 30.0)
    t = _slot_start(10_000.0)
    adm.busy(t - 10)
    for i in range(400):  # 100/s
        adm.finished(t - Admission.WINDOW_S + i * 0.01)
    before = adm.bound(t)
    assert before == math.ceil(100 * QUEUE_S)  # 350 completions in the 3.5 s of completed slots: 100/s
    later = t + 3600
    adm.busy(later)  # the burst's first request
    adm.last_shed = later
    assert adm.bound(later) == before
    # shedding right after it got busy: the few completions so far do not shrink the bound
    adm.finished(later + 0.6)
    assert adm.bound(later + 1.0) == before
    # after half a window busy and shedding, the window's rate bounds it; it never falls below FLOOR
    for i in range(48):
        adm.finished(later + 1.0 + i * 0.04)
    adm.last_shed = later + 3.0
    assert adm.bound(later + 3.0) == math.ceil(49 / 3.0 * QUEUE_S)  # 49 completions in 6 slots
    adm.last_shed = later + 8.0
    assert adm.bound(later + 8.0) == FLOOR  # nothing finished in the window


def test_admission_limit_learns_no_rate_from_a_start() -> None:
    """A fresh process's first slow second (a cold start, a client's ramp) sets no bound: only a rate over half a
    window busy does, so a load that steps up right after start is not refused at the cold rate."""
    adm = _admission(1000, 30.0)
    t = _slot_start(500.0)
    adm.busy(t)
    for i in range(5):  # 10/s in the first half second
        adm.finished(t + i * 0.1)
    half = Admission.WINDOW_S / Admission._SLOTS
    adm.last_shed = t + half
    assert adm.bound(t + half) == 1000  # one slot busy: no rate counts yet
    for i in range(300):  # then 200/s
        adm.finished(t + half + i / 200)
    end = t + Admission.WINDOW_S / 2
    assert adm.bound(end) == math.ceil((5 + 300) / (Admission.WINDOW_S / 2) * QUEUE_S)


def test_admission_limit_never_exceeds_max() -> None:
    adm = _admission(1, 1.0)
    t = _slot_start(100.0)
    adm.finished(t - 1)
    assert adm.bound(t) == 1


def test_a_late_loop_cuts_the_cap_in_proportion_only_while_shedding_and_a_punctual_one_restores_it() -> None:
    adm = Admission(Settings(device="cpu"))
    top = adm.max_admitted  # nothing measured: the bound is max_admitted
    adm.admitted = 200
    t = 1000.0
    adm.lagged(0.3, t)  # late, but nothing refused: the cap stays off
    assert adm.cap == top
    adm.last_shed = t
    adm.lagged(0.3, t)  # six times LAG_AIM_S late: the deepest cut
    assert adm.cap == top // 2
    adm.lagged(0.3, t + 0.05)
    assert adm.cap == top // 2  # at most one cut per CUT_EVERY_S
    adm.lagged(0.3, t + 0.1)
    assert adm.cap == top // 4
    adm.lagged(0.075, t + 0.21)  # 1.5 × LAG_AIM_S late: to two thirds
    assert adm.cap == math.floor(top // 4 * 2 / 3)
    cap = adm.cap
    adm.lagged(0.011, t + 0.32)  # just late: the mildest cut
    assert adm.cap == math.floor(cap * Admission.CUT)
    assert adm.refuse(t + 0.35) is not None  # 200 admitted, over the cap
    cap = adm.cap
    adm.lagged(0.005, t + 0.4)  # neither late nor punctual: held
    assert adm.cap == cap
    for i in range(10):  # punctual turns raise it by one each
        adm.lagged(0.0, t + 0.4 + i * Admission.TICK_S)
    assert adm.cap == cap + 10
    cap = adm.cap
    adm.lagged(0.09, t + 0.6)  # one stall, shorter than CUT_EVERY_S, after punctual turns: the mildest cut
    assert adm.cap == math.floor(cap * Admission.CUT)
    adm.admitted = 0
    for i in range(100):  # a cut never goes below the floor
        adm.last_shed = t + 1 + i * Admission.CUT_EVERY_S
        adm.lagged(1.0, t + 1 + i * Admission.CUT_EVERY_S)
    assert adm.cap == FLOOR
    adm.lagged(0.0, t + 100 + Admission.WINDOW_S)  # nothing refused for a window: lifted
    assert adm.cap == top


def test_the_cap_rises_no_higher_than_the_bound_so_that_a_cut_bites_at_once() -> None:
    adm = Admission(Settings(device="cpu"))
    t = _slot_start(1000.0)
    adm.busy(t - 10)
    for i in range(200):  # 50/s over the window: a bound of 50 × QUEUE_S
        adm.finished(t - Admission.WINDOW_S + i * 0.02)
    bound = adm.bound(t)
    assert bound == math.ceil(50 * QUEUE_S)
    adm.last_shed = t
    for i in range(1000):  # a punctual loop for 10 s of turns
        adm.lagged(0.0, t + i * 1e-5)
    assert adm.cap == bound + 1
    adm.lagged(1.0, t + 0.1)  # the first late turn halves what is admitted, not a cap far above it
    assert adm.cap == bound // 2


def test_a_flood_frees_a_saturated_loop_within_its_first_second_and_keeps_admitting() -> None:
    """A synthetic front-end: each loop turn takes 1 ms per admitted request (so turns are late past 10
    admitted, and refusals are answered late past 50), admitted work leaves at 1/0.3 s of what is admitted,
    and a flood fills every free place at once. The flood starts with the bound of a fast engine (200)."""
    rng = random.Random(0)
    adm = Admission(Settings(device="cpu"))
    t = _slot_start(1000.0)
    adm.busy(t - 10)
    for i in range(1600):  # 400/s: a bound of 400 × QUEUE_S, far above what the loop turns within 50 ms
        adm.finished(t - Admission.WINDOW_S + i / 400)
    admitted = 0.0
    late: list[tuple[float, float]] = []  # (seconds into the flood, turn lateness)
    start = t
    while t < start + 3.0:
        adm.last_shed = t
        limit = min(adm.cap, adm.bound(t))
        admitted = max(admitted, float(limit))  # the flood fills what is free
        lag = 0.001 * admitted * rng.uniform(0.0, 2.0)
        adm.admitted = int(admitted)
        adm.lagged(lag, t)
        step = Admission.TICK_S + lag
        admitted -= admitted * min(1.0, step / 0.3)
        late.append((t - start, lag))
        t += step
    first_s = next(s for s, lag in late if lag < Admission.LAG_AIM_S and s > 0)
    assert first_s < 1.0  # the turns are punctual enough for the refusals within the first second
    steady = [lag for s, lag in late if s >= 1.0]
    assert sorted(steady)[int(0.99 * len(steady))] < Admission.LAG_AIM_S
    assert sum(steady) / len(steady) > Admission.LAG_HIGH_S / 4  # and it admits, not stuck at the floor


def test_the_loop_watch_ticks_only_while_refusing() -> None:
    adm = Admission(Settings(device="cpu"))
    adm.cap = adm.admitted = 10
    lags: list[float] = []
    adm.lagged = lambda lag_s, now: lags.append(lag_s)  # type: ignore[method-assign]

    async def main() -> tuple[tuple[int, bool], bool]:
        adm.loop = asyncio.get_running_loop()
        await asyncio.sleep(0.05)
        idle = len(lags), adm._armed  # nothing refused: no timer
        assert adm.refuse(time.monotonic()) is not None  # at the cap: refused, the timer starts
        await asyncio.sleep(0.1)
        return idle, adm._armed

    idle, armed = asyncio.run(main())
    assert idle == (0, False)
    # each turn's lateness (asyncio may run a timer up to a clock tick early)
    assert armed and lags and all(lag > -0.001 for lag in lags)


def test_pixel_budget_waits_and_is_first_come_first_served() -> None:
    async def run() -> list[str]:
        budget = PixelBudget(Limits(request_pixels=10_000, decode_pixels_in_flight=10_000))
        order: list[str] = []
        await budget.acquire(8000)

        async def want(name: str, n: int) -> None:
            await budget.acquire(n)
            order.append(name)
            budget.release(n)

        a = asyncio.create_task(want("a", 5000))
        b = asyncio.create_task(want("b", 1000))
        c = asyncio.create_task(want("c", 9000))
        await asyncio.sleep(0.01)
        assert order == [] and budget.held == 8000  # b fits, but waits behind a
        c.cancel()  # a waiter that goes away holds nothing
        budget.release(8000)
        await asyncio.gather(a, b, return_exceptions=True)
        assert budget.held == 0
        return order

    assert asyncio.run(run()) == ["a", "b"]


def test_token_buckets() -> None:
    tb = TokenBuckets(rate_per_s=2.0, burst=2, max_clients=2)
    assert tb.take("k", now=0.0) == 0.0 and tb.take("k", now=0.0) == 0.0
    assert tb.take("k", now=0.0) == pytest.approx(0.5)
    assert tb.take("k", now=0.5) == 0.0  # one token back after 0.5 s
    assert tb.take("other", now=0.5) == 0.0
    tb.take("third", now=0.5)
    assert len(tb._buckets) == 2  # bounded memory


@pytest.mark.parametrize(
    ("method", "path", "scope"),
    [
        ("POST", "/api/compare", "read"),
        ("POST", "/api/embed/", "read"),
        ("POST", "/api/galleries/g/search", "read"),
        ("GET", "/api/galleries", "read"),
        ("POST", "/api/galleries", "admin"),
        ("DELETE", "/api/galleries/g", "admin"),
        ("POST", "/api/galleries/g/subjects/s", "enrol"),
        ("DELETE", "/api/galleries/g/subjects/s", "enrol"),
        ("GET", "/api/galleries/g/subjects", "enrol"),
        ("GET", "/api/anything-new", "admin"),
        ("GET", "/healthz", None),
        ("GET", "/docs", None),
        ("GET", "/metrics", None),
    ],
)
def test_route_scopes(method: str, path: str, scope: str | None) -> None:
    assert required_scope(method, path, Settings()) == scope


def test_metrics_behind_a_key_when_configured() -> None:
    assert required_scope("GET", "/metrics", Settings(security={"metrics_access": "key"})) == "read"
