"""The API key store: random keys, stored hashed (0600), scopes, revocation, reload by a running reader."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from facegate.errors import InvalidParameterError
from facegate.service import keys as keys_mod
from facegate.service.keys import KeyStore, parse_scopes


def test_create_verify_revoke(tmp_path: Path) -> None:
    store = KeyStore(tmp_path)
    assert len(store) == 0 and store.verify("fg_x_y") is None
    token, rec = store.create("ci", ["enrol", "read"])
    assert token.startswith(f"fg_{rec.id}_") and len(token) >= 40
    assert rec.scopes == ("read", "enrol")
    raw = (tmp_path / "api_keys.json").read_text()
    assert token not in raw and hashlib.sha256(token.encode()).hexdigest() in raw
    assert stat.S_IMODE(os.stat(tmp_path / "api_keys.json").st_mode) == 0o600
    key = store.verify(token)
    assert key is not None and key.allows("read") and key.allows("enrol") and not key.allows("admin")
    assert store.verify(token[:-1] + ("A" if token[-1] != "A" else "B")) is None
    assert store.verify("") is None and store.verify("x" * 10_000) is None
    admin_token, _ = store.create("ops", ["admin"])
    admin = store.verify(admin_token)
    assert admin is not None and all(admin.allows(s) for s in ("read", "enrol", "admin"))
    assert [k.name for k in store.list_keys()] == ["ci", "ops"]
    assert "sha256" not in store.list_keys()[0].public()
    store.revoke(rec.id)
    assert store.verify(token) is None and store.verify(admin_token) is not None
    with pytest.raises(InvalidParameterError):
        store.revoke(rec.id)


def test_two_keys_differ_and_scopes_are_checked(tmp_path: Path) -> None:
    store = KeyStore(tmp_path, tmp_path / "k.json")
    a, _ = store.create("a", ["read"])
    b, _ = store.create("a", ["read"])
    assert a != b
    for bad in ([], ["write"], ["read", "root"]):
        with pytest.raises(InvalidParameterError):
            parse_scopes(bad)
    assert parse_scopes(["admin", "read", "read"]) == ("read", "admin")


def test_a_reader_sees_keys_another_process_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keys_mod, "RELOAD_INTERVAL_S", 0.0)
    reader = KeyStore(tmp_path)
    writer = KeyStore(tmp_path)
    token, rec = writer.create("late", ["read"])
    assert reader.verify(token) is not None
    writer.revoke(rec.id)
    assert reader.verify(token) is None


def test_a_broken_file_keeps_the_keys_read_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keys_mod, "RELOAD_INTERVAL_S", 0.0)
    store = KeyStore(tmp_path)
    token, _ = store.create("x", ["read"])
    (tmp_path / "api_keys.json").write_text("{not json")
    assert store.verify(token) is not None


def test_keys_cli(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from facegate.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["keys", "create", "--name", "desk", "--scope", "enrol", "--data-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    made = json.loads(r.stdout)
    assert made["scopes"] == ["enrol"] and made["key"].startswith("fg_")
    listed = json.loads(runner.invoke(app, ["keys", "list", "--data-dir", str(tmp_path)]).stdout)
    assert [k["id"] for k in listed] == [made["id"]] and "key" not in listed[0] and "sha256" not in listed[0]
    bad = runner.invoke(app, ["keys", "create", "--scope", "root", "--data-dir", str(tmp_path)])
    assert bad.exit_code == 2
    r = runner.invoke(app, ["keys", "revoke", made["id"], "--data-dir", str(tmp_path)])
    assert (
        r.exit_code == 0 and json.loads(runner.invoke(app, ["keys", "list", "--data-dir", str(tmp_path)]).stdout) == []
    )
    assert KeyStore(tmp_path).verify(made["key"]) is None
