"""deploy/: the Dockerfile's two images, the compose file, Prometheus's scrape config and the systemd unit.

Each file is checked by the tool that consumes it where that tool is installed (``promtool``,
``systemd-analyze``); the rest are structural checks of what the files must say.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"


def test_dockerfile_has_a_cpu_and_a_cuda_image_running_as_a_user() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.M))
    assert {"cpu", "cuda"} <= targets, targets
    assert "ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu" in text  # the CPU build...
    assert "--index-url ${TORCH_CPU_INDEX} torch==2.13.0" in text  # ...of torch 2.13.0
    assert re.search(r"^USER\s+10001", text, re.M) and "STOPSIGNAL SIGTERM" in text
    assert "/readyz" in text  # the health check asks whether the models are warm


def test_compose_runs_facegate_prometheus_grafana_and_optional_postgres() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"facegate", "prometheus", "grafana", "postgres"} <= set(services)
    assert services["postgres"]["profiles"] == ["postgres"]
    for name, svc in services.items():  # nothing published beyond the host's loopback
        assert all(str(p).startswith("127.0.0.1:") for p in svc.get("ports", [])), name
    mounts = " ".join(services["grafana"]["volumes"] + services["prometheus"]["volumes"])
    for path in re.findall(r"\./([^:]+):", mounts):
        assert (DEPLOY / path).exists(), path
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/facegate.yml").read_text())
    assert "/var/lib/grafana/dashboards/facegate-dashboard.json:ro" in mounts
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_prometheus_config_is_valid_and_scrapes_facegate() -> None:
    path = DEPLOY / "prometheus/prometheus.yml"
    config = yaml.safe_load(path.read_text())
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["facegate:7860"]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    out = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_systemd_unit_is_hardened_and_valid(tmp_path: Path) -> None:
    text = (DEPLOY / "systemd/facegate.service").read_text()
    settings = dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and not line.lstrip().startswith("#")
    )
    for key, value in {
        "DynamicUser": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "NoNewPrivileges": "yes",
        "KillSignal": "SIGTERM",
        "StateDirectory": "facegate",
    }.items():
        assert settings.get(key) == value, key
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    facegate = Path(sys.executable).with_name("facegate")
    if not facegate.exists():
        pytest.skip("no facegate script next to this Python to stand in for /opt/facegate/bin/facegate")
    unit = tmp_path / "facegate.service"
    unit.write_text(text.replace("/opt/facegate/bin/facegate", str(facegate)))
    out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert out.returncode == 0 and not out.stderr.strip(), out.stdout + out.stderr
