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

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IMAGE = "localhost/vllm-hybrid-nixl:cpu-test"
PACKAGES = [
    "podman", "crun", "runc", "conmon", "containernetworking-plugins", "fuse-overlayfs",
    "slirp4netns", "uidmap", "debootstrap", "iptables", "catatonit",
    "golang-github-containers-common",
]  # fmt: skip
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def progress(message: str) -> None:
    """A progress line on stderr (shown with ``pytest -s``, else in a failure's output)."""
    print(f"[containers] {message}", file=sys.__stderr__, flush=True)


@dataclass
class ContainerCli:
    """One container CLI and the environment it runs with."""

    path: str
    env: dict[str, str] = field(default_factory=dict)

    @property
    def is_podman(self) -> bool:
        return Path(self.path).name == "podman"

    def run(
        self, *args: str, timeout: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [self.path, *args],
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
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise AssertionError(
            "no container engine here (neither podman nor a running Docker daemon), and "
            "podman cannot be installed (needs root and apt-get): install podman or docker"
        )
    progress("installing podman from Debian's packages (about 20 s)")
    command = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise AssertionError(f"apt-get install podman failed:\n{done.stderr[-3000:]}")


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
        ["bash", str(REPO / "scripts" / "container" / "local-base.sh")],
        env={**os.environ, **cli.env, "ENGINE": cli.path},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if base.returncode != 0:
        raise AssertionError(f"local-base.sh failed:\n{base.stderr[-3000:]}")
    base_s = time.monotonic() - started
    pip_conf, local_dirs = host_pip_settings(directory)
    args = ["build", "-f", str(REPO / "Dockerfile.cpu"), "-t", IMAGE]
    args += ["--build-arg", f"BASE_IMAGE={base.stdout.strip()}", "--build-arg", "TORCH_INDEX_URL="]
    args += ["--secret", f"id=pip_conf,src={pip_conf}"]
    if CA_BUNDLE.exists():
        args += ["--secret", f"id=ca_bundle,src={CA_BUNDLE}"]
    if cli.is_podman:
        args += ["--format", "docker"]  # keeps HEALTHCHECK (the OCI format has none)
        for path in local_dirs:
            args += ["--volume", f"{path}:{path}:ro"]
    progress(f"building {IMAGE} from Dockerfile.cpu (a few minutes)")
    started = time.monotonic()
    cli.run(*args, str(REPO), timeout=1800)
    build_s = time.monotonic() - started
    size = int(cli.run("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip())
    progress(f"built {IMAGE}: {size / 2**30:.2f} GiB in {build_s:.0f} s")
    return BuiltImage(IMAGE, base.stdout.strip(), build_s, base_s, size)


def wait_healthy(cli: ContainerCli, name: str, timeout_s: float = 420) -> None:
    """Until the image's own HEALTHCHECK passes in ``name`` (run by hand: podman schedules
    health checks with systemd timers, which a machine without systemd lacks)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cli.inspect(name, "{{.State.Running}}") != "true":
            raise AssertionError(f"container {name} stopped:\n{first_errors(cli, name)}")
        if cli.is_podman:
            if cli.run("healthcheck", "run", name, check=False, timeout=60).returncode == 0:
                return
        elif cli.inspect(name, "{{.State.Health.Status}}") == "healthy":
            return
        time.sleep(2)
    logs = cli.run("logs", "--tail", "40", name, check=False)
    raise AssertionError(f"{name} not healthy in {timeout_s:.0f} s:\n{logs.stdout}{logs.stderr}")


def first_errors(cli: ContainerCli, name: str, lines: int = 40) -> str:
    """The first ERROR lines of a container's log (where a root cause is), and its tail."""
    logs = cli.run("logs", name, check=False)
    text = (logs.stdout + logs.stderr).splitlines()
    errors = [line for line in text if " ERROR " in line][:lines]
    return "\n".join(errors + ["--- last lines ---"] + text[-15:])


def state(cli: ContainerCli, name: str) -> dict:
    return json.loads(cli.inspect(name, "{{json .State}}"))
