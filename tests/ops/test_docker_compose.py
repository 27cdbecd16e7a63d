"""docker/: no Docker engine runs here, so the compose file is checked against the CLI it drives.

Every ``broker ...`` command in it must parse with the real parser, and every environment variable of a
service running one must be read by that command (listed as ``$VAR`` in its help) or be Ray's own
(``RAY_*``, read by Ray in the same container).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from broker.cli import build_parser

yaml = pytest.importorskip("yaml")

DOCKER = Path(__file__).resolve().parents[2] / "docker"
COMPOSE = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def commands(service: dict) -> list[list[str]]:
    """The argv of every program a service's command runs (``bash -c "a && b"`` gives a and b)."""
    command = service.get("command")
    if command is None:
        return []
    argv = shlex.split(command) if isinstance(command, str) else [str(x) for x in command]
    if argv[:1] in (["bash"], ["sh"]) and argv[1:2] == ["-c"]:
        lexer = shlex.shlex(argv[2], posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        parts: list[list[str]] = [[]]
        for token in lexer:
            if token in ("&&", "||", ";", "|"):
                parts.append([])
            else:
                parts[-1].append(token)
        return [p for p in parts if p]
    return [argv]


def broker_commands() -> list[tuple[str, list[str]]]:
    return [(name, argv) for name, svc in SERVICES.items() for argv in commands(svc) if argv[0] == "broker"]


def subcommand_help(argv: list[str]) -> str:
    sub = build_parser()._subparsers._group_actions[0].choices[argv[1]]  # noqa: SLF001 - argparse has no API
    return sub.format_help()


def test_compose_runs_the_demo_on_redis_with_persistence_and_a_ray_cluster():
    assert [argv[:2] for _, argv in broker_commands()] == [["broker", "demo"]]
    redis_cmd = SERVICES["redis"]["command"]
    assert redis_cmd[redis_cmd.index("--appendonly") + 1] == "yes"
    assert any(argv[:3] == ["ray", "start", "--head"] for argv in commands(SERVICES["ray-head"]))
    assert any(argv[:2] == ["ray", "start"] and any(a.startswith("--address=ray-head:") for a in argv)
               for argv in commands(SERVICES["ray-worker"]))
    for name in ("ray-head", "ray-worker"):
        assert SERVICES[name]["environment"]["REDIS_URL"].startswith("redis://redis:6379")
        build = SERVICES[name]["build"]
        assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == DOCKER / "Dockerfile"


@pytest.mark.parametrize(("service", "argv"), broker_commands())
def test_every_broker_command_and_variable_exists_in_the_cli(service, argv, monkeypatch):
    env = {k: str(v) for k, v in SERVICES[service].get("environment", {}).items()}
    assert not any("$" in a for a in argv), f"{service}: compose interpolates $ from the host, not the container"
    help_text = subcommand_help(argv)
    for var in env:
        assert f"${var}" in help_text or var.startswith("RAY_"), f"{service}: {var} is not read by {argv[:2]}"
    # Parse as in the container: its environment supplies the defaults the help promises.
    for var in ("REDIS_URL", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    args = build_parser().parse_args(argv[1:])  # exits (fails the test) on an unknown option
    if "REDIS_URL" in env:
        assert args.redis_url == env["REDIS_URL"]
    if "RAY_ADDRESS" in env:
        assert args.ray_address == env["RAY_ADDRESS"]


def test_dockerfile_installs_the_package_with_its_worker_extras():
    text = (DOCKER / "Dockerfile").read_text()
    assert 'pip install ".[workers]"' in text
    copied = {src for line in text.splitlines() if line.startswith("COPY ") for src in line.split()[1:-1]}
    # What hatchling needs to build the wheel (README is the package's readme, lua/ is force-included).
    assert copied == {"pyproject.toml", "README.md", "broker", "workers", "lua"}
    assert all((DOCKER.parent / path).exists() for path in copied)
