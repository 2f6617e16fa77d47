"""compose.yaml checked against the CLI: every command and flag it runs exists, secrets come from
the environment, Redis persists, each GPU service reserves its own GPU.

Docker cannot run here; ``docker compose config`` validates the file when the plugin is present.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from .conftest import REPO, parse_cli

COMPOSE = REPO / "compose.yaml"
GPU_SERVICES = [f"gpu{i}" for i in range(8)]
SECRET_NAME = re.compile(r"KEY|PASSWORD|SECRET|TOKEN|AUTH", re.I)
INTERPOLATION = re.compile(r"^\$\{[A-Z_][A-Z0-9_]*(:?[-?][^}]*)?\}$")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def _fleet_services(services) -> dict:
    return {name: svc for name, svc in services.items() if name != "redis"}


def test_services_present(services):
    assert set(services) == {"redis", "flower", "reconciler", "cloud", "producer", *GPU_SERVICES}


def test_every_command_exists_in_the_cli(services):
    for name, svc in _fleet_services(services).items():
        args = parse_cli(svc["command"])
        assert args.store == "/store", name


def test_commands_per_role(services):
    reconciler = parse_cli(services["reconciler"]["command"])
    assert (reconciler.command, reconciler.kind, reconciler.metrics_address) == ("worker", "reconciler", "0.0.0.0")
    assert services["reconciler"]["ports"] == [f"${{METRICS_BIND:-127.0.0.1}}:{reconciler.metrics_port}:{reconciler.metrics_port}"]
    flower = parse_cli(services["flower"]["command"])
    assert (flower.command, flower.address, flower.no_auth) == ("flower", "0.0.0.0", False)
    cloud = parse_cli(services["cloud"]["command"])
    assert (cloud.command, cloud.kind, cloud.backend) == ("worker", "cloud", "openrouter")
    producer = services["producer"]
    assert parse_cli(producer["command"]).command == "enqueue"
    assert producer.get("profiles") and producer["restart"] == "no"
    # --scale needs replicas with their own names and no fixed host port
    assert not {"container_name", "hostname", "ports"} & set(services["cloud"])


def test_gpu_services_reserve_distinct_gpus(services):
    reserved = []
    for name in GPU_SERVICES:
        svc = services[name]
        args = parse_cli(svc["command"])
        assert (args.kind, args.gpu, args.name) == ("gpu", "0", name)  # the one GPU the container sees is CUDA 0
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        (gpu,) = device["device_ids"]
        assert name == f"gpu{gpu}"
        reserved.append(gpu)
        assert svc["image"] == "draftfleet:gpu" and svc["build"]["target"] == "gpu"
    assert sorted(reserved) == [str(i) for i in range(8)]


def test_secrets_come_from_the_environment(services):
    for name, svc in services.items():
        for key, value in (svc.get("environment") or {}).items():
            value = str(value)
            if SECRET_NAME.search(key):
                assert INTERPOLATION.match(value), f"{name}: {key} must be a ${{VAR}} interpolation, not {value!r}"
            if key == "REDIS_URL":
                userinfo = value.split("://", 1)[1].rsplit("@", 1)[0]
                assert INTERPOLATION.match(userinfo.removeprefix(":")), f"{name}: REDIS_URL password {userinfo!r}"
        assert "--requirepass" not in " ".join(map(str, svc.get("command") or [])), f"{name}: a password in argv"
    assert services["cloud"]["environment"]["OPENROUTER_API_KEY"].startswith("${OPENROUTER_API_KEY")
    assert services["flower"]["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH")


def test_redis_persists_and_reports_health(services):
    redis = services["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    assert any(v.endswith(":/data") for v in redis["volumes"])
    for name, svc in _fleet_services(services).items():
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy", name


def test_one_store_volume_shared_by_every_fleet_service(compose, services):
    assert "store" in compose["volumes"]
    for name, svc in _fleet_services(services).items():
        assert "store:/store" in svc["volumes"], name


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_docker_compose_config_accepts_the_file(tmp_path):
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no docker compose plugin or docker-compose here")
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(tmp_path), "REDIS_PASSWORD": "x" * 16}
    res = subprocess.run([*cli, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=60)
    assert res.returncode == 0, res.stderr
    # without the Redis password compose refuses to start anything
    res = subprocess.run([*cli, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True,
                         env={k: v for k, v in env.items() if k != "REDIS_PASSWORD"}, cwd=REPO, timeout=60)
    assert res.returncode != 0 and "REDIS_PASSWORD" in res.stderr
