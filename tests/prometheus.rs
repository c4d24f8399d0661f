//! The shipped alert rules and dashboard, proven on a real Prometheus.
//!
//! `promtool` checks `dashboards/alerts.yml` and runs its unit tests
//! (`dashboards/alerts_test.yml`, which must give every alert a case where it fires and
//! one where it does not). Then a Prometheus of the test's own scrapes two sidecars as
//! two jobs (two services, each a separate process in front of a real origin and a real
//! `redis-server` of its own), while real HTTP load runs through them and one's Redis is
//! paused and resumed: every query of every panel of `dashboards/stampede-guard.json`
//! must return data, and with the dashboard's `job`, `instance` and `route` variables
//! set to one service, show that service's series only.
//!
//! Needs `prometheus` and `promtool` on `PATH` (Debian: `apt-get install prometheus`), or
//! `PROMETHEUS_BIN` and `PROMTOOL_BIN`. The tests never use a Prometheus that runs
//! already: each starts its own, on a free port, with its own configuration and storage.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::Path as UrlPath;
use axum::routing::get;
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use support::RedisServer;
use support::server::{find_on_path, free_port, setpriv};
use tempfile::TempDir;
use tokio::net::TcpStream;
use yaml_rust2::{Yaml, YamlLoader};

const ALERTS: &str = "dashboards/alerts.yml";
const ALERT_TESTS: &str = "dashboards/alerts_test.yml";
const DASHBOARD: &str = "dashboards/stampede-guard.json";

/// The scrape jobs of the two services, and the route both sidecars have (their
/// policy's name): the same route in two services, which the dashboard must not mix.
const JOB: &str = "catalog";
const OTHER_JOB: &str = "search";
const ROUTE: &str = "default";

/// How long a process may take to answer after it starts, and how long Prometheus may
/// take to show what happened: far past what a busy machine needs.
const START: Duration = Duration::from_secs(20);
const SEEN: Duration = Duration::from_secs(20);

/// The sidecar under test: the `stampede-sidecar` binary, which cargo builds for every
/// integration test.
fn sidecar_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_stampede-sidecar"))
}

fn tool(name: &str, variable: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(variable) {
        return PathBuf::from(path);
    }
    find_on_path(name).unwrap_or_else(|| {
        panic!(
            "{name} is not on PATH. These tests run promtool and a Prometheus of their own.\n\
             Install it: `apt-get install -y prometheus` (Debian, Ubuntu), \
             `brew install prometheus` (macOS), or set {variable} to its path."
        )
    })
}

fn file(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

fn run_promtool(args: &[&str]) -> String {
    let output = Command::new(tool("promtool", "PROMTOOL_BIN"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("promtool runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "promtool {args:?} failed ({}):\n{text}",
        output.status
    );
    text
}

fn yaml(relative: &str) -> Yaml {
    let text = std::fs::read_to_string(file(relative)).unwrap();
    YamlLoader::load_from_str(&text)
        .unwrap_or_else(|e| panic!("{relative}: {e}"))
        .remove(0)
}

/// Every alert's name in the rule file.
fn alert_names() -> BTreeSet<String> {
    let rules = yaml(ALERTS);
    let mut names = BTreeSet::new();
    for group in rules["groups"].as_vec().expect("groups") {
        for rule in group["rules"].as_vec().expect("rules") {
            if let Some(name) = rule["alert"].as_str() {
                assert!(names.insert(name.to_owned()), "{name} twice");
            }
        }
    }
    names
}

#[test]
fn promtool_accepts_the_alert_rules() {
    let out = run_promtool(&["check", "rules", ALERTS]);
    let rules = alert_names().len();
    assert!(rules >= 6, "{rules} alerts");
    assert!(
        out.contains(&format!("SUCCESS: {rules} rules found")),
        "promtool did not find the {rules} alerts:\n{out}"
    );
}

#[test]
fn every_alert_fires_on_its_series_and_not_on_a_healthy_one() {
    let alerts = alert_names();
    let tests = yaml(ALERT_TESTS);
    assert_eq!(
        tests["rule_files"].as_vec().map(Vec::as_slice),
        Some(&[Yaml::String("alerts.yml".to_owned())][..]),
        "{ALERT_TESTS} tests the shipped rule file"
    );
    // alert → (cases where it fires, cases where it must not)
    let mut cases: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for test in tests["tests"].as_vec().expect("tests") {
        let name = test["name"].as_str().unwrap_or("(unnamed)");
        assert!(
            !test["input_series"]
                .as_vec()
                .unwrap_or(&Vec::new())
                .is_empty(),
            "{name}: no input series"
        );
        for case in test["alert_rule_test"].as_vec().unwrap_or(&Vec::new()) {
            let alert = case["alertname"].as_str().expect("alertname");
            assert!(
                alerts.contains(alert),
                "{name}: tests {alert}, which {ALERTS} does not have"
            );
            let expected = case["exp_alerts"]
                .as_vec()
                .unwrap_or_else(|| panic!("{name}: {alert} has no exp_alerts list"));
            let count = cases.entry(alert.to_owned()).or_default();
            if expected.is_empty() {
                count.1 += 1;
            } else {
                for firing in expected {
                    assert!(
                        firing["exp_labels"]["severity"].as_str().is_some(),
                        "{name}: {alert} fires without its severity label"
                    );
                }
                count.0 += 1;
            }
        }
    }
    for alert in &alerts {
        let (fires, silent) = cases.get(alert).copied().unwrap_or_default();
        assert!(
            fires > 0,
            "{alert} has no case in {ALERT_TESTS} where it fires"
        );
        assert!(
            silent > 0,
            "{alert} has no case in {ALERT_TESTS} where it must not fire"
        );
    }
    let out = run_promtool(&["test", "rules", ALERT_TESTS]);
    assert!(out.contains("SUCCESS"), "{out}");
}

/// A process of the test's own: its output goes to files, shown if the test fails;
/// killed when dropped (and, through `setpriv --pdeathsig`, when the test's thread dies).
struct Spawned {
    name: &'static str,
    child: Option<Child>,
    dir: TempDir,
}

impl Spawned {
    /// Runs `binary` in `dir` (its own temporary directory, kept as long as it runs).
    fn start(name: &'static str, binary: &Path, args: &[String], dir: TempDir) -> Self {
        let mut command = match setpriv() {
            Some(setpriv) => {
                let mut c = Command::new(setpriv);
                c.args(["--pdeathsig", "KILL", "--"]).arg(binary);
                c
            }
            None => Command::new(binary),
        };
        let log = std::fs::File::create(dir.path().join("log")).unwrap();
        let child = command
            .args(args)
            // The sidecar's key secret (Prometheus ignores it).
            .env(
                "STAMPEDE_GUARD_SECRET",
                "a prometheus test secret of 16+ bytes",
            )
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("could not run {}: {e}", binary.display()));
        Self {
            name,
            child: Some(child),
            dir,
        }
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut()?.try_wait().unwrap()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            let log = self.log();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            eprintln!("--- {} (last lines of its output) ---", self.name);
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

struct Reply {
    status: u16,
    x_cache: String,
    body: String,
}

/// `GET target` on a connection of its own. Errors (nothing listening yet, a reset) are
/// returned, for polling; a hang past 10 s is an error too.
async fn http_get(addr: SocketAddr, target: &str) -> Result<Reply, String> {
    let exchange = async {
        let stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let request = Request::get(target)
            .header("host", addr.to_string())
            .body(Empty::<Bytes>::new())
            .unwrap();
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let x_cache = response
            .headers()
            .get("x-cache")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok(Reply {
            status,
            x_cache,
            body: String::from_utf8_lossy(&body).into_owned(),
        })
    };
    tokio::time::timeout(Duration::from_secs(10), exchange)
        .await
        .map_err(|_| format!("GET {target} on {addr}: no answer in 10 s"))?
}

/// Waits until `process` answers 200 on `path`; `Err` with its output if it exited
/// first (a port taken between picking and binding, say).
async fn answers(process: &mut Spawned, addr: SocketAddr, path: &str) -> Result<(), String> {
    let deadline = Instant::now() + START;
    loop {
        if let Some(status) = process.exited() {
            return Err(format!(
                "{} exited with {status}:\n{}",
                process.name,
                process.log()
            ));
        }
        if let Ok(reply) = http_get(addr, path).await
            && reply.status == 200
        {
            return Ok(());
        }
        assert!(
            Instant::now() < deadline,
            "{} does not answer GET {path} on {addr} after {START:?}:\n{}",
            process.name,
            process.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `process` accepts connections on `addr`; `Err` as [`answers`].
async fn listening(process: &mut Spawned, addr: SocketAddr) -> Result<(), String> {
    let deadline = Instant::now() + START;
    loop {
        if let Some(status) = process.exited() {
            return Err(format!(
                "{} exited with {status}:\n{}",
                process.name,
                process.log()
            ));
        }
        if TcpStream::connect(addr).await.is_ok() {
            return Ok(());
        }
        assert!(
            Instant::now() < deadline,
            "{} does not listen on {addr} after {START:?}:\n{}",
            process.name,
            process.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn temp_dir(name: &str) -> TempDir {
    tempfile::Builder::new()
        .prefix(&format!("stampede-guard-{name}-"))
        .tempdir()
        .unwrap()
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// The sidecar, in front of `origin` with `redis` as its L2, entries fresh for `fresh`,
/// leases taken for `lease`, metrics on a port of their own. Returns it, its address and
/// its metrics' address.
async fn start_sidecar(
    origin: SocketAddr,
    redis: &str,
    fresh: &str,
    lease: &str,
) -> (Spawned, SocketAddr, SocketAddr) {
    let binary = sidecar_binary();
    let mut last = String::new();
    // A port picked as free can be taken before the sidecar binds it: a few tries.
    for _ in 0..5 {
        let (listen, metrics) = (loopback(free_port()), loopback(free_port()));
        let args: Vec<String> = [
            "--listen",
            &listen.to_string(),
            "--upstream",
            &format!("http://{origin}"),
            "--redis",
            redis,
            // The test's origin says nothing of freshness: the sidecar's own policy.
            "--follow-origin",
            "false",
            "--fresh",
            fresh,
            "--grace",
            "60s",
            "--lease",
            lease,
            "--cold-wait",
            "1s",
            "--metrics",
            &metrics.to_string(),
        ]
        .iter()
        .map(|a| (*a).to_owned())
        .collect();
        let mut sidecar = Spawned::start("sidecar", &binary, &args, temp_dir("sidecar"));
        // Its metrics listen first, then (once Redis answers) the proxy. A request would
        // be counted: the proxy's port is only connected to.
        let up = match answers(&mut sidecar, metrics, "/metrics").await {
            Ok(()) => listening(&mut sidecar, listen).await,
            Err(log) => Err(log),
        };
        match up {
            Ok(()) => return (sidecar, listen, metrics),
            Err(log) => last = log,
        }
    }
    panic!("the sidecar did not start in 5 tries; last:\n{last}");
}

/// A Prometheus of the test's own: scrapes each `(job, target)` every second, evaluates
/// the shipped rules every second, stores in a temporary directory.
async fn start_prometheus(targets: &[(&str, SocketAddr)]) -> (Spawned, SocketAddr) {
    let jobs: String = targets
        .iter()
        .map(|(job, target)| {
            format!("  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n")
        })
        .collect();
    let binary = tool("prometheus", "PROMETHEUS_BIN");
    let mut last = String::new();
    for _ in 0..5 {
        let listen = loopback(free_port());
        let dir = temp_dir("prometheus");
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - '{rules}'\n\
                 scrape_configs:\n{jobs}",
                rules = file(ALERTS).display(),
            ),
        )
        .unwrap();
        let storage = dir.path().join("data");
        let args = vec![
            format!("--config.file={}", config.display()),
            format!("--storage.tsdb.path={}", storage.display()),
            format!("--web.listen-address={listen}"),
            "--log.level=warn".to_owned(),
        ];
        let mut prometheus = Spawned::start("prometheus", &binary, &args, dir);
        match answers(&mut prometheus, listen, "/-/ready").await {
            Ok(()) => return (prometheus, listen),
            Err(log) => last = log,
        }
    }
    panic!("prometheus did not start in 5 tries; last:\n{last}");
}

fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// One sample of an instant query's answer: its labels and value.
#[derive(Debug, Clone)]
struct Sample {
    labels: BTreeMap<String, String>,
    value: f64,
}

/// Runs `expr` through `/api/v1/query`, at now; panics unless its status is success.
async fn query(prometheus: SocketAddr, expr: &str) -> Vec<Sample> {
    query_at(prometheus, expr, None).await
}

/// Runs `expr` at `at` (Unix seconds), or now; panics unless its status is success.
async fn query_at(prometheus: SocketAddr, expr: &str, at: Option<f64>) -> Vec<Sample> {
    let mut target = format!("/api/v1/query?query={}", url_encode(expr));
    if let Some(at) = at {
        target.push_str(&format!("&time={at:.3}"));
    }
    let reply = http_get(prometheus, &target)
        .await
        .unwrap_or_else(|e| panic!("{expr}: {e}"));
    let answer: Value = serde_json::from_str(&reply.body)
        .unwrap_or_else(|e| panic!("{expr}: not JSON ({e}): {}", reply.body));
    assert_eq!(
        answer["status"], "success",
        "{expr}: HTTP {}: {}",
        reply.status, reply.body
    );
    let data = &answer["data"];
    let value = |pair: &Value| -> f64 {
        let text = pair[1].as_str().expect("a sample value is a string");
        text.parse()
            .unwrap_or_else(|_| panic!("{expr}: value {text}"))
    };
    match data["resultType"].as_str() {
        Some("vector") => data["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| Sample {
                labels: s["metric"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
                    .collect(),
                value: value(&s["value"]),
            })
            .collect(),
        Some("scalar") => vec![Sample {
            labels: BTreeMap::new(),
            value: value(&data["result"]),
        }],
        other => panic!("{expr}: result type {other:?}"),
    }
}

/// The sum of `expr`'s samples, or None while it has none.
async fn total(prometheus: SocketAddr, expr: &str) -> Option<f64> {
    let samples = query(prometheus, expr).await;
    (!samples.is_empty()).then(|| samples.iter().map(|s| s.value).sum())
}

/// Polls until `check` holds on what Prometheus answers, within [`SEEN`]; `check` says
/// what it saw when it does not hold.
async fn until_seen<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = Instant::now() + SEEN;
    while let Err(saw) = check().await {
        assert!(
            Instant::now() < deadline,
            "Prometheus did not show {what} within {SEEN:?}; last seen: {saw}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `Ok` if `holds`, else what was seen.
fn holds(ok: bool, saw: impl std::fmt::Debug) -> Result<(), String> {
    if ok { Ok(()) } else { Err(format!("{saw:?}")) }
}

/// The alerts Prometheus has pending or firing: (name, job) → (severity, state).
async fn alerts(prometheus: SocketAddr) -> BTreeMap<(String, String), (String, String)> {
    let body = http_get(prometheus, "/api/v1/alerts").await.unwrap().body;
    let answer: Value = serde_json::from_str(&body).unwrap();
    answer["data"]["alerts"]
        .as_array()
        .unwrap_or_else(|| panic!("/api/v1/alerts: {body}"))
        .iter()
        .map(|a| {
            let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            (
                (text(&a["labels"]["alertname"]), text(&a["labels"]["job"])),
                (text(&a["labels"]["severity"]), text(&a["state"])),
            )
        })
        .collect()
}

/// Whether `name` is pending for [`JOB`], with `severity`, and for no other job.
fn is_pending(
    alerts: &BTreeMap<(String, String), (String, String)>,
    name: &str,
    severity: &str,
) -> bool {
    let mine = alerts.get(&(name.to_owned(), JOB.to_owned()));
    let others = alerts
        .keys()
        .filter(|(n, job)| n == name && job != JOB)
        .count();
    mine == Some(&(severity.to_owned(), "pending".to_owned())) && others == 0
}

/// Every panel query of the dashboard: (panel title, expr).
fn panel_queries() -> Vec<(String, String)> {
    fn walk(value: &Value, out: &mut Vec<(String, String)>) {
        match value {
            Value::Object(map) => {
                if let Some(targets) = map.get("targets").and_then(Value::as_array) {
                    let title = map["title"].as_str().expect("a panel has a title");
                    for target in targets {
                        let expr = target["expr"].as_str().expect("a target has an expr");
                        out.push((title.to_owned(), expr.to_owned()));
                    }
                }
                if let Some(panels) = map.get("panels") {
                    walk(panels, out);
                }
            }
            Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let text = std::fs::read_to_string(file(DASHBOARD)).unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    assert_eq!(
        out.len(),
        text.matches("\"expr\"").count(),
        "an expr outside a panel's targets"
    );
    assert!(out.len() >= 20);
    out
}

/// The dashboard's variables, as a user sets them: each a regular expression (`.*` for
/// All, as the dashboard's `allValue`).
#[derive(Debug, Clone, Copy)]
struct Vars<'a> {
    job: &'a str,
    instance: &'a str,
    route: &'a str,
}

const ALL_VALUES: &str = ".*";

impl<'a> Vars<'a> {
    /// One service's process and route.
    fn of(job: &'a str, instance: &'a str) -> Self {
        Self {
            job,
            instance,
            route: ROUTE,
        }
    }
}

/// `expr` with Grafana's variables set as a dashboard over this test's run would set
/// them: rate windows that reach back over the whole run (under a minute), and `vars`.
fn substitute(expr: &str, vars: Vars<'_>) -> String {
    // Longest first: `$__interval` is a prefix of `$__interval_ms`.
    let variables: [(&str, &str); 9] = [
        ("__rate_interval", "1m"),
        ("__interval_ms", "15000"),
        ("__interval", "15s"),
        ("__range_s", "60"),
        ("__range", "1m"),
        ("instance", vars.instance),
        ("route", vars.route),
        ("job", vars.job),
        ("datasource", "prometheus"),
    ];
    let mut out = expr.to_owned();
    for (name, value) in variables {
        out = out
            .replace(&format!("${{{name}}}"), value)
            .replace(&format!("[[{name}]]"), value)
            .replace(&format!("${name}"), value);
    }
    assert!(
        !out.contains('$') && !out.contains("[["),
        "a Grafana variable this test does not know: {expr}"
    );
    out
}

/// Runs every panel query; each must succeed with data, and only numbers (no NaN: a
/// quantile of a histogram with nothing in the window draws nothing). Returns the
/// answers by (title, expr).
async fn every_panel_has_data(
    prometheus: SocketAddr,
    vars: Vars<'_>,
    phase: &str,
) -> Vec<((String, String), Vec<Sample>)> {
    let mut answers = Vec::new();
    let mut empty = Vec::new();
    for (title, expr) in panel_queries() {
        let samples = query(prometheus, &substitute(&expr, vars)).await;
        if samples.is_empty() || samples.iter().any(|s| !s.value.is_finite()) {
            empty.push(format!("{title}: {expr} → {samples:?}"));
        }
        answers.push(((title, expr), samples));
    }
    assert!(
        empty.is_empty(),
        "{phase}: panel queries with no data (or not a number):\n{}",
        empty.join("\n")
    );
    answers
}

/// The answer of the panel titled `title` whose expr contains `part`.
fn panel<'a>(
    answers: &'a [((String, String), Vec<Sample>)],
    title: &str,
    part: &str,
) -> &'a [Sample] {
    answers
        .iter()
        .find(|((t, e), _)| t == title && e.contains(part))
        .map(|(_, samples)| samples.as_slice())
        .unwrap_or_else(|| panic!("no panel {title:?} with {part:?}"))
}

/// The query of the panel titled `title` whose expr contains `part`, run with `vars`.
async fn panel_query(
    prometheus: SocketAddr,
    title: &str,
    part: &str,
    vars: Vars<'_>,
) -> Vec<Sample> {
    panel_query_at(prometheus, title, part, vars, None).await
}

/// [`panel_query`] at `at` (Unix seconds), or now.
async fn panel_query_at(
    prometheus: SocketAddr,
    title: &str,
    part: &str,
    vars: Vars<'_>,
    at: Option<f64>,
) -> Vec<Sample> {
    let (_, expr) = panel_queries()
        .into_iter()
        .find(|(t, e)| t == title && e.contains(part))
        .unwrap_or_else(|| panic!("no panel {title:?} with {part:?}"));
    query_at(prometheus, &substitute(&expr, vars), at).await
}

/// The values the dashboard's variable `name` offers with `vars` set (those it depends
/// on), as Grafana asks Prometheus for them: `label_values(selector, label)` through the
/// label values API.
async fn variable_values(prometheus: SocketAddr, name: &str, vars: Vars<'_>) -> Vec<String> {
    let text = std::fs::read_to_string(file(DASHBOARD)).unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    let variable = dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no variable {name}"));
    let definition = variable["query"].as_str().expect("a query");
    let (selector, label) = definition
        .strip_prefix("label_values(")
        .and_then(|d| d.strip_suffix(')'))
        .and_then(|d| d.rsplit_once(", "))
        .unwrap_or_else(|| panic!("{name}: {definition} is not label_values(selector, label)"));
    let target = format!(
        "/api/v1/label/{label}/values?match[]={}",
        url_encode(&substitute(selector, vars))
    );
    let body = http_get(prometheus, &target).await.unwrap().body;
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["status"], "success", "{target}: {body}");
    let mut values: Vec<String> = answer["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    values.sort();
    values
}

/// A sample's labels as `name=value` pairs, sorted, and its value.
fn labelled(samples: &[Sample]) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = samples
        .iter()
        .map(|s| {
            let labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            (labels.join(","), s.value)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The origin: answers `GET /items/{id}` with its call number, and counts calls.
async fn origin(calls: Arc<AtomicU64>) -> SocketAddr {
    let app = Router::new().route(
        "/{*path}",
        get(move |UrlPath(path): UrlPath<String>| {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            async move { format!("{path} v{n}") }
        }),
    );
    support::http::serve(app).await
}

/// What the fault phase does to [`JOB`]'s Redis, as Prometheus sees it: its failed
/// acquires, its Redis timeouts, its breaker.
fn failed_acquires_expr() -> String {
    format!(
        "sum(stampede_guard_lease_acquisitions_total{{job=\"{JOB}\", result=~\"timed_out|unavailable\"}})"
    )
}

fn timeouts_expr() -> String {
    format!("sum(stampede_guard_redis_errors_total{{job=\"{JOB}\", kind=\"timeout\"}})")
}

fn open_expr() -> String {
    format!("max(stampede_guard_redis_circuit_open{{job=\"{JOB}\"}})")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_panel_has_data_and_shows_one_service_at_a_time_on_a_real_prometheus() {
    let started = Instant::now();
    let redis = RedisServer::start();
    let origin_calls = Arc::new(AtomicU64::new(0));
    let origin = origin(origin_calls.clone()).await;
    let (mut sidecar, proxy, metrics) = start_sidecar(origin, &redis.url(), "1s", "2s").await;
    // Another service on the same Prometheus, with the same route name: its own origin
    // and Redis, entries fresh for a minute (only misses and hits), leases for 3 s.
    let other_redis = RedisServer::start();
    let other_calls = Arc::new(AtomicU64::new(0));
    let other_origin = self::origin(other_calls.clone()).await;
    let (mut other, other_proxy, other_metrics) =
        start_sidecar(other_origin, &other_redis.url(), "60s", "3s").await;
    let (mut prometheus, prom) =
        start_prometheus(&[(JOB, metrics), (OTHER_JOB, other_metrics)]).await;
    // Scraped once before the load, so that the load's counts rise between scrapes.
    until_seen("a first scrape of both sidecars", || async {
        let up = query(prom, "sum by (job) (up) == 1").await;
        let series = query(prom, "count by (job) (stampede_guard_requests_total)").await;
        holds(up.len() == 2 && series.len() == 2, (up, series))
    })
    .await;
    eprintln!("processes up and scraped after {:?}", started.elapsed());
    let (instance, other_instance) = (metrics.to_string(), other_metrics.to_string());
    let (mine, others) = (
        Vars::of(JOB, &instance),
        Vars::of(OTHER_JOB, &other_instance),
    );

    // The other service's load: three keys, each filled once, then hit four times.
    let mut other_seen: BTreeMap<String, u64> = BTreeMap::new();
    for key in 0..3 {
        for _ in 0..5 {
            let reply = http_get(other_proxy, &format!("/items/{key}"))
                .await
                .unwrap();
            assert_eq!(reply.status, 200, "{}", reply.body);
            *other_seen.entry(reply.x_cache).or_default() += 1;
        }
    }
    let other_expected = BTreeMap::from([("hit".to_owned(), 12), ("miss".to_owned(), 3)]);
    assert_eq!(other_seen, other_expected);
    assert_eq!(other_calls.load(Ordering::SeqCst), 3);

    // Healthy load: six keys, each filled cold, then hit, served stale once its second
    // of freshness is over and refreshed in the background, for five seconds.
    let mut seen: BTreeMap<String, u64> = BTreeMap::new();
    let load_until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < load_until {
        for key in 0..6 {
            let reply = http_get(proxy, &format!("/items/{key}")).await.unwrap();
            assert_eq!(reply.status, 200, "{}", reply.body);
            assert!(reply.body.starts_with(&format!("items/{key} v")));
            *seen.entry(reply.x_cache).or_default() += 1;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        seen.get("miss"),
        Some(&6),
        "one cold fill per key: {seen:?}"
    );
    assert!(seen.get("hit").is_some_and(|&n| n > 6), "{seen:?}");
    assert!(seen.get("stale").is_some_and(|&n| n >= 6), "{seen:?}");
    assert_eq!(seen.keys().len(), 3, "only miss, hit and stale: {seen:?}");

    // Prometheus has scraped every request, by outcome, and every origin call (refreshes
    // end in the background), with a scrape or two after.
    // Each service's, under its own job.
    until_seen("every request and origin call", || async {
        let counted = |job: &'static str| async move {
            let expr =
                format!("sum by (outcome) (stampede_guard_requests_total{{job=\"{job}\"}}) > 0");
            query(prom, &expr)
                .await
                .iter()
                .map(|s| (s.labels["outcome"].clone(), s.value as u64))
                .collect::<BTreeMap<String, u64>>()
        };
        let (counted, other_counted) = (counted(JOB).await, counted(OTHER_JOB).await);
        let calls = |job: &str| format!("sum(stampede_guard_origin_calls_total{{job=\"{job}\"}})");
        let (calls, other_calls) = (
            total(prom, &calls(JOB)).await,
            total(prom, &calls(OTHER_JOB)).await,
        );
        let origin = origin_calls.load(Ordering::SeqCst) as f64;
        holds(
            counted == seen
                && calls == Some(origin)
                && other_counted == other_expected
                && other_calls == Some(3.0),
            (counted, calls, origin, other_counted, other_calls),
        )
    })
    .await;
    // One call per cold fill, then refreshes: at most one per stale serve.
    let calls = origin_calls.load(Ordering::SeqCst);
    assert!(
        (6 + 1..=6 + seen["stale"]).contains(&calls),
        "{calls} origin calls, {seen:?}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let healthy = every_panel_has_data(prom, mine, "healthy load").await;
    let open = panel(&healthy, "Circuit breaker open", "circuit_open");
    assert_eq!(open.len(), 1, "{open:?}");
    assert_eq!(open[0].value, 0.0, "healthy: the breaker open");
    assert!(
        panel(&healthy, "Stale served", "stale").iter().any(|s| s
            .labels
            .get("route")
            .map(String::as_str)
            == Some(ROUTE)
            && s.value > 0.0),
        "healthy: no stale serves in the dashboard"
    );
    eprintln!("healthy panels checked after {:?}", started.elapsed());

    // The variables offer both services, each one's process, and their route.
    let all = Vars {
        job: ALL_VALUES,
        instance: ALL_VALUES,
        route: ALL_VALUES,
    };
    let mut jobs = vec![JOB.to_owned(), OTHER_JOB.to_owned()];
    jobs.sort();
    assert_eq!(variable_values(prom, "job", all).await, jobs);
    let only = |job| Vars { job, ..all };
    assert_eq!(
        variable_values(prom, "instance", only(JOB)).await,
        [instance.as_str()]
    );
    assert_eq!(
        variable_values(prom, "instance", only(OTHER_JOB)).await,
        [other_instance.as_str()]
    );
    assert_eq!(
        variable_values(prom, "route", only(OTHER_JOB)).await,
        [ROUTE]
    );

    // Set to one service, a panel shows that service's series only. The TTL of "Lease
    // hold duration vs TTL" is a gauge, exact: 2 s for one, 3 s for the other.
    let ttl = |vars| {
        panel_query(
            prom,
            "Lease hold duration vs TTL",
            "lease_ttl_seconds",
            vars,
        )
    };
    let ttl_of = |job: &str, value: f64| (format!("job={job},operation=fill,route={ROUTE}"), value);
    assert_eq!(labelled(&ttl(mine).await), [ttl_of(JOB, 2.0)]);
    assert_eq!(labelled(&ttl(others).await), [ttl_of(OTHER_JOB, 3.0)]);
    assert_eq!(
        labelled(&ttl(only(OTHER_JOB)).await),
        [ttl_of(OTHER_JOB, 3.0)]
    );
    let by_instance = Vars {
        instance: &other_instance,
        ..all
    };
    assert_eq!(labelled(&ttl(by_instance).await), [ttl_of(OTHER_JOB, 3.0)]);
    assert_eq!(
        labelled(&ttl(all).await),
        [ttl_of(JOB, 2.0), ttl_of(OTHER_JOB, 3.0)]
    );
    assert!(
        ttl(Vars {
            route: "none",
            ..all
        })
        .await
        .is_empty()
    );
    // Requests by outcome: the other service served no stale entry; this one did. The
    // other's hits outnumber its misses four to one, and so do their rates (two counters
    // scraped together, from zero: the same window and extrapolation). With both
    // services, the panel adds them (all three queries at one time, as a dashboard's:
    // two seconds ago, so that no scrape lands between them).
    let at = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        - 2.0;
    // Over 15 minutes rather than the dashboard's minute: on a loaded machine the other
    // service's requests may be more than a minute old by now.
    let outcomes = |vars| {
        let (_, expr) = panel_queries()
            .into_iter()
            .find(|(t, e)| t == "Requests by outcome" && e.contains("requests_total"))
            .expect("the requests-by-outcome panel");
        let expr = substitute(&expr, vars);
        assert!(expr.contains("[1m]"), "{expr}");
        async move { query_at(prom, &expr.replace("[1m]", "[15m]"), Some(at)).await }
    };
    let served = |samples: Vec<Sample>| -> BTreeMap<String, f64> {
        samples
            .into_iter()
            .filter(|s| s.value > 0.0)
            .map(|s| (s.labels["outcome"].clone(), s.value))
            .collect()
    };
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs());
    let theirs = served(outcomes(others).await);
    assert_eq!(
        theirs.keys().collect::<Vec<_>>(),
        ["hit", "miss"],
        "{theirs:?}"
    );
    assert!(close(theirs["hit"], 4.0 * theirs["miss"]), "{theirs:?}");
    let ours = served(outcomes(mine).await);
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        ["hit", "miss", "stale"],
        "{ours:?}"
    );
    let both = served(outcomes(all).await);
    assert_eq!(
        both.keys().collect::<Vec<_>>(),
        ours.keys().collect::<Vec<_>>()
    );
    for (outcome, rate) in &both {
        let parts = ours[outcome] + theirs.get(outcome).copied().unwrap_or_default();
        assert!(
            close(*rate, parts),
            "{outcome}: {both:?} {ours:?} {theirs:?}"
        );
    }

    // Faults, under load on new keys (each an L2 read, then a lease for its fill) and on
    // the stale ones (each a refresh). First Redis refuses the lease's SET (an ACL
    // change): reads still answer, acquires fail. Then it stops answering: reads time
    // out, the breaker opens. Resumed, it closes; paused again, more timeouts and the
    // breaker open again, so that the timeouts rise between scrapes (every error series
    // is there at zero from the store's first operation, so its first increase is a
    // rate too).
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut statuses = BTreeMap::<u16, u64>::new();
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                let target = if n % 2 == 0 {
                    format!("/cold/{n}")
                } else {
                    format!("/items/{}", n % 6)
                };
                let reply = http_get(proxy, &target).await.unwrap();
                *statuses.entry(reply.status).or_default() += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            statuses
        }
    });
    let _: () = redis.cmd(&["ACL", "SETUSER", "default", "-set"]).await;
    // Never failed before (no baseline): pending within seconds.
    until_seen("refused acquires, their alert pending", || async {
        let alerts = alerts(prom).await;
        let refused = total(prom, &failed_acquires_expr()).await;
        holds(
            refused > Some(0.0)
                && is_pending(&alerts, "StampedeGuardLeaseAcquireFailures", "warning"),
            (refused, alerts),
        )
    })
    .await;
    redis.pause();
    until_seen("Redis timeouts and the breaker open", || async {
        let timeouts = total(prom, &timeouts_expr()).await;
        let open = total(prom, &open_expr()).await;
        holds(timeouts > Some(0.0) && open == Some(1.0), (timeouts, open))
    })
    .await;
    redis.resume();
    until_seen("the breaker closed", || async {
        let open = total(prom, &open_expr()).await;
        holds(open == Some(0.0), open)
    })
    .await;
    let timeouts_before = total(prom, &timeouts_expr()).await.unwrap();
    redis.pause();
    until_seen(
        "more timeouts, the breaker open, its alert pending",
        || async {
            let alerts = alerts(prom).await;
            let timeouts = total(prom, &timeouts_expr()).await;
            let open = total(prom, &open_expr()).await;
            holds(
                timeouts > Some(timeouts_before)
                    && open == Some(1.0)
                    && is_pending(&alerts, "StampedeGuardCircuitOpen", "critical"),
                (timeouts, open, alerts),
            )
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let faults = every_panel_has_data(prom, mine, "Redis failing").await;
    // The other service's Redis never failed: its breaker, its errors, on its own.
    let breaker = |vars| panel_query(prom, "Circuit breaker open", "circuit_open", vars);
    assert_eq!(labelled(&breaker(others).await), [(String::new(), 0.0)]);
    assert_eq!(labelled(&breaker(mine).await), [(String::new(), 1.0)]);
    let errors = panel_query(prom, "Redis errors by kind", "redis_errors", others).await;
    assert!(
        !errors.is_empty() && errors.iter().all(|s| s.value == 0.0),
        "{errors:?}"
    );
    redis.resume();
    stop.store(true, Ordering::SeqCst);
    let statuses = support::joined(load, support::HANG, "the load").await;
    assert_eq!(
        statuses.keys().copied().collect::<Vec<_>>(),
        vec![200],
        "every request answered while Redis was failing: {statuses:?}"
    );

    // What the error panels show now, from what really happened.
    assert_eq!(
        panel(&faults, "Circuit breaker open", "circuit_open")[0].value,
        1.0
    );
    let timeouts = panel(&faults, "Redis timeouts", "timeout");
    assert!(
        timeouts
            .iter()
            .any(|s| s.labels.contains_key("operation") && s.value > 0.0),
        "Redis timeouts: {timeouts:?}"
    );
    let kinds = panel(&faults, "Redis errors by kind", "redis_errors");
    for kind in ["timeout", "circuit_open", "server"] {
        assert!(
            kinds
                .iter()
                .any(|s| s.labels.get("kind").map(String::as_str) == Some(kind) && s.value > 0.0),
            "Redis errors by kind: no {kind}: {kinds:?}"
        );
    }
    let failure_rate = panel(&faults, "Lease acquisition failure rate", "timed_out");
    assert!(
        failure_rate[0].value > 0.0 && failure_rate[0].value <= 1.0,
        "Lease acquisition failure rate: {failure_rate:?}"
    );
    let acquisitions = panel(&faults, "Lease acquisition rate", "acquisitions");
    for result in ["acquired", "unavailable"] {
        assert!(
            acquisitions.iter().any(
                |s| s.labels.get("result").map(String::as_str) == Some(result) && s.value > 0.0
            ),
            "Lease acquisition rate: no {result}: {acquisitions:?}"
        );
    }

    // Every rule of the shipped file loaded and evaluated on these series without error.
    let rules = http_get(prom, "/api/v1/rules").await.unwrap().body;
    let rules: Value = serde_json::from_str(&rules).unwrap();
    let mut evaluated = BTreeSet::new();
    for group in rules["data"]["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let name = rule["name"].as_str().unwrap();
            assert_eq!(rule["health"], "ok", "{name}: {rule}");
            evaluated.insert(name.to_owned());
        }
    }
    assert_eq!(evaluated, alert_names());

    assert!(
        sidecar.exited().is_none(),
        "the sidecar died:\n{}",
        sidecar.log()
    );
    assert!(
        other.exited().is_none(),
        "the other sidecar died:\n{}",
        other.log()
    );
    assert!(
        prometheus.exited().is_none(),
        "prometheus died:\n{}",
        prometheus.log()
    );
    eprintln!("done after {:?}", started.elapsed());
}
