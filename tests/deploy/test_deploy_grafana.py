"""The Grafana dashboard and its provisioning."""

from __future__ import annotations

import json
from typing import Any

from .support import DASHBOARD, DEPLOY, alert_rules, exported_series, load_yaml, selectors


def _board() -> dict[str, Any]:
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return board


def _panels() -> list[dict[str, Any]]:
    return [p for p in _board()["panels"] if p["type"] != "row"]


def test_dashboard_identity() -> None:
    board = _board()
    assert board["uid"] == "headroom-overview"
    assert board["id"] is None  # provisioned dashboards must not carry a database id
    assert board["title"]


def test_template_variables_for_datasource_pool_and_replica() -> None:
    variables = {v["name"]: v for v in _board()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert "headroom_" in variables["pool"]["query"]["query"]
    assert variables["pool"]["query"]["query"].endswith(", pool)")
    replica_query = variables["replica"]["query"]["query"]
    assert "$pool" in replica_query
    assert replica_query.endswith(", replica)")


def test_every_query_uses_the_datasource_variable() -> None:
    for panel in _panels():
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_every_selector_is_filtered_by_pool_and_replica_variables() -> None:
    series = exported_series()
    problems = []
    for panel in _panels():
        for target in panel["targets"]:
            for metric, matchers in selectors(target["expr"]):
                if 'pool=~"$pool"' not in matchers:
                    problems.append(f"{panel['title']}: {metric} not filtered by $pool")
                if "replica" in series.get(metric, set()) and (
                    'replica=~"$replica"' not in matchers
                ):
                    problems.append(f"{panel['title']}: {metric} not filtered by $replica")
    assert not problems, "\n".join(problems)


def test_delivery_ratio_panel_draws_the_1_2_line() -> None:
    panel = next(
        p for p in _panels()
        if any("headroom_delivery_ratio_worst_1pct" in t["expr"] for t in p["targets"])
    )  # fmt: skip
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["custom"]["thresholdsStyle"]["mode"] in {"line", "line+area", "dashed"}
    steps = [s["value"] for s in defaults["thresholds"]["steps"]]
    assert 1.2 in steps


def test_engine_queue_is_shown_next_to_the_p99_gap() -> None:
    contrast = [
        p for p in _panels()
        if any("headroom_engine_requests_waiting" in t["expr"] for t in p["targets"])
        and any("headroom_chunk_gap_seconds_bucket" in t["expr"] for t in p["targets"])
    ]  # fmt: skip
    assert contrast, "no panel puts engine queue depth beside the p99 gap"
    exprs = [t["expr"] for t in contrast[0]["targets"]]
    assert any("histogram_quantile(0.99" in e for e in exprs)


def test_time_to_first_audio_is_the_clients_with_the_engines_part_beside_it() -> None:
    """The time to first audio panel shows what clients waited (queue included) with the
    alert's threshold line; the panel beside it has the engine's part and the queue."""
    client, engine = (
        "headroom_client_time_to_first_audio_seconds_bucket",
        "headroom_time_to_first_audio_seconds_bucket",
    )
    panels = _panels()
    (main,) = [p for p in panels if all(client in t["expr"] for t in p["targets"])]
    assert {t["expr"].split(",")[0] for t in main["targets"]} == {
        "histogram_quantile(0.5", "histogram_quantile(0.95", "histogram_quantile(0.99",
    }  # fmt: skip
    alert = next(r for r in alert_rules() if r["alert"] == "HeadroomTimeToFirstAudioHigh")
    threshold = float(alert["expr"].rsplit(">", 1)[1])
    defaults = main["fieldConfig"]["defaults"]
    assert defaults["custom"]["thresholdsStyle"]["mode"] == "line"
    assert threshold in [s["value"] for s in defaults["thresholds"]["steps"]]
    (split,) = [p for p in panels if any(engine in t["expr"] for t in p["targets"])]
    exprs = " ".join(t["expr"] for t in split["targets"])
    assert client in exprs and "headroom_queue_wait_seconds_bucket" in exprs
    beside = (main["gridPos"]["y"], main["gridPos"]["x"] + main["gridPos"]["w"])
    assert (split["gridPos"]["y"], split["gridPos"]["x"]) == beside


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    panels = _board()["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_panels_are_described() -> None:
    for panel in _panels():
        assert panel.get("description"), panel["title"]
        assert panel["targets"], panel["title"]


def test_provisioning_points_at_the_compose_services() -> None:
    datasources = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    default = next(v for v in _board()["templating"]["list"] if v["name"] == "datasource")
    assert source["uid"] == default["current"]["value"]

    providers = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "headroom.yaml")
    (provider,) = providers["providers"]
    compose = load_yaml(DEPLOY.parent / "docker-compose.yml")
    mounts = dict(
        (v.split(":")[1], v.split(":")[0]) for v in compose["services"]["grafana"]["volumes"]
    )
    assert mounts[provider["options"]["path"]] == "./deploy/grafana/dashboards"
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
