//! The shipped dashboard and alert rules parse, and name only metrics the crate emits.

use std::collections::BTreeSet;

use stampede_guard::metrics::{ALL, Event, MetricKind};
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
        "Origin calls saved",
        "Origin failures",
    ] {
        assert!(titles.contains(&wanted), "no panel {wanted:?}");
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
