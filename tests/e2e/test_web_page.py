"""The web page at ``/`` in headless chromium (Playwright) against the real server on loopback.

Run: ``bash scripts/install-e2e.sh .venv && FACEGATE_LFW_ROOT=... python -m pytest -q -m e2e tests/e2e``.
What the page shows is checked against the JSON the API returns for the same upload.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

pytestmark = pytest.mark.e2e

FMR_RE = re.compile(r"^\d[\d.e-]* \(1 in [\d,]+\)$")
QUALITY_RE = re.compile(r"^quality (\d\.\d\d) \(gate (\d\.\d\d)\) · (passes|below gate)$")
VERDICTS = {"match": "Match", "no_match": "No match", "refused": "Refused"}


def lfw(root: Path, name: str, n: int) -> Path:
    """``lfw-deepfunneled/<name>/<name>_<n:04d>.jpg`` (skips when that file is missing)."""
    p = root / "lfw-deepfunneled" / name / f"{name}_{n:04d}.jpg"
    if not p.is_file():
        pytest.skip(f"LFW image missing: {p}")
    return p


def tid(name: str) -> str:
    return f'[data-testid="{name}"]'


def assert_png(path: Path, min_bytes: int = 20_000) -> None:
    """The screenshot exists, is a PNG of a real page (not blank)."""
    assert path.is_file(), path
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > min_bytes, f"{path} is only {len(data)} bytes"
    img = cv2.imread(str(path))
    assert img is not None and img.shape[0] >= 600 and img.shape[1] >= 1000, None if img is None else img.shape
    assert float(img.std()) > 10.0, "screenshot is (nearly) uniform"


def crop_state(page: Any, testid: str) -> list[Any]:
    js = "el => [el.complete, el.naturalWidth, el.naturalHeight, (el.getAttribute('src') || '').slice(0, 22)]"
    return page.eval_on_selector(tid(testid), js)


def open_page(page: Any, url: str) -> None:
    """Load ``/`` and wait until the status line says the server is ready."""
    page.goto(url + "/")
    try:
        page.wait_for_selector('body[data-ready="true"]', timeout=15_000)
    except Exception:  # playwright TimeoutError: app.js did not run
        pytest.fail(f"the page's script did not start; browser problems: {page.problems}")
    page.wait_for_selector(f'{tid("status")}[data-state="ready"]')


@pytest.fixture(scope="module")
def server(browser_context: Any, server_factory: Any) -> Any:
    """The default server (tiny models unless FACEGATE_E2E_MODELS=real; quality gate as calibrated)."""
    return server_factory()


@pytest.fixture(scope="module")
def strict_server(browser_context: Any, server_factory: Any) -> Any:
    """A server whose quality gate is 1.0, so every real face is refused."""
    return server_factory(quality_threshold=1.0)


@pytest.fixture
def grey_png(tmp_path: Path) -> Path:
    """A uniform grey image with no face in it."""
    p = tmp_path / "grey.png"
    cv2.imwrite(str(p), np.full((240, 320, 3), 128, np.uint8))
    return p


@pytest.fixture
def no_problems(page: Any) -> Iterator[None]:
    """Fail the test if the page logged a JavaScript error (failed HTTP requests are expected in some tests)."""
    yield
    errors = [p for p in page.problems if p.startswith("page error")]
    assert not errors, errors


# --------------------------------------------------------------------------- compare
def test_page_assets_are_served(server: Any) -> None:
    """``/`` is our page and its CSS/JS are served locally (no CDN)."""
    with server.client() as c:
        html = c.get("/")
        assert html.status_code == 200 and 'data-testid="compare-button"' in html.text
        for asset, kind in (("/static/app.js", "javascript"), ("/static/style.css", "css")):
            r = c.get(asset)
            assert r.status_code == 200, f"{asset}: HTTP {r.status_code} (is api/static mounted at /static?)"
            assert kind in r.headers["content-type"]
    assert "http://" not in html.text.replace("http://www.w3.org", "") and "https://" not in html.text


def test_compare_two_lfw_photos(page: Any, server: Any, lfw_root: Path, tmp_path: Path, no_problems: None) -> None:
    a, b = lfw(lfw_root, "Colin_Powell", 1), lfw(lfw_root, "Colin_Powell", 2)
    open_page(page, server.url)
    assert page.get_attribute(tid("tab-compare"), "aria-selected") == "true"
    assert page.is_disabled(tid("compare-button"))
    page.set_input_files(tid("compare-file-1"), str(a))
    page.set_input_files(tid("compare-file-2"), str(b))
    page.wait_for_selector(f"{tid('compare-preview-2')}:not([hidden])")
    page.click(tid("compare-button"))
    page.wait_for_selector(f"{tid('compare-verdict')}[data-verdict]", state="attached")
    page.wait_for_selector(tid("compare-result"), state="visible")

    # the same upload through the API: the page must show exactly these numbers
    with server.client() as c:
        files = [("img1", (a.name, a.read_bytes(), "image/jpeg")), ("img2", (b.name, b.read_bytes(), "image/jpeg"))]
        api = c.post("/api/compare", params={"crops": "true"}, files=files).json()

    verdict = page.get_attribute(tid("compare-verdict"), "data-verdict")
    assert verdict == api["verdict"]
    assert page.inner_text(tid("compare-verdict")) == VERDICTS[verdict]
    threshold = float(page.inner_text(tid("compare-threshold")))
    assert threshold == pytest.approx(api["threshold"], abs=1e-4)
    assert FMR_RE.match(page.inner_text(tid("compare-fmr"))), page.inner_text(tid("compare-fmr"))
    assert page.inner_text(tid("compare-model")) == api["model"]
    if verdict == "refused":
        assert page.inner_text(tid("compare-similarity")) == "not compared"
        assert page.inner_text(tid("compare-reason")) == api["reason"]
    else:
        sim = float(page.inner_text(tid("compare-similarity")))
        assert -1.0 <= sim <= 1.0
        assert sim == pytest.approx(api["similarity"], abs=2e-4)
        assert (verdict == "match") == (api["similarity"] >= api["threshold"])
        assert "threshold" in page.inner_text(tid("compare-reason"))
    if server.real_models:
        assert verdict == "match", "two LFW photos of Colin Powell should match with the real models"

    for i in (1, 2):
        m = QUALITY_RE.match(page.inner_text(tid(f"compare-quality-{i}")))
        assert m, page.inner_text(tid(f"compare-quality-{i}"))
        q = api["faces"][i - 1]["quality"]
        assert float(m.group(1)) == pytest.approx(q["score"], abs=0.006)
        assert float(m.group(2)) == pytest.approx(q["threshold"], abs=0.006)
        assert (m.group(3) == "passes") == q["accepted"]
        now = float(page.get_attribute(tid(f"compare-qbar-{i}"), "aria-valuenow"))
        assert now == pytest.approx(q["score"], abs=1e-6)
        width = page.eval_on_selector(f"{tid(f'compare-qbar-{i}')} .fill", "el => el.style.width")
        assert float(width.rstrip("%")) == pytest.approx(100 * q["score"], abs=0.01)
        complete, w, h, prefix = crop_state(page, f"compare-crop-{i}")
        assert complete and (w, h) == (112, 112), (complete, w, h)
        assert prefix == "data:image/png;base64,"

    shot = tmp_path / "compare.png"
    page.screenshot(path=str(shot), full_page=True)
    assert_png(shot)


def test_compare_shows_json_error(page: Any, server: Any, lfw_root: Path, tmp_path: Path, no_problems: None) -> None:
    bad = tmp_path / "not-an-image.jpg"
    bad.write_bytes(b"this is not an image")
    open_page(page, server.url)
    page.set_input_files(tid("compare-file-1"), str(bad))
    page.set_input_files(tid("compare-file-2"), str(lfw(lfw_root, "Tony_Blair", 1)))
    page.click(tid("compare-button"))
    box = page.wait_for_selector(f"{tid('compare-error')}:not([hidden])")
    with server.client() as c:
        files = [("img1", ("x.jpg", bad.read_bytes(), "image/jpeg")), ("img2", ("y.jpg", b"x" * 10, "image/jpeg"))]
        api_err = c.post("/api/compare", files=files).json()["error"]
    assert box.get_attribute("data-code") == api_err["code"] == "image_unreadable"
    text = box.inner_text()
    assert "Error 400" in text and "image_unreadable" in text
    assert page.is_hidden(tid("compare-result"))


def test_compare_by_drag_and_drop(page: Any, server: Any, lfw_root: Path, no_problems: None) -> None:
    """Dropping a file on a dropzone selects it (the drop handler fills the file input)."""
    open_page(page, server.url)
    for i, path in ((1, lfw(lfw_root, "Tony_Blair", 1)), (2, lfw(lfw_root, "Tony_Blair", 2))):
        data = list(path.read_bytes())
        dt = page.evaluate_handle(
            """([bytes, name]) => {
                const dt = new DataTransfer();
                dt.items.add(new File([new Uint8Array(bytes)], name, {type: "image/jpeg"}));
                return dt;
            }""",
            [data, path.name],
        )
        page.dispatch_event(f'[data-drop-for="compare-img{i}"]', "drop", {"dataTransfer": dt})
        assert page.eval_on_selector(tid(f"compare-file-{i}"), "el => el.files[0].name") == path.name
        page.wait_for_selector(f"{tid(f'compare-preview-{i}')}:not([hidden])")
    assert page.is_enabled(tid("compare-button"))
    page.focus(tid("compare-button"))
    page.keyboard.press("Enter")
    page.wait_for_selector(f"{tid('compare-verdict')}[data-verdict]", state="attached")
    assert page.inner_text(tid("compare-verdict")) in VERDICTS.values()
    assert crop_state(page, "compare-crop-2")[:3] == [True, 112, 112]


def test_compare_refused_shows_reason(
    page: Any, strict_server: Any, lfw_root: Path, tmp_path: Path, no_problems: None
) -> None:
    open_page(page, strict_server.url)
    page.set_input_files(tid("compare-file-1"), str(lfw(lfw_root, "Tony_Blair", 1)))
    page.set_input_files(tid("compare-file-2"), str(lfw(lfw_root, "Tony_Blair", 2)))
    page.click(tid("compare-button"))
    page.wait_for_selector(f'{tid("compare-verdict")}[data-verdict="refused"]', state="attached")
    assert page.inner_text(tid("compare-verdict")) == "Refused"
    reason = page.inner_text(tid("compare-reason"))
    assert "retake: quality " in reason and "below the gate 1.00" in reason, reason
    assert page.inner_text(tid("compare-similarity")) == "not compared"
    assert page.is_hidden(tid("compare-simbar"))
    assert "below gate" in page.inner_text(tid("compare-quality-1"))
    assert page.inner_text(tid("compare-face-reason-1")).startswith("retake:")
    # each reason is listed with its measured value and limit; this one is the gate's
    reasons = page.locator(f"{tid('compare-face-reasons-1')} li")
    assert reasons.count() >= 1 and page.is_visible(tid("compare-face-reasons-1"))
    ood = page.locator(f"{tid('compare-face-reasons-1')} li[data-code='out_of_distribution']")
    assert "below the gate 1.00" in ood.inner_text()
    assert crop_state(page, "compare-crop-1")[:3] == [True, 112, 112]
    shot = tmp_path / "refused.png"
    page.screenshot(path=str(shot), full_page=True)
    assert_png(shot)


# --------------------------------------------------------------------------- gallery
def test_gallery_enrol_search_delete(
    page: Any, server: Any, lfw_root: Path, tmp_path: Path, grey_png: Path, no_problems: None
) -> None:
    alice = [lfw(lfw_root, "Colin_Powell", n) for n in (1, 2, 3)]
    bob = lfw(lfw_root, "Tony_Blair", 1)
    open_page(page, server.url)

    # keyboard: ArrowRight on the focused tab selects the gallery tab
    page.focus(tid("tab-compare"))
    page.keyboard.press("ArrowRight")
    assert page.get_attribute(tid("tab-gallery"), "aria-selected") == "true"
    assert page.evaluate("document.activeElement.dataset.testid") == "tab-gallery"
    page.wait_for_selector(tid("panel-gallery"), state="visible")
    assert page.is_hidden(tid("panel-compare"))

    page.fill(tid("gallery-name"), "e2e-people")
    page.click(tid("gallery-create"))
    # polled from here: a string predicate would be evaluated inside the page, which its CSP forbids
    for _ in range(100):
        if page.input_value(tid("gallery-select")) == "e2e-people":
            break
        page.wait_for_timeout(100)
    assert page.input_value(tid("gallery-select")) == "e2e-people"
    page.wait_for_selector(f'{tid("gallery-info")}:has-text("0 subjects")')

    # creating it again: the 409 JSON error body is shown
    page.fill(tid("gallery-name"), "e2e-people")
    page.click(tid("gallery-create"))
    err = page.wait_for_selector(f"{tid('gallery-error')}:not([hidden])")
    assert err.get_attribute("data-code") == "gallery_exists" and "Error 409" in err.inner_text()

    # enrol two good photos and one without a face: the faceless one is listed as refused, with its reason
    page.fill(tid("enrol-subject"), "alice")
    page.set_input_files(tid("enrol-files"), [str(alice[0]), str(alice[1]), str(grey_png)])
    page.fill(tid("enrol-meta"), '{"name": "Alice"}')
    page.click(tid("enrol-button"))
    page.wait_for_selector(f"{tid('enrol-result')}:not([hidden])")
    assert "2 of 3 photos accepted" in page.inner_text(tid("enrol-summary"))
    refused = page.locator(tid("enrol-refused-item"))
    assert refused.count() == 1
    assert refused.first.inner_text().startswith("grey.png: refused — ") and len(refused.first.inner_text()) > 25
    row = page.wait_for_selector('[data-testid="subject-row"][data-subject-id="alice"]')
    assert row.inner_text().split("\t")[1].strip() == "2" and '{"name":"Alice"}' in row.inner_text()

    # an enrolment with no usable photo: the 422 error and the per-image reason are shown
    page.fill(tid("enrol-subject"), "nobody")
    page.set_input_files(tid("enrol-files"), [str(grey_png)])
    page.fill(tid("enrol-meta"), "")
    page.click(tid("enrol-button"))
    err = page.wait_for_selector(f"{tid('enrol-error')}:not([hidden])")
    assert "Error 422" in err.inner_text() and "grey.png" in err.inner_text()
    assert err.get_attribute("data-code") in {"no_face", "low_quality"}

    page.fill(tid("enrol-subject"), "bob")
    page.set_input_files(tid("enrol-files"), [str(bob)])
    page.click(tid("enrol-button"))
    page.wait_for_selector('[data-testid="subject-row"][data-subject-id="bob"]')
    page.wait_for_selector(f'{tid("subject-total")}:has-text("(2)")')
    assert page.locator('[data-testid="subject-row"][data-subject-id="nobody"]').count() == 0

    # search with a third photo of alice; the page shows the API's hits, best first
    page.set_input_files(tid("search-file"), str(alice[2]))
    page.fill(tid("search-k"), "5")
    page.click(tid("search-button"))
    page.wait_for_selector(f"{tid('search-result')}:not([hidden])")
    with server.client() as c:
        files = {"image": (alice[2].name, alice[2].read_bytes(), "image/jpeg")}
        api = c.post("/api/galleries/e2e-people/search", params={"k": 5}, files=files).json()
    hits = page.locator(tid("search-hit"))
    assert hits.count() == len(api["hits"]) == 2
    for i, h in enumerate(api["hits"]):
        assert hits.nth(i).get_attribute("data-subject-id") == h["subject_id"]
        score = float(hits.nth(i).locator(tid("search-hit-score")).inner_text())
        assert score == pytest.approx(h["score"], abs=2e-4)
        assert hits.nth(i).locator(tid("search-hit-verdict")).inner_text() == ("match" if h["match"] else "no match")
    if server.real_models:
        assert api["hits"][0]["subject_id"] == "alice" and api["hits"][0]["match"]
    summary = page.inner_text(tid("search-summary"))
    assert ("Best: " in summary) if api["hits"][0]["match"] else summary.startswith("No match")

    shot = tmp_path / "gallery.png"
    page.screenshot(path=str(shot), full_page=True)
    assert_png(shot)

    # delete bob (confirm dialog accepted)
    page.once("dialog", lambda d: d.accept())
    page.click('[data-testid="subject-row"][data-subject-id="bob"] [data-testid="subject-delete"]')
    page.wait_for_selector('[data-testid="subject-row"][data-subject-id="bob"]', state="detached")
    page.wait_for_selector(f'{tid("subject-total")}:has-text("(1)")')
    page.wait_for_selector(f'{tid("gallery-info")}:has-text("1 subject ")')
    with server.client() as c:
        listed = c.get("/api/galleries/e2e-people/subjects").json()
    assert [s["subject_id"] for s in listed["subjects"]] == ["alice"]
