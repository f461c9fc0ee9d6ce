"""P/D across containers for real: the CPU image built from ``Dockerfile.cpu`` (on a base made
locally from Debian packages: no registry is reachable here), then a prefill, a decode and a
router container from it, each with its own address on one container network (not the
host's), started by the image's own entry point as its non-root user and gated by its own
HEALTHCHECK. The NIXL side channel, the lease and digest services and the KV itself cross
between containers; greedy answers through the router's published port on 127.0.0.1 equal
the prefill engine's alone, token for token, and the decode engine counted the KV as
received over NIXL. ``stop`` ends every container within its grace period.

The engine is podman from Debian's packages (installed by the test where missing, as root),
or a running Docker daemon.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.container_kit import (
    IMAGE_PREBUILD,
    BuiltImage,
    ContainerCli,
    HealthTicker,
    ImagePrebuild,
    Images,
    compose_tool,
    first_errors,
    free_subnet,
    progress,
    state,
    wait_healthy,
)
from tests.e2e.rolling_load import CLIENTS, REQUEST_TIMEOUT_S, Load, alone, wait_for_pd
from vllm_hybrid_nixl.common.netutil import free_port
from vllm_hybrid_nixl.deploy.kv_metrics import read_kv_transfer_counters
from vllm_hybrid_nixl.deploy.metrics_text import read_metrics, sample_sum

pytestmark = pytest.mark.e2e

ENGINE_ARGS = ["--block-size", "64", "--enforce-eager", "--max-model-len", "1024"]
STOP_GRACE_S = 30
DRAIN_GRACE_S = 120  # the engines' drain is bounded below this (60 s + vLLM's 45 s)
CLIENT_KEY = uuid.uuid4().hex
PROMPTS = [
    "containers move the kv cache between",
    " ".join(["a prompt that fills more than one block of the kv cache"] * 10),
]


@dataclass
class PdContainers:
    cli: ContainerCli
    image: BuiltImage
    names: dict[str, str]  # role -> container name
    urls: dict[str, str]  # role -> URL on the host's loopback (published ports)
    addresses: dict[str, str]  # role -> address on the container network


def _kv_config(role: str) -> str:
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    return (
        '{"kv_connector":"HybridNixlConnector","kv_role":"' + kv_role + '",'
        '"kv_buffer_device":"cpu"}'
    )


@pytest.fixture(scope="module")
def images(request: pytest.FixtureRequest, tmp_path_factory) -> Images:
    """The images the session started building at collection (tests/conftest.py), or built
    here when it did not."""
    prebuild = request.config.stash.get(IMAGE_PREBUILD, None)
    if prebuild is None:
        prebuild = ImagePrebuild(tmp_path_factory.mktemp("image-build"))
    return prebuild.images()


@pytest.fixture(scope="module")
def cli(images: Images) -> ContainerCli:
    return images.cli


@pytest.fixture(scope="module")
def cpu_image(images: Images) -> BuiltImage:
    return images.cpu


@pytest.fixture(scope="module")
def shared_model(tiny_hybrid_model: Path, tmp_path_factory) -> Path:
    """The tiny model where the containers' non-root user can read it."""
    target = tmp_path_factory.mktemp("container-model") / "tiny"
    shutil.copytree(tiny_hybrid_model, target)
    for path in [target.parent, target, *target.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    parent = target.parent
    while parent != parent.parent:  # every directory above must be searchable
        parent.chmod(parent.stat().st_mode | 0o111)
        parent = parent.parent
    return target


@pytest.fixture(scope="module")
def pd(cli: ContainerCli, cpu_image: BuiltImage, shared_model: Path) -> Iterator[PdContainers]:
    tag = uuid.uuid4().hex[:8]
    network = f"vhn-test-{tag}"
    subnet = free_subnet(cli)  # a private /24 nothing here uses (not the host's network)
    cli.run("network", "create", "--subnet", f"{subnet}.0/24", network)
    names = {role: f"vhn-{role}-{tag}" for role in ("prefill", "decode", "router")}
    addresses = {"prefill": f"{subnet}.10", "decode": f"{subnet}.11", "router": f"{subnet}.12"}
    ports = {role: free_port() for role in names}
    inner = {"prefill": 8100, "decode": 8200, "router": 8000}
    started: list[str] = []

    def run(role: str, args: list[str], env: dict[str, str]) -> None:
        command = ["run", "-d", "--name", names[role], "--network", network]
        # Compute threads bound by VLLM_CPU_OMP_THREADS_BIND, not --cpuset-cpus: vLLM's CPU
        # NIXL worker pins itself to the last core of each NUMA node (EINVAL outside a cpuset).
        command += ["--ip", addresses[role], "--shm-size", "1g"]
        command += ["-p", f"127.0.0.1:{ports[role]}:{inner[role]}"]
        command += ["-v", f"{shared_model}:/models/tiny:ro"]
        for key, value in {**env, "HEALTH_PORT": str(inner[role])}.items():
            command += ["-e", f"{key}={value}"]
        cli.run(*command, cpu_image.name, *args)
        started.append(names[role])

    try:
        for role, core in (("prefill", "0"), ("decode", "1")):
            progress(f"starting the {role} container")
            run(
                role,
                ["/models/tiny", "--port", str(inner[role]), *ENGINE_ARGS]
                + ["--kv-transfer-config", _kv_config(role)],
                {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": core},
            )
        for role in ("prefill", "decode"):
            wait_healthy(cli, names[role])
        side = {role: f"{addresses[role]}:5600" for role in ("prefill", "decode")}
        run(
            "router",
            ["router", "--port", "8000", "--prefill", f"http://{addresses['prefill']}:8100"]
            + ["--decode", f"http://{addresses['decode']}:8200"]
            + ["--prefill-side-channel", side["prefill"], "--decode-side-channel", side["decode"]],
            {"VLLM_HYBRID_NIXL_API_KEY": CLIENT_KEY},  # it listens beyond loopback: a key
        )
        wait_healthy(cli, names["router"], timeout_s=120)
        urls = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
        yield PdContainers(cli, cpu_image, names, urls, addresses)
    finally:
        for name in reversed(started):
            cli.run("rm", "-f", "-t", "5", name, check=False, timeout=120)
        cli.run("network", "rm", network, check=False)


def _completion(url: str, prompt: str) -> dict:
    body = {"model": "/models/tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
    body.update(ignore_eos=True, return_token_ids=True)  # random weights: compare token ids
    headers = {"Authorization": f"Bearer {CLIENT_KEY}"}
    answer = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=300)
    assert answer.status_code == 200, answer.text[:2000]
    return answer.json()["choices"][0]


def test_the_image_builds_without_a_registry_and_reports_itself(
    cli: ContainerCli, cpu_image: BuiltImage
) -> None:
    (found,) = json.loads(cli.run("image", "inspect", cpu_image.name).stdout)
    config = found["Config"]
    assert config["User"] == "1000:1000"
    assert "vllm_hybrid_nixl.deploy.container" in config["Entrypoint"]
    health = found.get("Healthcheck") or config.get("Healthcheck")  # podman / docker
    assert health and "health" in health["Test"], found
    version = cli.run("run", "--rm", "--network", "none", cpu_image.name, "version").stdout
    assert "vllm-hybrid-nixl" in version
    progress(
        f"image {cpu_image.size_bytes / 2**30:.2f} GiB, built in {cpu_image.build_s:.0f} s "
        f"(base images {cpu_image.base_s:.0f} s)"
    )


def test_the_gpu_dockerfile_builds_on_a_stand_in_base_and_passes_its_image_check(
    cli: ContainerCli, images: Images
) -> None:
    """The GPU ``Dockerfile`` built with a stand-in base (the CPU image as root, the
    VLLM_FLAVOR=cpu install), since neither vllm/vllm-openai nor a GPU is reachable here:
    its copies, scripts/install.sh into the base's own Python and ``check-image`` run at
    build time; the built image's entry point, health check and ``check-image`` answer."""
    built = images.gpu
    (found,) = json.loads(cli.run("image", "inspect", built.name).stdout)
    config = found["Config"]
    assert config["Entrypoint"] == ["python3", "-m", "vllm_hybrid_nixl.deploy.container"]
    health = found.get("Healthcheck") or config.get("Healthcheck")
    assert health and health["Test"][-2:] == ["health", "8100"], health
    check = cli.run("run", "--rm", "--network", "none", built.name, "check-image", check=False)
    assert check.returncode == 0, check.stderr[-2000:]
    version = cli.run("run", "--rm", "--network", "none", built.name, "version").stdout
    assert "vllm-hybrid-nixl" in version and "installed vLLM" in version, version
    progress(f"GPU Dockerfile on the stand-in base: built in {built.build_s:.0f} s")


def test_pd_across_containers_equals_one_engine_alone(pd: PdContainers) -> None:
    with httpx.Client(timeout=60) as client:
        before = read_kv_transfer_counters(pd.urls["decode"], client)
    for prompt in PROMPTS:
        through_router = _completion(pd.urls["router"], prompt)
        alone = _completion(pd.urls["prefill"], prompt)
        assert through_router["token_ids"] == alone["token_ids"], (prompt, through_router, alone)
        assert len(through_router["token_ids"]) == 16
    with httpx.Client(timeout=60) as client:
        moved = read_kv_transfer_counters(pd.urls["decode"], client) - before
    assert moved.nixl_bytes > 0 and moved.failed_transfers == 0
    assert moved.external_prompt_tokens > 0


def test_every_container_runs_as_its_own_address_and_not_as_root(pd: PdContainers) -> None:
    for role, name in pd.names.items():
        assert pd.cli.run("exec", name, "id", "-u").stdout.strip() == "1000", role
        hosts = pd.cli.run("exec", name, "hostname", "-i", check=False).stdout
        if hosts.strip():
            assert pd.addresses[role] in hosts.split(), (role, hosts)
    decode_logs = pd.cli.run("logs", pd.names["decode"])
    logs = decode_logs.stdout + decode_logs.stderr
    assert "HybridNixlPullWorker" in logs and "validated" in logs


def test_nothing_of_the_containers_runs_on_the_host_network(pd: PdContainers) -> None:
    for name in pd.names.values():
        mode = pd.cli.inspect(name, "{{.HostConfig.NetworkMode}}")
        assert mode not in ("host", ""), (name, mode)


def router_engine_state(pd: PdContainers, role: str) -> str:
    engines = httpx.get(f"{pd.urls['router']}/health", timeout=10).json()["engines"]
    return next(e["state"] for e in engines if e["role"] == role)


@pytest.mark.slow  # ~300 s / ~155 s on two cores: not in .ci/run (docs/testing.md)
def test_restarting_the_decode_container_under_load_loses_no_request(pd: PdContainers) -> None:
    """``docker stop`` (SIGTERM: the engine drains) then ``docker start`` of the decode
    container while 8 clients keep requests running through the router container: every
    answer equals the decode engine's alone (token ids), none fails or hangs; the router ran
    requests colocated on the prefill engine while the decode was away, and P/D resumed.
    (Both roles' restarts with plain engines: ``test_drain``; all four engines of a Ray
    deployment: ``test_ray_pd``. One container is what the image adds.)"""
    expected = alone(pd.urls["decode"], "/models/tiny")
    headers = {"Authorization": f"Bearer {CLIENT_KEY}"}
    load = Load(pd.urls["router"], "/models/tiny", expected, headers)
    clients = [threading.Thread(target=load.run, args=(i,)) for i in range(CLIENTS)]
    for client in clients:
        client.start()
    stopped = {}
    try:
        load.wait_answers(CLIENTS)
        for role in ("decode",):
            name = pd.names[role]
            progress(f"restarting the {role} container under load")
            started = time.monotonic()
            pd.cli.run("stop", "-t", str(DRAIN_GRACE_S), name, timeout=DRAIN_GRACE_S + 60)
            stopped[role] = (round(time.monotonic() - started, 1), state(pd.cli, name)["ExitCode"])
            pd.cli.run("start", name)
            wait_healthy(pd.cli, name)
            deadline = time.monotonic() + 60
            while router_engine_state(pd, role) != "up":
                assert time.monotonic() < deadline, f"the router did not take the {role} back"
                time.sleep(0.5)
            moved = wait_for_pd(load, pd.urls["decode"], CLIENTS)
            assert moved > 0, f"no P/D after the {role} container came back"
    except AssertionError:
        for role, name in pd.names.items():  # what each container said last, for the report
            tail = pd.cli.run("logs", "--tail", "40", name, check=False)
            progress(f"--- {role} log ---\n{tail.stdout[-4000:]}{tail.stderr[-4000:]}")
        raise
    finally:
        load.stop.set()
        for client in clients:
            client.join(timeout=REQUEST_TIMEOUT_S + 30)
    progress(f"outcomes {dict(load.outcomes)}; stops (s, exit code) {stopped}")
    assert not load.problems, load.problems[:10]
    assert load.outcomes["ok"] >= 3 * CLIENTS
    assert all(code == 0 for _, code in stopped.values()), stopped
    metrics = read_metrics(pd.urls["router"], None, timeout_s=10.0)
    assert sample_sum(metrics, "router_policy_choices_total", reason="no_decode") > 0
    assert sample_sum(metrics, "router_lease_reruns_total") == 0


def test_stop_ends_every_container_within_its_grace_period(pd: PdContainers) -> None:
    """SIGTERM, then SIGKILL after the grace period: each container must have exited by
    itself, well before the KILL (router first, then decode, then prefill). Each is serving
    first (an engine still starting is not what this measures)."""
    for role in ("router", "decode", "prefill"):
        wait_healthy(pd.cli, pd.names[role])
    for role in ("router", "decode", "prefill"):
        name = pd.names[role]
        started = time.monotonic()
        pd.cli.run("stop", "-t", str(STOP_GRACE_S), name, timeout=STOP_GRACE_S + 60)
        took = time.monotonic() - started
        finished = state(pd.cli, name)
        assert took < STOP_GRACE_S - 1, f"{role} took {took:.1f} s to stop: killed?"
        assert finished.get("ExitCode") != 137, (role, finished)
        assert not finished.get("OOMKilled"), (role, finished)


COMPOSE_CPU = Path(__file__).resolve().parents[2] / "configs" / "docker" / "compose.cpu.yaml"


def _alone_inside(cli: ContainerCli, name: str, url: str, prompt: str) -> list[int]:
    """Greedy token ids from an engine asked from inside its own container (not published)."""
    body = {"model": "/models/model", "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
    body.update(ignore_eos=True, return_token_ids=True)
    script = (
        "import json, sys, urllib.request as r\n"
        "ask = r.Request(sys.argv[1], sys.argv[2].encode(), {'Content-Type': 'application/json'})\n"
        "print(json.dumps(json.load(r.urlopen(ask, timeout=300))['choices'][0]['token_ids']))\n"
    )
    done = cli.run("exec", name, "python", "-c", script, f"{url}/v1/completions", json.dumps(body))
    return json.loads(done.stdout)


def test_compose_brings_pd_up_behind_health_checks_and_down_leaving_nothing(
    cli: ContainerCli, cpu_image: BuiltImage, shared_model: Path, tmp_path: Path
) -> None:
    """``configs/docker/compose.cpu.yaml`` with a compose tool that drives this engine: the
    router container is created only after both engines passed their health checks, a
    request through the router's port published on 127.0.0.1 ran P/D and equals the decode
    engine's answer alone, and ``down -v`` leaves no container, network or volume."""
    project = f"vhn-compose-{uuid.uuid4().hex[:8]}"
    router_port = free_port()
    subnet = free_subnet(cli)  # the file's SUBNET: a /24 no network here overlaps
    env = {
        "IMAGE": cpu_image.name,
        "MODEL_DIR": str(shared_model),
        "SUBNET": subnet,
        "ROUTER_PORT": str(router_port),
        "VLLM_HYBRID_NIXL_API_KEY": CLIENT_KEY,
    }
    files = ["-p", project, "-f", str(COMPOSE_CPU)]
    with compose_tool(cli, tmp_path) as compose:
        try:
            with HealthTicker(cli, project) as ticker:
                progress(f"{' '.join(compose.argv)} up: the engines, then the router")
                up = compose.run(*files, "up", "-d", "--no-build", env=env, check=False)
                assert up.returncode == 0, up.stderr[-2000:] + "".join(
                    f"\n--- {service} ---\n{first_errors(cli, name)}"
                    for service, name in ticker.services(stopped_too=True).items()
                )
                deadline = time.monotonic() + 180
                while "router" not in ticker.first_healthy:
                    assert time.monotonic() < deadline, f"router not healthy: {ticker.first_seen}"
                    time.sleep(1)
            engines_healthy = max(ticker.first_healthy[role] for role in ("prefill", "decode"))
            assert ticker.first_seen["router"] >= engines_healthy, (
                ticker.first_seen,
                ticker.first_healthy,
            )
            names = dict(ticker.services())
            url = f"http://127.0.0.1:{router_port}"
            decode_url = f"http://{subnet}.11:8200"
            for prompt in PROMPTS:
                body = {"model": "/models/model", "prompt": prompt, "max_tokens": 16}
                body.update(temperature=0.0, ignore_eos=True, return_token_ids=True)
                answer = httpx.post(
                    f"{url}/v1/completions", json=body, timeout=300,
                    headers={"Authorization": f"Bearer {CLIENT_KEY}"},
                )  # fmt: skip
                assert answer.status_code == 200, answer.text[:2000]
                through_router = answer.json()["choices"][0]["token_ids"]
                assert through_router == _alone_inside(cli, names["decode"], decode_url, prompt)
            metrics = read_metrics(url, None, timeout_s=10.0)
            assert sample_sum(metrics, "router_policy_choices_total", role="prefill") >= 2
        finally:
            progress("compose down -v")
            down = compose.run(*files, "down", "-v", "-t", str(DRAIN_GRACE_S), env=env, check=False)
    assert down.returncode == 0, down.stderr[-3000:]
    label = f"label=com.docker.compose.project={project}"
    for kind in ("ps -a", "network ls", "volume ls"):
        left = cli.run(
            *kind.split(),
            "--filter",
            label,
            "--format",
            "{{.Name}}" if kind != "ps -a" else "{{.Names}}",
        ).stdout
        assert not left.strip(), (kind, left)
    networks = cli.run("network", "ls", "--format", "{{.Name}}").stdout.split()
    assert f"{project}_pd" not in networks, networks
