"""The body limit each route applies before reading (facegate.api.app.body_limit)."""

from __future__ import annotations

from facegate.api.app import MULTIPART_SLACK_BYTES, SMALL_BODY_BYTES, body_limit
from facegate.config import Settings


def test_image_routes_allow_their_images_and_other_routes_a_small_body() -> None:
    s = Settings()
    one = s.limits.max_upload_bytes
    many = s.limits.max_images_per_request * one
    assert body_limit(s, "POST", "/api/compare") == 2 * one + MULTIPART_SLACK_BYTES
    assert body_limit(s, "POST", "/api/detect") == one + MULTIPART_SLACK_BYTES
    assert body_limit(s, "POST", "/api/galleries/g/search") == one + MULTIPART_SLACK_BYTES
    for path in ("/api/embed", "/api/galleries/g/subjects/alice", "/api/galleries/g/enrolments"):
        assert body_limit(s, "POST", path) == many + MULTIPART_SLACK_BYTES, path
    assert body_limit(s, "POST", "/api/galleries") == SMALL_BODY_BYTES
    assert body_limit(s, "GET", "/api/compare") == SMALL_BODY_BYTES
    # the template import fits 10,000 templates of the served model (128 numbers for sface)
    assert body_limit(s, "POST", "/api/galleries/g/templates") == 10_000 * (26 * 128 + 200) > SMALL_BODY_BYTES
