"""A container engine for the container tests, and the CPU image built with it.

The engine is podman (installed from Debian's packages when this machine has neither podman
nor a running Docker daemon and the tests run as root), driven through the verbs podman and
the Docker CLI share. Where the machine needs settings to run containers at all (hybrid
cgroups, an open-files hard limit below podman's default) they go into a ``CONTAINERS_CONF``
file of the test's own; nothing under /etc is changed. The image is built from the
repository's ``Dockerfile.cpu`` on a base made locally from Debian packages (no registry is
reachable here), with this machine's pip settings as a build secret and the local package
directories they name mounted read-only into the build.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGE = "localhost/vllm-hybrid-nixl:cpu-test"
PACKAGES = [
    "podman", "crun", "runc", "conmon", "containernetworking-plugins", "fuse-overlayfs",
    "slirp4netns", "uidmap", "debootstrap", "iptables", "catatonit",
    "golang-github-containers-common",
]  # fmt: skip
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BUILD_NICENESS = 19  # the image builds run beside other tests (ImagePrebuild)


def progress(message: str) -> None:
    """A progress line on stderr (shown with ``pytest -s``, else in a failure's output)."""
    print(f"[containers] {message}", file=sys.__stderr__, flush=True)


@dataclass
class ContainerCli:
    """One container CLI and the environment it runs with."""

    path: str
    env: dict[str, str] = field(default_factory=dict)
    #: Run at this niceness (and so does everything it starts: a build's steps): a build
    #: beside running tests takes only the CPU they leave idle.
    nice: int = 0

    @property
    def is_podman(self) -> bool:
        return Path(self.path).name == "podman"

    def niced(self, argv: list[str]) -> list[str]:
        """``argv`` run at this CLI's niceness."""
        return ["nice", "-n", str(self.nice), *argv] if self.nice else argv

    def command(self, *args: str) -> list[str]:
        return self.niced([self.path, *args])

    def run(
        self, *args: str, timeout: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            self.command(*args),
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{Path(self.path).name} {' '.join(args[:3])} ... exited {done.returncode}:\n"
                f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            )
        return done

    def inspect(self, name: str, template: str) -> str:
        return self.run("inspect", "--format", template, name).stdout.strip()


def _docker_daemon_runs() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    done = subprocess.run([docker, "info"], capture_output=True, timeout=30, check=False)
    return done.returncode == 0


def _install_podman() -> None:
    progress("installing podman from Debian's packages (about 20 s)")
    _apt_install(PACKAGES, "no container engine here (neither podman nor a running Docker daemon)")


def _containers_conf(directory: Path) -> Path:
    """podman settings this machine needs: ulimits within its hard limits (podman asks for
    more by default; runc could not set the whole hard process limit here, 32768 it could),
    and runc with the cgroupfs manager (crun refuses hybrid cgroup hierarchies)."""

    def within(kind: int, wanted: int) -> int:
        hard = resource.getrlimit(kind)[1]
        return wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)

    nofile, nproc = within(resource.RLIMIT_NOFILE, 65536), within(resource.RLIMIT_NPROC, 32768)
    quoted = f'"nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"'
    lines = ["[containers]", f"default_ulimits = [{quoted}]", "[engine]"]
    if shutil.which("runc"):
        lines += ['runtime = "runc"']
    lines += ['cgroup_manager = "cgroupfs"', 'events_logger = "file"']
    path = directory / "containers.conf"
    path.write_text("\n".join(lines) + "\n")
    return path


def container_cli(directory: Path) -> ContainerCli:
    """podman (installed if need be, with its own settings file), or a running Docker."""
    if shutil.which("podman") is None and _docker_daemon_runs():
        return ContainerCli(shutil.which("docker") or "docker")
    if shutil.which("podman") is None:
        _install_podman()
    cli = ContainerCli(shutil.which("podman") or "podman")
    cli.env["CONTAINERS_CONF"] = str(_containers_conf(directory))
    return cli


def host_pip_settings(directory: Path) -> tuple[Path, list[Path]]:
    """This machine's pip settings as a pip.conf for the build (certificate and constraint
    paths left out: the build has its own CA bundle and no constraint file), and the local
    directories those settings name (mounted read-only into the build)."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    ).stdout
    settings: dict[str, str] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        name = key.split(".", 1)[-1]
        if name in ("cert", "constraint", "client-cert") or not value:
            continue
        settings[name] = value.strip().strip("'\"")
    local: list[Path] = []
    for value in settings.values():
        for word in value.split():
            path = Path(word.removeprefix("file://"))
            if (word.startswith("file://") or word.startswith("/")) and path.exists():
                local.append(path if path.is_dir() else path.parent)
    conf = directory / "pip.conf"
    conf.write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    # A file index's root: file:///opt/pypi/simple -> mount /opt/pypi
    roots = sorted({p.parent if p.name == "simple" else p for p in local})
    return conf, roots


def pip_build_args(cli: ContainerCli, directory: Path) -> list[str]:
    """Build flags that give pip inside a build this machine's settings: its pip.conf and CA
    bundle as build secrets, the local package directories they name as read-only volumes."""
    pip_conf, local_dirs = host_pip_settings(directory)
    args = ["--secret", f"id=pip_conf,src={pip_conf}"]
    if CA_BUNDLE.exists():
        args += ["--secret", f"id=ca_bundle,src={CA_BUNDLE}"]
    if cli.is_podman:
        args += ["--format", "docker"]  # keeps HEALTHCHECK (the OCI format has none)
        for path in local_dirs:
            args += ["--volume", f"{path}:{path}:ro"]
    return args


@dataclass(frozen=True)
class BuiltImage:
    name: str
    base: str
    build_s: float
    base_s: float
    size_bytes: int


def build_cpu_image(cli: ContainerCli, directory: Path) -> BuiltImage:
    """The base (made locally from Debian packages when missing), then ``Dockerfile.cpu``."""
    progress("base images: a minimal Debian and Debian's Python 3.11 (about 1-2 min if new)")
    started = time.monotonic()
    base = subprocess.run(
        cli.niced(["bash", str(REPO / "scripts" / "container" / "local-base.sh")]),
        env={**os.environ, **cli.env, "ENGINE": cli.path},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if base.returncode != 0:
        raise AssertionError(f"local-base.sh failed:\n{base.stderr[-3000:]}")
    base_s = time.monotonic() - started
    args = ["build", "-f", str(REPO / "Dockerfile.cpu"), "-t", IMAGE]
    args += ["--build-arg", f"BASE_IMAGE={base.stdout.strip()}", "--build-arg", "TORCH_INDEX_URL="]
    args += pip_build_args(cli, directory)
    progress(f"building {IMAGE} from Dockerfile.cpu (a few minutes)")
    started = time.monotonic()
    cli.run(*args, str(REPO), timeout=1800)
    build_s = time.monotonic() - started
    size = int(cli.run("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip())
    progress(f"built {IMAGE}: {size / 2**30:.2f} GiB in {build_s:.0f} s")
    return BuiltImage(IMAGE, base.stdout.strip(), build_s, base_s, size)


def build_gpu_dockerfile_on_stand_in(
    cli: ContainerCli, cpu_image: BuiltImage, directory: Path
) -> BuiltImage:
    """The GPU ``Dockerfile`` with its base replaced by a stand-in: the CPU image run as root
    (as vllm/vllm-openai runs), installed with VLLM_FLAVOR=cpu. No CUDA base image or GPU is
    reachable here; everything after ``FROM`` runs."""
    stand_in = "localhost/vllm-hybrid-nixl:gpu-stand-in"
    (directory / "Containerfile").write_text(f"FROM {cpu_image.name}\nUSER root\n")
    cli.run("build", "-t", stand_in, str(directory), timeout=600)
    image = "localhost/vllm-hybrid-nixl:gpu-dockerfile-test"
    args = ["build", "-f", str(REPO / "Dockerfile"), "-t", image]
    args += ["--build-arg", f"VLLM_IMAGE={stand_in}", "--build-arg", "VLLM_FLAVOR=cpu"]
    args += pip_build_args(cli, directory)
    progress(f"building the GPU Dockerfile on {stand_in}")
    started = time.monotonic()
    cli.run(*args, str(REPO), timeout=1800)
    build_s = time.monotonic() - started
    size = int(cli.run("image", "inspect", "--format", "{{.Size}}", image).stdout.strip())
    return BuiltImage(image, stand_in, build_s, 0.0, size)


@dataclass(frozen=True)
class Images:
    """The container CLI and the two images the container tests run."""

    cli: ContainerCli
    cpu: BuiltImage
    gpu: BuiltImage


def build_images(directory: Path) -> Images:
    """The container CLI (installed if need be), the CPU image, then the GPU Dockerfile on
    its stand-in base."""
    for part in ("cli", "cpu", "gpu"):
        (directory / part).mkdir(exist_ok=True)
    cli = container_cli(directory / "cli")
    builder = dataclasses.replace(cli, env=dict(cli.env), nice=BUILD_NICENESS)
    cpu = build_cpu_image(builder, directory / "cpu")
    return Images(cli, cpu, build_gpu_dockerfile_on_stand_in(builder, cpu, directory / "gpu"))


class ImagePrebuild:
    """:func:`build_images` on a thread of its own, started as soon as the session knows it
    will run the container tests: the builds (mostly package downloads and unpacking) run
    while the tests before them do, instead of adding their minutes to the suite. An error
    of the build is raised where the images are asked for."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="image-prebuild")
        self._images: Future[Images] = pool.submit(build_images, directory)
        pool.shutdown(wait=False)

    def images(self, timeout_s: float = 3600) -> Images:
        return self._images.result(timeout=timeout_s)


IMAGE_PREBUILD = pytest.StashKey[ImagePrebuild]()


def health_check_passes(cli: ContainerCli, name: str) -> bool:
    """One run of the image's HEALTHCHECK in ``name`` by hand (podman schedules health
    checks with systemd timers, which a machine without systemd lacks); a run past 60 s
    (busy cores) counts as not healthy yet."""
    try:
        return cli.run("healthcheck", "run", name, check=False, timeout=60).returncode == 0
    except subprocess.TimeoutExpired:
        progress(f"{name}: a health check ran past 60 s (busy cores); asking again")
        return False


def wait_healthy(cli: ContainerCli, name: str, timeout_s: float = 420) -> None:
    """Until the image's own HEALTHCHECK passes in ``name``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cli.inspect(name, "{{.State.Running}}") != "true":
            raise AssertionError(f"container {name} stopped:\n{first_errors(cli, name)}")
        if cli.is_podman:
            if health_check_passes(cli, name):
                return
        elif cli.inspect(name, "{{.State.Health.Status}}") == "healthy":
            return
        time.sleep(2)
    logs = cli.run("logs", "--tail", "40", name, check=False)
    raise AssertionError(f"{name} not healthy in {timeout_s:.0f} s:\n{logs.stdout}{logs.stderr}")


def used_ipv4_networks(cli: ContainerCli) -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the engine's networks or this host's interfaces already hold."""
    used: list[ipaddress.IPv4Network] = []
    names = cli.run("network", "ls", "--format", "{{.Name}}").stdout.split()
    if names:
        described = cli.run("network", "inspect", *names).stdout
        found = re.findall(r'"(?:subnet|Subnet)":\s*"([0-9./]+)"', described)
        used += [ipaddress.ip_network(cidr, strict=False) for cidr in found if "." in cidr]
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and address.netmask:
                cidr = f"{address.address}/{address.netmask}"
                used.append(ipaddress.ip_network(cidr, strict=False))
    return used


def free_subnet(cli: ContainerCli, avoid: tuple[str, ...] = ()) -> str:
    """The first three octets of a /24 under 10.213.0.0/16 that no network here overlaps
    (a leftover network of another run, a host interface) and not in ``avoid``."""
    used = used_ipv4_networks(cli)
    for third in range(1, 255):
        prefix = f"10.213.{third}"
        candidate = ipaddress.ip_network(f"{prefix}.0/24")
        if prefix not in avoid and not any(candidate.overlaps(net) for net in used):
            return prefix
    raise AssertionError(f"no free /24 under 10.213.0.0/16; networks in use: {used}")


def first_errors(cli: ContainerCli, name: str, lines: int = 40) -> str:
    """The first ERROR lines of a container's log (where a root cause is), and its tail."""
    logs = cli.run("logs", name, check=False)
    text = (logs.stdout + logs.stderr).splitlines()
    errors = [line for line in text if " ERROR " in line][:lines]
    return "\n".join(errors + ["--- last lines ---"] + text[-15:])


def state(cli: ContainerCli, name: str) -> dict:
    return json.loads(cli.inspect(name, "{{json .State}}"))


def _apt_install(packages: list[str], why: str) -> None:
    """Debian packages, as root (the tests' machines have apt-get and no registry)."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise AssertionError(f"{why}, and cannot install {packages} (needs root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise AssertionError(f"apt-get install {packages} failed:\n{done.stderr[-3000:]}")


@dataclass
class ComposeTool:
    """A compose CLI and the environment that points it at the container engine."""

    argv: list[str]
    env: dict[str, str]

    def run(
        self, *args: str, env: dict[str, str], timeout: float = 900, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [*self.argv, *args],
            env={**os.environ, **self.env, **env},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(self.argv)} {' '.join(args[:4])} ... exited {done.returncode}:\n"
                f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            )
        return done


def _docker_api_ready(socket_path: Path) -> bool:
    import httpx

    try:
        transport = httpx.HTTPTransport(uds=str(socket_path))
        with httpx.Client(transport=transport, timeout=5) as client:
            return client.get("http://engine/_ping").text.strip() == "OK"
    except (httpx.HTTPError, OSError):
        return False


@contextmanager
def compose_tool(cli: ContainerCli, directory: Path) -> Iterator[ComposeTool]:
    """``docker compose`` against a running Docker daemon; with podman, Debian's
    ``docker-compose`` (installed where missing) talking to podman's Docker API, served for
    the duration by ``podman system service`` (stopped by its PID)."""
    if not cli.is_podman:
        probe = subprocess.run([cli.path, "compose", "version"], capture_output=True, check=False)
        yield ComposeTool(
            [cli.path, "compose"] if probe.returncode == 0 else ["docker-compose"], {}
        )
        return
    if shutil.which("docker-compose") is None:
        progress("installing docker-compose from Debian's packages")
        _apt_install(["docker-compose"], "no compose tool here")
    socket_path = directory / "podman.sock"
    service = subprocess.Popen(
        [cli.path, "system", "service", "--time=0", f"unix://{socket_path}"],
        env={**os.environ, **cli.env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not _docker_api_ready(socket_path):
            if service.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("podman system service did not serve the Docker API")
            time.sleep(0.5)
        env = {"DOCKER_HOST": f"unix://{socket_path}", "COMPOSE_HTTP_TIMEOUT": "600"}
        yield ComposeTool([shutil.which("docker-compose") or "docker-compose"], env)
    finally:
        service.terminate()
        try:
            service.wait(timeout=30)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait(timeout=30)


class HealthTicker:
    """Runs the health checks of one compose project's containers every few seconds, the
    job systemd timers do for podman on a machine with systemd (a Docker daemon runs its
    own: then this only watches). Records when each container was first seen and first
    passed its check, by wall-clock time."""

    def __init__(self, cli: ContainerCli, project: str, interval_s: float = 3.0) -> None:
        self.cli, self.project, self.interval_s = cli, project, interval_s
        self.first_seen: dict[str, float] = {}
        self.first_healthy: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthTicker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def services(self, stopped_too: bool = False) -> dict[str, str]:
        """The project's running containers (or all): service name -> container name."""
        listed = self.cli.run(
            "ps", *(["-a"] if stopped_too else []),
            "--filter", f"label=com.docker.compose.project={self.project}",
            "--format", '{{.Names}} {{index .Labels "com.docker.compose.service"}}',
            check=False, timeout=60,
        ).stdout  # fmt: skip
        return {
            words[1]: words[0] for words in (line.split() for line in listed.splitlines())
            if len(words) == 2
        }  # fmt: skip

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for service, name in self.services().items():
                self.first_seen.setdefault(service, time.time())
                if self.cli.is_podman:  # every check run by hand, healthy or not
                    healthy = health_check_passes(self.cli, name)
                elif service in self.first_healthy:
                    continue
                else:
                    healthy = self.cli.inspect(name, "{{.State.Health.Status}}") == "healthy"
                if healthy:
                    self.first_healthy.setdefault(service, time.time())
