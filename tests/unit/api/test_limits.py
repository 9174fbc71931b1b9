"""Admission bound, pixel budget, token buckets and route scopes, without a server."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from facegate.api.limits import Admission, AdmissionLimit, PixelBudget
from facegate.api.security import TokenBuckets, required_scope
from facegate.config import Limits, Settings


def _slot_start(t: float) -> float:
    width = AdmissionLimit.WINDOW_S / AdmissionLimit._SLOTS
    return math.ceil(t / width) * width


FLOOR = AdmissionLimit.FLOOR


def test_admission_limit_follows_the_completion_rate() -> None:
    bound = AdmissionLimit(max_admitted=1000, deadline_s=30.0)  # queue target: 0.5 s
    t = _slot_start(1000.0)
    assert bound.limit(t) == 1000  # nothing measured yet
    bound.busy(t - 10)
    for i in range(40):  # 10 requests/s over the window before t
        bound.finished(t - AdmissionLimit.WINDOW_S + i * 0.1)
    assert bound.limit(t) == 5  # 35 completions in the 3.5 s of completed slots: 10/s × 0.5 s


def test_admission_limit_remembers_the_rate_through_idle_time() -> None:
    """A quiet hour, then a burst: the burst is admitted up to the rate shown before, not a decayed one."""
    bound = AdmissionLimit(max_admitted=1000, deadline_s=30.0)
    t = _slot_start(10_000.0)
    bound.busy(t - 10)
    for i in range(400):  # 100/s
        bound.finished(t - AdmissionLimit.WINDOW_S + i * 0.01)
    before = bound.limit(t)
    assert before == 50  # 350 completions in the 3.5 s of completed slots: 100/s × 0.5 s
    later = t + 3600
    bound.busy(later)  # the burst's first request
    bound.shed(later)
    assert bound.limit(later) == before
    # shedding right after it got busy: the few completions so far do not shrink the bound
    bound.finished(later + 0.6)
    assert bound.limit(later + 1.0) == before
    # after half a window busy and shedding, the window's rate bounds it; it never falls below FLOOR
    for i in range(48):
        bound.finished(later + 1.0 + i * 0.04)
    bound.shed(later + 3.0)
    assert bound.limit(later + 3.0) == math.ceil(49 / 3.0 * 0.5)  # 49 completions in 6 slots
    bound.shed(later + 8.0)
    assert bound.limit(later + 8.0) == FLOOR  # nothing finished in the window


def test_admission_limit_never_exceeds_max() -> None:
    bound = AdmissionLimit(max_admitted=1, deadline_s=1.0)
    t = _slot_start(100.0)
    bound.finished(t - 1)
    assert bound.limit(t) == 1


def test_a_late_loop_cuts_the_cap_only_while_shedding_and_a_punctual_one_restores_it() -> None:
    adm = Admission(Settings(device="cpu"))
    top = adm.bound.max_admitted
    adm.admitted = 200
    t = 1000.0
    adm.lagged(0.3, t)  # late, but nothing refused: the cap stays off
    assert adm.cap == top
    adm.bound.shed(t)
    adm.lagged(0.3, t)
    assert adm.cap == 180  # 0.9 of what is admitted
    adm.lagged(0.3, t + 0.05)
    assert adm.cap == 180  # at most one cut per CUT_EVERY_S
    adm.lagged(0.3, t + Admission.CUT_EVERY_S)
    assert adm.cap == 162
    assert adm.refuse(t + 0.2) is not None  # 200 admitted, over the cap
    adm.lagged(0.005, t + 0.3)  # neither late nor punctual: held
    assert adm.cap == 162
    for i in range(10):  # punctual turns raise it by one each
        adm.lagged(0.0, t + 0.3 + i * Admission.TICK_S)
    assert adm.cap == 172
    adm.admitted = 0
    for i in range(100):  # a cut never goes below the floor
        adm.bound.shed(t + 1 + i * Admission.CUT_EVERY_S)
        adm.lagged(1.0, t + 1 + i * Admission.CUT_EVERY_S)
    assert adm.cap == FLOOR
    adm.lagged(0.0, t + 100 + AdmissionLimit.WINDOW_S)  # nothing refused for a window: lifted
    assert adm.cap == top


def test_the_loop_watch_ticks_only_while_refusing() -> None:
    adm = Admission(Settings(device="cpu"))
    adm.cap = adm.admitted = 10
    lags: list[float] = []
    adm.lagged = lambda lag_s, now: lags.append(lag_s)  # type: ignore[method-assign]

    async def main() -> tuple[tuple[int, bool], bool]:
        adm.watch(asyncio.get_running_loop())
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
