"""docker-compose.yml: a working demo wired consistently (checked statically, no Docker)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from .support import (
    CONFIG_PATH,
    GRAFANA_PORT,
    PROMETHEUS_PORT,
    PROXY_PORT,
    REPO,
    load_yaml,
)


def _compose() -> dict[str, Any]:
    compose: dict[str, Any] = load_yaml(REPO / "docker-compose.yml")
    return compose


def _services() -> dict[str, Any]:
    services: dict[str, Any] = _compose()["services"]
    return services


def _sims() -> dict[str, Any]:
    return {n: s for n, s in _services().items() if s.get("command", [None])[0] == "sim"}


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def _bind_mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> host path of the service's bind mounts."""
    out = {}
    for volume in service.get("volumes", []):
        host, container, *_ = volume.split(":")
        out[container] = host
    return out


def test_services_present() -> None:
    services = _services()
    assert {"headroom", "prometheus", "grafana"} <= services.keys()
    assert len(_sims()) >= 2, "the demo needs two simulated GPUs"


def test_published_ports() -> None:
    services = _services()
    assert f"{PROXY_PORT}:{PROXY_PORT}" in services["headroom"]["ports"]
    assert f"{PROMETHEUS_PORT}:{PROMETHEUS_PORT}" in services["prometheus"]["ports"]
    assert f"{GRAFANA_PORT}:{GRAFANA_PORT}" in services["grafana"]["ports"]


def test_bind_mount_sources_exist_in_the_repository() -> None:
    for name, service in _services().items():
        for host in _bind_mounts(service).values():
            assert host.startswith("./"), f"{name}: {host} is not repository-relative"
            assert (REPO / host).exists(), f"{name}: {host} does not exist"


def test_headroom_service_runs_the_image_with_the_compose_config() -> None:
    headroom = _services()["headroom"]
    assert headroom["build"]["context"] == "."
    assert (REPO / headroom["build"]["dockerfile"]).is_file()
    assert headroom["command"] == ["serve", "--config", CONFIG_PATH]
    assert headroom["environment"]["HEADROOM_CONFIG"] == CONFIG_PATH
    assert _bind_mounts(headroom)[CONFIG_PATH] == "./deploy/compose/headroom.yaml"


def test_simulators_use_the_same_image_and_a_known_preset() -> None:
    from proxy.sim.presets import preset_names

    image = _services()["headroom"]["image"]
    for name, sim in _sims().items():
        assert sim["image"] == image, name
        command = sim["command"]
        assert _flag(command, "--preset") in preset_names(), name
        assert _flag(command, "--gpus") == "1", name
        assert _flag(command, "--host") == "0.0.0.0", name


def test_headroom_replicas_are_the_simulators() -> None:
    config = load_yaml(REPO / "deploy" / "compose" / "headroom.yaml")
    sims = {name: int(_flag(s["command"], "--port")) for name, s in _sims().items()}
    urls = [r["url"] for p in config["pools"] for r in p["replicas"]]
    assert {(urlsplit(u).hostname, urlsplit(u).port) for u in urls} == set(sims.items())
    assert config["listen"]["port"] == PROXY_PORT
    depends = _services()["headroom"]["depends_on"]
    assert set(depends) == set(sims) | {"redis"}
    assert all(d["condition"] == "service_healthy" for d in depends.values())
    for name in sims:
        assert _sims()[name]["healthcheck"]["test"], name


def test_stop_grace_period_exceeds_the_drain_timeout() -> None:
    config = load_yaml(REPO / "deploy" / "compose" / "headroom.yaml")
    grace = _services()["headroom"]["stop_grace_period"]
    assert grace.endswith("s")
    assert int(grace[:-1]) > config["drain_timeout_s"]


def test_prometheus_scrapes_headroom_and_every_simulator() -> None:
    prometheus = _services()["prometheus"]
    mounts = _bind_mounts(prometheus)
    config_path = next(a.split("=", 1)[1] for a in prometheus["command"] if "config.file" in a)
    assert mounts[config_path] == "./deploy/compose/prometheus.yml"
    assert mounts["/etc/prometheus/rules"] == "./deploy/prometheus/rules"
    config = load_yaml(REPO / "deploy" / "compose" / "prometheus.yml")
    targets = {
        t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    assert f"headroom:{PROXY_PORT}" in targets
    for name, sim in _sims().items():
        assert f"{name}:{_flag(sim['command'], '--port')}" in targets


def test_two_gateways_share_caps_through_the_redis_service() -> None:
    services = _services()
    config = load_yaml(REPO / "deploy" / "compose" / "headroom.yaml")
    assert config["admission"]["backend"] == "redis"
    url = urlsplit(config["admission"]["redis"]["url"])
    assert (url.hostname, url.port) == ("redis", 6379)
    assert services["redis"]["healthcheck"]["test"]
    assert "noeviction" in services["redis"]["command"]
    first, second = services["headroom"], services["headroom-2"]
    for key in ("image", "command", "volumes", "depends_on"):
        assert first[key] == second[key], key
    assert "8081:8080" in second["ports"]
    prometheus = load_yaml(REPO / "deploy" / "compose" / "prometheus.yml")
    targets = {
        t
        for job in prometheus["scrape_configs"]
        for sc in job["static_configs"]
        for t in sc["targets"]
    }
    assert {"headroom:8080", "headroom-2:8080"} <= targets


RAMP = "4,4,8,16,25"


def test_the_example_caps_assume_the_chunk_ramp_and_keep_the_simulated_rules() -> None:
    """The compose simulators run vLLM-Omni's codec_chunk_ramp (without it no cap keeps a
    0.2 s-prebuffer listener from stalling), and every example config caps the same TTS
    GPUs at the cap the simulator's model keeps its rules at on every seed; the probe's
    measurements against it are in deploy/README.md."""
    from proxy.sim.capacity import describe
    from proxy.sim.chunks import parse_ramp
    from proxy.sim.presets import get_preset

    from .support import DEPLOY, configmap_config, helm_values_config

    commands = [s["command"] for s in _sims().values()]
    assert {_flag(c, "--codec-chunk-ramp") for c in commands} == {RAMP}
    (preset_name,) = {_flag(c, "--preset") for c in commands}
    preset = get_preset(preset_name).with_schedule(initial_frames=None, ramp=parse_ramp(RAMP))
    cap = describe(preset)["recommended_cap"]
    assert cap >= 1
    assert describe(preset_name)["recommended_cap"] == 0, "the default chunking keeps none"
    k8s = DEPLOY / "kubernetes"
    examples = {
        "compose": load_yaml(DEPLOY / "compose" / "headroom.yaml"),
        "gateway": configmap_config(k8s / "gateway" / "configmap.yaml"),
        "gateway-shared": configmap_config(k8s / "gateway-shared" / "configmap-patch.yaml"),
        "helm": helm_values_config(),
    }
    for where, config in examples.items():
        (tts,) = [p for p in config["pools"] if p["name"] == "tts-main"]
        assert {r["max_sessions"] for r in tts["replicas"]} == {cap}, where
    for path in (DEPLOY / "compose" / "headroom.yaml", k8s / "gateway" / "configmap.yaml",
                 k8s / "gateway-shared" / "configmap-patch.yaml",
                 DEPLOY / "helm" / "headroom" / "values.yaml"):  # fmt: skip
        text = path.read_text()
        assert "codec_chunk_ramp" in text, path
        assert "4, 4, 8, 16, 25" in text or RAMP in text, path


def _load_commands(text: str, prefix: str) -> list[list[str]]:
    """The ``headroom probe`` commands of ``text`` (lines starting with ``prefix``, a ``\\``
    continuing one), as argv without the program name."""
    import shlex

    commands: list[list[str]] = []
    lines = [line.removeprefix(prefix).strip() for line in text.splitlines()]
    for i, line in enumerate(lines):
        if not line.startswith("headroom probe "):
            continue
        words = line
        while words.endswith("\\"):
            i += 1
            words = words[:-1] + " " + lines[i]
        commands.append(shlex.split(words)[1:])
    return commands


def test_the_load_commands_drive_the_compose_gateway_past_its_slots() -> None:
    """docker-compose.yml's header and deploy/README.md's compose section drive load with a
    `headroom probe` the CLI accepts, aimed at the published gateway port on a route the
    compose configuration serves, holding more sessions than the GPUs have slots (so
    sessions queue and some are refused), bounded in time and at one level."""
    from proxy.process.cli import build_parser

    config = load_yaml(REPO / "deploy" / "compose" / "headroom.yaml")
    slots = sum(r["max_sessions"] for p in config["pools"] for r in p["replicas"])
    protocols = {r["protocol"] for r in config["routes"]}
    header = (REPO / "docker-compose.yml").read_text().split("\nx-headroom-image", 1)[0]
    readme = (REPO / "deploy" / "README.md").read_text()
    compose_section = readme.split("## docker compose demo", 1)[1].split("\n### ", 1)[0]
    from_header, from_readme = _load_commands(header, "#"), _load_commands(compose_section, "")
    assert from_header and from_readme, "each says how to drive load"
    commands = from_header + from_readme
    for argv in commands:
        args = build_parser().parse_args(argv)
        assert args.command == "probe"
        target = urlsplit(args.target)
        assert (target.hostname, target.port) == ("localhost", PROXY_PORT), argv
        assert args.protocol in protocols, argv
        levels = [int(level) for level in args.levels.split(",")]
        assert levels == [levels[0]] and levels[0] > slots, argv
        assert args.no_bisect and args.repeat == 0, argv
        assert args.time_limit <= 600, argv
