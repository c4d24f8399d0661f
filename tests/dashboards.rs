//! The shipped dashboard and alert rules parse, and name only metrics the crate emits.

use std::collections::BTreeSet;

use stampede_guard::metrics::{ALL, Event, MetricKind, PER_PROCESS};
use yaml_rust2::{Yaml, YamlLoader};

/// Every series name the crate can render.
fn emitted() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for &(name, kind, _) in ALL {
        names.insert(name.to_owned());
        if kind == MetricKind::Histogram {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        }
    }
    names
}

fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("stampede_guard_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    out
}

/// The metric a series name belongs to: a histogram's `_bucket`, `_sum` and `_count`
/// are its own name.
fn metric_of(series: &str) -> &str {
    for &(name, kind, _) in ALL {
        if kind == MetricKind::Histogram
            && let Some(suffix) = series.strip_prefix(name)
            && ["_bucket", "_sum", "_count"].contains(&suffix)
        {
            return name;
        }
    }
    series
}

/// Each selector of a crate metric in `expr`: the series name and its matchers (what is
/// between its braces; `None` when it has none).
fn selectors(expr: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("stampede_guard_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = tail[..end].to_owned();
        rest = &tail[end..];
        let matchers = match rest.strip_prefix('{') {
            Some(inner) => {
                let close = inner.find('}').expect("a selector's braces close");
                rest = &inner[close..];
                Some(inner[..close].to_owned())
            }
            None => None,
        };
        out.push((name, matchers));
    }
    out
}

/// Every `datasource` reference in the dashboard: (where, the reference).
fn datasources<'a>(
    value: &'a serde_json::Value,
    at: &str,
    out: &mut Vec<(String, &'a serde_json::Value)>,
) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, value) in map {
                let here = format!("{at}.{key}");
                if key == "datasource" {
                    out.push((here.clone(), value));
                }
                datasources(value, &here, out);
            }
        }
        serde_json::Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                datasources(item, &format!("{at}[{i}]"), out);
            }
        }
        _ => {}
    }
}

fn exprs_in_json(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, value) in map {
                if key == "expr" {
                    out.push(value.as_str().expect("expr is a string").to_owned());
                } else {
                    exprs_in_json(value, out);
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| exprs_in_json(v, out)),
        _ => {}
    }
}

#[test]
fn the_dashboard_uses_only_emitted_metrics_and_has_the_panels_users_ask_for() {
    let text = std::fs::read_to_string("dashboards/stampede-guard.json").unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    assert!(
        variables
            .iter()
            .any(|v| v["type"] == "datasource" && v["query"] == "prometheus"),
        "no Prometheus data source variable"
    );
    let mut exprs = Vec::new();
    exprs_in_json(&dashboard, &mut exprs);
    assert!(exprs.len() >= 20);
    let emitted = emitted();
    for expr in &exprs {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{expr}");
        for name in names {
            assert!(
                emitted.contains(&name),
                "the dashboard uses {name}, which the crate does not emit"
            );
        }
    }
    let titles: Vec<&str> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["title"].as_str().unwrap())
        .collect();
    for wanted in [
        "Lease acquisition rate",
        "Lease acquisition failure rate",
        "Lease acquire latency",
        "Contention by route",
        "Lease hold duration vs TTL",
        "Lease releases",
        "Owner mismatches",
        "Lease renewals",
        "Expired while working",
        "Redis timeouts",
        "Stale served",
        "Origin calls avoided: the stampedes stopped",
        "Origin failures",
        "L1 entries",
        "L1 bytes",
    ] {
        assert!(titles.contains(&wanted), "no panel {wanted:?}");
    }
}

fn dashboard() -> serde_json::Value {
    let text = std::fs::read_to_string("dashboards/stampede-guard.json").unwrap();
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// Grafana's import offers a choice of Prometheus data source (as a dashboard exported
/// for sharing does), and every panel, query and variable uses the one chosen, or the
/// `datasource` variable that starts at it.
#[test]
fn the_dashboard_imports_with_a_choice_of_data_source() {
    let dashboard = dashboard();
    let inputs = dashboard["__inputs"].as_array().expect("__inputs");
    assert_eq!(inputs.len(), 1, "{inputs:?}");
    let input = &inputs[0];
    assert_eq!(input["name"], "DS_PROMETHEUS");
    assert_eq!(input["type"], "datasource");
    assert_eq!(input["pluginId"], "prometheus");
    assert!(input["label"].is_string(), "{input}");
    assert!(
        dashboard["__requires"]
            .as_array()
            .expect("__requires")
            .iter()
            .any(|r| r["type"] == "datasource" && r["id"] == "prometheus"),
        "__requires names no Prometheus data source"
    );
    // The `datasource` variable starts at the data source chosen on import.
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    let chooser: Vec<_> = variables
        .iter()
        .filter(|v| v["type"] == "datasource")
        .collect();
    assert_eq!(chooser.len(), 1);
    assert_eq!(chooser[0]["name"], "datasource");
    assert_eq!(chooser[0]["query"], "prometheus");
    assert_eq!(chooser[0]["current"]["value"], "${DS_PROMETHEUS}");
    let mut refs = Vec::new();
    datasources(&dashboard, "", &mut refs);
    let panels = dashboard["panels"].as_array().unwrap();
    let targets: usize = panels
        .iter()
        .map(|p| p["targets"].as_array().unwrap().len())
        .sum();
    // Each panel, each of its targets and each query variable.
    assert_eq!(
        refs.len(),
        panels.len() + targets + variables.len() - 1,
        "{refs:#?}"
    );
    for (at, reference) in refs {
        assert_eq!(reference["type"], "prometheus", "{at}: {reference}");
        let uid = reference["uid"].as_str().unwrap_or_default();
        assert!(
            uid == "${DS_PROMETHEUS}" || uid == "${datasource}",
            "{at}: data source {reference}, neither the one chosen on import nor the variable"
        );
    }
}

/// `job`, `instance` and `route` variables, multi-valued with All, and every query
/// filtered by them: two services on one Prometheus are never summed together.
#[test]
fn every_query_is_filtered_by_job_instance_and_route() {
    let dashboard = dashboard();
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    for (name, label) in [("job", "job"), ("instance", "instance"), ("route", "route")] {
        let variable = variables
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no variable {name}"));
        assert_eq!(variable["type"], "query", "{variable}");
        let query = variable["query"].as_str().expect("a query");
        assert!(
            query.starts_with("label_values(") && query.ends_with(&format!(", {label})")),
            "{name}: {query}"
        );
        assert_eq!(variable["definition"], variable["query"], "{name}");
        assert_eq!(variable["multi"], true, "{name}");
        assert_eq!(variable["includeAll"], true, "{name}");
        // All is `.*`, not the list of values: it also matches series without the label
        // (the leases used on their own have no route).
        assert_eq!(variable["allValue"], ".*", "{name}");
        assert_eq!(variable["datasource"]["uid"], "${datasource}", "{name}");
    }
    // Each variable narrows by those before it.
    let query = |name: &str| {
        variables.iter().find(|v| v["name"] == name).unwrap()["query"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert!(query("instance").contains(r#"job=~"$job""#));
    assert!(query("route").contains(r#"job=~"$job""#));
    assert!(query("route").contains(r#"instance=~"$instance""#));

    let mut exprs = Vec::new();
    exprs_in_json(&dashboard["panels"], &mut exprs);
    let mut routed = 0;
    let mut per_process = 0;
    for expr in &exprs {
        let selectors = selectors(expr);
        assert!(!selectors.is_empty(), "{expr}");
        for (series, matchers) in selectors {
            let matchers = matchers.unwrap_or_else(|| panic!("{series} unfiltered in {expr}"));
            let matchers: Vec<&str> = matchers.split(',').map(str::trim).collect();
            for wanted in [r#"job=~"$job""#, r#"instance=~"$instance""#] {
                assert!(
                    matchers.contains(&wanted),
                    "{series} without {wanted} in {expr}"
                );
            }
            let by_route = matchers.contains(&r#"route=~"$route""#);
            if PER_PROCESS.contains(&metric_of(&series)) {
                assert!(
                    !by_route,
                    "{series} has no route label, but {expr} filters by it"
                );
                per_process += 1;
            } else {
                assert!(by_route, "{series} without route=~\"$route\" in {expr}");
                routed += 1;
            }
        }
    }
    assert!(routed >= 20 && per_process >= 5, "{routed} {per_process}");
}

/// Counts and bytes (and counts and rates) never share an axis: a panel's series whose
/// unit is not the panel's have an axis of their own.
#[test]
fn every_unit_of_a_panel_has_its_own_axis() {
    let dashboard = dashboard();
    for panel in dashboard["panels"].as_array().unwrap() {
        let title = panel["title"].as_str().unwrap();
        let unit = panel["fieldConfig"]["defaults"]["unit"]
            .as_str()
            .unwrap_or_else(|| panic!("{title}: no unit"));
        let placement = panel["fieldConfig"]["defaults"]["custom"]["axisPlacement"]
            .as_str()
            .unwrap_or("auto");
        let overrides = panel["fieldConfig"]["overrides"].as_array().unwrap();
        for target in panel["targets"].as_array().unwrap() {
            let ref_id = target["refId"].as_str().unwrap();
            let expr = target["expr"].as_str().unwrap();
            let property = |id: &str| {
                overrides
                    .iter()
                    .filter(|o| {
                        o["matcher"]["id"] == "byFrameRefID" && o["matcher"]["options"] == ref_id
                    })
                    .flat_map(|o| o["properties"].as_array().unwrap())
                    .find(|p| p["id"] == id)
                    .map(|p| p["value"].as_str().unwrap().to_owned())
            };
            let own_unit = property("unit").unwrap_or_else(|| unit.to_owned());
            let in_bytes = selectors(expr).iter().any(|(s, _)| s.ends_with("_bytes"));
            assert_eq!(
                in_bytes,
                own_unit == "bytes",
                "{title} {ref_id}: {expr} drawn in {own_unit}"
            );
            if own_unit != unit {
                let own_placement = property("custom.axisPlacement");
                assert!(
                    own_placement.is_some_and(|p| p != placement && p != "auto" && p != "hidden"),
                    "{title} {ref_id}: {own_unit} on the same axis as {unit}"
                );
            }
        }
    }
}

#[test]
fn the_alert_rules_use_only_emitted_metrics() {
    let text = std::fs::read_to_string("dashboards/alerts.yml").unwrap();
    let docs = YamlLoader::load_from_str(&text).expect("the rules are YAML");
    let groups = docs[0]["groups"].as_vec().expect("groups");
    let emitted = emitted();
    let mut alerts = Vec::new();
    for group in groups {
        for rule in group["rules"].as_vec().unwrap() {
            let name = rule["alert"].as_str().expect("an alert name");
            let expr = rule["expr"].as_str().expect("an expr");
            assert!(
                !matches!(rule["annotations"]["summary"], Yaml::BadValue),
                "{name}"
            );
            for metric in metric_names(expr) {
                assert!(
                    emitted.contains(&metric),
                    "{name} uses {metric}, which the crate does not emit"
                );
            }
            alerts.push(name.to_owned());
        }
    }
    for wanted in [
        "StampedeGuardLeaseAcquireFailures",
        "StampedeGuardLeaseHoldNearTTL",
        "StampedeGuardOwnerMismatch",
        "StampedeGuardRenewalFailures",
        "StampedeGuardRedisTimeouts",
        "StampedeGuardCircuitOpen",
    ] {
        assert!(alerts.iter().any(|a| a == wanted), "no alert {wanted}");
    }
}

/// Every event's metric is in the list the dashboard is checked against.
#[test]
fn every_event_is_a_listed_metric() {
    let listed: BTreeSet<&str> = ALL.iter().map(|(name, _, _)| *name).collect();
    for event in Event::ALL {
        let (name, _) = event.metric();
        assert!(
            listed.contains(name),
            "{event:?} is counted as {name}, which is not listed"
        );
    }
}
