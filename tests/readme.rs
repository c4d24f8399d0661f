//! The README's commands, run as it shows them, so that it cannot drift: every shell
//! command in it (in a `sh` block, or quoted in its prose) is either run here and does
//! what the README says, on the test's own ports, files and servers, or listed in
//! [`NOT_RUN`] by its exact text with why. A command that is neither fails
//! `every_readme_command_is_run_or_listed`, and so does a listed one the README no longer
//! shows. The defaults the README states are those of `stampede-sidecar --help`.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use http::{StatusCode, Uri};
use support::http::{fetch, serve};
use support::server::free_port;
use support::sidecar::{BIN, SECRET, Sidecar, text, wait_output};
use support::{HANG, RedisServer, eventually};

/// The commands run here: the README's text (continuation lines joined, a trailing
/// comment left out), and the test that runs it.
const RUN: &[(&str, &str)] = &[
    (
        // Run as the binary cargo built for the tests, with the same arguments.
        "cargo run --release --features sidecar --bin stampede-sidecar -- --help",
        "help_runs_and_the_readme_states_its_defaults",
    ),
    (
        "openssl rand -hex 32 > secret",
        "the_sidecar_section_runs_as_written",
    ),
    (
        "stampede-sidecar --listen 127.0.0.1:8080 --upstream http://127.0.0.1:9000 \
         --redis redis://127.0.0.1:6379 --secret-file secret --follow-origin false \
         --fresh 1s --grace 10s --metrics 127.0.0.1:9100 --admin 127.0.0.1:9101",
        "the_sidecar_section_runs_as_written",
    ),
    (
        "curl -X POST -H \"Authorization: Bearer $TOKEN\" -H \"Content-Type: application/json\" \
         -d '{\"tags\":[\"product-42\"],\"soft\":true}' http://127.0.0.1:9101/purge/tags",
        "the_sidecar_section_runs_as_written",
    ),
    (
        "stampede-sidecar --config sidecar.toml --check",
        "check_says_what_the_readme_quotes",
    ),
];

/// The commands not run here, and why.
const NOT_RUN: &[(&str, &str)] = &[
    (
        "cargo run --release --example demo",
        "the demo: a release build, then 20 s of load on a Redis of its own",
    ),
    (
        "cargo run --release --example demo -- --chart stampede.svg",
        "the demo, drawing its chart",
    ),
    (
        "apt-get install redis-server",
        "installs a package (scripts/test does, as root)",
    ),
    ("brew install redis", "installs a package, on macOS"),
    ("scripts/test", "the whole suite, which runs this file"),
    (
        "cargo test --locked --all-features",
        "what scripts/test runs: the whole suite",
    ),
    (
        "cargo test",
        "names the command scripts/test passes its arguments to",
    ),
    ("scripts/test --test lease", "the suite, for one file"),
    (
        "redis-cli --cluster create",
        "what tests/support/cluster.rs runs to form a cluster, not a command to type",
    ),
    (
        "apt-get install redis-server redis-tools openssl curl postgresql prometheus \
         util-linux",
        "installs packages (scripts/test does, as root)",
    ),
    (
        "curl -i",
        "a fragment: the header it would show is asserted by the tests of Cache-Status",
    ),
    (
        "cargo run --example axum",
        "an example, on Redis at 127.0.0.1:6379 (which tests never use) and port 3000; \
         cargo builds it, but gives no test its path",
    ),
    (
        "curl -si localhost:3000/items/1",
        "a request to the axum example, which is not run",
    ),
    ("apt-get install prometheus", "installs a package"),
    (
        "cargo test --all-features --test prometheus",
        "tests/prometheus.rs, a part of the suite",
    ),
    (
        "cargo run --example inspect -- --env prod --service catalog",
        "an example, on Redis at 127.0.0.1:6379; the inspection it prints is \
         stampede_guard::inspect, tested in tests/inspect.rs",
    ),
    (
        "cargo run --example inspect -- --env prod --service catalog --delete-lease KEY",
        "an example, on Redis at 127.0.0.1:6379, deleting a lease it names",
    ),
    (
        "cargo run --example inspect -- --env prod --service catalog --delete-lease KEY --yes",
        "an example, on Redis at 127.0.0.1:6379, deleting a lease it names",
    ),
    (
        "cargo run --example inspect -- --metrics http://10.0.0.1:9100/metrics \
         --metrics http://10.0.0.2:9100/metrics",
        "an example, reading the /metrics of instances at addresses of the README's",
    ),
    ("cargo doc --open", "opens a browser"),
    (
        "cargo run --example fenced_update --features postgres",
        "an example, on Redis at 127.0.0.1:6379 and PostgreSQL on 5432 (which tests never \
         use); tests/postgres.rs plays out the same pattern",
    ),
    (
        "cargo run --example scheduler --features postgres",
        "an example, on Redis at 127.0.0.1:6379 and PostgreSQL on 5432; tests/postgres.rs \
         runs the same job",
    ),
    ("cargo fuzz", "names the tool"),
    (
        "RUSTC_BOOTSTRAP=1 cargo fuzz run decode_entry fuzz/corpus/decode_entry \
         fuzz/seeds/decode_entry -- -max_total_time=60",
        "needs cargo-fuzz, and runs for a minute",
    ),
    (
        "cargo bench --bench lease",
        "a benchmark: its figures are in BENCHMARKS.md",
    ),
    (
        "cargo bench --bench l1_hit --features prometheus",
        "a benchmark: its figures are in BENCHMARKS.md",
    ),
    (
        "cargo bench --bench l1_hit_instructions",
        "a benchmark, under callgrind",
    ),
    (
        "cargo install gungraun-runner --version 0.20.0",
        "installs a program",
    ),
    (
        "cargo bench --bench paths",
        "a benchmark: its figures are in BENCHMARKS.md",
    ),
    (
        "cargo bench --bench variants",
        "a benchmark: its figures are in BENCHMARKS.md",
    ),
    (
        "cargo bench --bench moka_entry",
        "a benchmark (a million entries, four processes): its figures are in BENCHMARKS.md",
    ),
    (
        "cargo bench --bench fleet --features cluster",
        "a benchmark: its figures are in BENCHMARKS.md",
    ),
    (
        "cargo bench --bench fleet_scale --features sidecar",
        "a benchmark of minutes, up to 32 sidecar processes: its figures and the model \
         built on them are in BENCHMARKS.md",
    ),
    (
        "bash benches/size.sh",
        "release builds of four binaries, minutes: its figures are in the README",
    ),
    (
        "cargo test --no-default-features --lib --test single_flight --test fencing --test tls_auth",
        "what .ci/run runs after the suite, in a build of its own",
    ),
    (
        "bash benches/compare/run.sh",
        "installs nginx and wrk, and runs minutes of load",
    ),
    (
        "cargo install --path . --features sidecar",
        "installs the binary for the user; the tests run the one cargo built",
    ),
    (
        "bash benches/conformance.sh",
        "fetches the HTTP working group's suite and needs node and npm; its results are \
         benches/conformance/RESULTS.md",
    ),
];

/// Programs a command quoted in prose starts with.
const PROGRAMS: &[&str] = &[
    "apt-get",
    "bash",
    "brew",
    "cargo",
    "curl",
    "docker",
    "git",
    "kill",
    "openssl",
    "redis-cli",
    "redis-server",
    "scripts/test",
    "sh",
    "stampede-sidecar",
];

/// What the admin token is in the README's purge command (`$TOKEN`).
const TOKEN: &str = "a token of the tests";

fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap()
}

/// Runs of whitespace as one space.
fn squeezed(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `line` less a trailing comment (a `#` after a space, outside quotes), and the comment.
fn comment_split(line: &str) -> (&str, &str) {
    let mut quote = None;
    let mut previous = ' ';
    for (at, c) in line.char_indices() {
        match (quote, c) {
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), _) if q == c => quote = None,
            (None, '#') if previous.is_whitespace() => return (&line[..at], &line[at..]),
            _ => {}
        }
        previous = c;
    }
    (line, "")
}

/// The code spans of `text` (`` `…` ``), which may run over a line's end.
fn spans(text: &str) -> Vec<String> {
    text.split('`').skip(1).step_by(2).map(squeezed).collect()
}

/// Whether a code span quoted in prose is a command: a program of [`PROGRAMS`] with
/// arguments, after any `NAME=value` of the environment.
fn is_command(span: &str) -> bool {
    let words: Vec<&str> = span
        .split(' ')
        .skip_while(|w| w.contains('=') && !w.starts_with('-'))
        .collect();
    words.len() > 1 && PROGRAMS.contains(&words[0])
}

/// Every command the README shows: the lines of its shell blocks (continuations joined,
/// comments left out, `$ ` prompts too), and the commands quoted in its prose or in a
/// block's comments.
fn commands(readme: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut fence: Option<String> = None;
    let mut paragraph = String::new();
    let mut pending = String::new();
    fn prose(paragraph: &mut String, found: &mut Vec<String>) {
        found.extend(spans(paragraph).into_iter().filter(|s| is_command(s)));
        paragraph.clear();
    }
    for line in readme.lines() {
        if let Some(info) = line.strip_prefix("```") {
            match fence {
                None => {
                    prose(&mut paragraph, &mut found);
                    fence = Some(info.trim().to_owned());
                }
                Some(_) => fence = None,
            }
            continue;
        }
        match fence.as_deref() {
            None if line.trim().is_empty() => prose(&mut paragraph, &mut found),
            None => {
                paragraph.push_str(line);
                paragraph.push('\n');
            }
            Some("sh" | "bash" | "shell" | "console") => {
                let line = line.trim_start();
                let line = line.strip_prefix("$ ").unwrap_or(line);
                let (code, comment) = comment_split(line);
                found.extend(spans(comment).into_iter().filter(|s| is_command(s)));
                let code = code.trim_end();
                match code.strip_suffix('\\') {
                    Some(part) => {
                        pending.push_str(part);
                        pending.push(' ');
                    }
                    None => {
                        pending.push_str(code);
                        let command = squeezed(&pending);
                        if !command.is_empty() {
                            found.push(command);
                        }
                        pending.clear();
                    }
                }
            }
            Some(_) => {}
        }
    }
    prose(&mut paragraph, &mut found);
    found
}

/// The commands [`RUN`] gives `test`, in its order (the README's).
fn run_by<const N: usize>(test: &str) -> [&'static str; N] {
    let mine: Vec<&str> = RUN
        .iter()
        .filter(|(_, by)| *by == test)
        .map(|(command, _)| *command)
        .collect();
    let readme = commands(&readme());
    for command in &mine {
        assert!(
            readme.iter().any(|c| c == command),
            "not in the README: {command}"
        );
    }
    mine.try_into()
        .unwrap_or_else(|mine: Vec<&str>| panic!("{test} runs {} commands: {mine:?}", mine.len()))
}

/// `command` with each `(from, to)` swapped; each `from` must be in it exactly once, so
/// that a README that changes them fails here rather than running something else.
fn swapped(command: &str, swaps: &[(&str, &str)]) -> String {
    let mut command = command.to_owned();
    for (from, to) in swaps {
        assert_eq!(
            command.matches(from).count(),
            1,
            "`{from}` once in: {command}"
        );
        command = command.replacen(from, to, 1);
    }
    command
}

/// `command` as bash runs it in `dir`, with the built `stampede-sidecar` first on `PATH`
/// and nothing else of the tests' environment.
fn shell(command: &str, dir: &Path) -> Command {
    let bin = Path::new(BIN).parent().unwrap();
    let path = std::env::var("PATH").unwrap_or_default();
    let mut shell = Command::new("bash");
    shell
        .args(["-c", command])
        .current_dir(dir)
        .env_clear()
        .env("PATH", format!("{}:{path}", bin.display()));
    shell
}

/// Runs `command` to its end.
fn finished(mut command: Command) -> Output {
    let child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("bash starts");
    wait_output(child)
}

/// The code span that follows `before` in the README (what it quotes there), whatever
/// the lines' ends.
fn quoted_after(readme: &str, before: &str) -> String {
    let readme = squeezed(readme);
    let at = readme
        .find(before)
        .unwrap_or_else(|| panic!("the README no longer says {before:?}"));
    spans(&readme[at + before.len()..])
        .into_iter()
        .next()
        .unwrap()
}

#[test]
fn every_readme_command_is_run_or_listed() {
    let found = commands(&readme());
    let mut wrong = Vec::new();
    for command in &found {
        let run = RUN.iter().any(|(c, _)| c == command);
        let listed = NOT_RUN.iter().any(|(c, _)| c == command);
        match (run, listed) {
            (false, false) => wrong.push(format!("neither run nor listed: {command}")),
            (true, true) => wrong.push(format!("both run and listed: {command}")),
            _ => {}
        }
    }
    for (command, _) in RUN.iter().chain(NOT_RUN) {
        if !found.iter().any(|c| c == command) {
            wrong.push(format!("no longer in the README: {command}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The README's sidecar section, in order: the secret made with `openssl`, the sidecar
/// started with the README's flags (on the test's Redis, origin and ports), caching an
/// origin that sends no Cache-Control (the second request a hit); `/metrics`,
/// `/healthz` and `/readyz` answering as the README says; the purge `curl` answering
/// what the README quotes, and its entry served stale, then refreshed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_section_runs_as_written() {
    let [openssl, sidecar, purge] = run_by("the_sidecar_section_runs_as_written");
    let readme = readme();
    let dir = tempfile::tempdir().unwrap();

    let out = finished(shell(openssl, dir.path()));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let secret = std::fs::read_to_string(dir.path().join("secret")).unwrap();
    assert!(
        secret.len() == 65 && secret.trim_end().bytes().all(|b| b.is_ascii_hexdigit()),
        "{secret:?}"
    );

    // The origin sends no Cache-Control (nor Expires, nor a validator), and tags its
    // answers as the purge command names them.
    let calls = Arc::new(AtomicU64::new(0));
    let origin = serve(Router::new().fallback({
        let calls = calls.clone();
        move |uri: Uri| {
            let calls = calls.clone();
            async move {
                let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                (
                    [("surrogate-key", "product-42")],
                    format!("{} call {n}", uri.path()),
                )
            }
        }
    }))
    .await;
    let redis = RedisServer::start();
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let command = swapped(
        sidecar,
        &[
            ("127.0.0.1:8080", "127.0.0.1:0"),
            ("127.0.0.1:9100", &metrics.to_string()),
            ("127.0.0.1:9101", "127.0.0.1:0"),
            ("http://127.0.0.1:9000", &format!("http://{origin}")),
            ("redis://127.0.0.1:6379", &redis.url()),
        ],
    );
    // No STAMPEDE_GUARD_SECRET: with Redis, the sidecar starts only on the secret file.
    let mut started = shell(&format!("exec {command}"), dir.path());
    started.env("STAMPEDE_SIDECAR_ADMIN_TOKEN", TOKEN);
    let sidecar = Sidecar::spawn(started);

    let began = Instant::now();
    let first = fetch(sidecar.listen, "/items/1", &[]).await;
    assert_eq!((first.status, first.x_cache()), (StatusCode::OK, "miss"));
    assert_eq!(first.body, "/items/1 call 1");
    let second = fetch(sidecar.listen, "/items/1", &[]).await;
    assert_eq!(second.body, "/items/1 call 1");
    if began.elapsed() < Duration::from_millis(900) {
        // Within `--fresh 1s` of the fill.
        assert_eq!(second.x_cache(), "hit");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    } else {
        // A machine slower than that: within `--grace 10s`, stale.
        assert!(["hit", "stale"].contains(&second.x_cache()));
    }

    let scraped = fetch(metrics, "/metrics", &[]).await;
    assert_eq!(scraped.status, StatusCode::OK);
    assert!(
        scraped.body.contains("stampede_guard_") && scraped.body.contains("route=\"default\""),
        "{}",
        scraped.body
    );

    let admin = sidecar.admin.expect("the admin listener");
    let said: serde_json::Value =
        serde_json::from_str(&quoted_after(&readme, "`GET /healthz` answers 200 with")).unwrap();
    let healthy = eventually(HANG, || async {
        let health = fetch(admin, "/healthz", &[]).await;
        let health: serde_json::Value = serde_json::from_str(&health.body).unwrap();
        let keys =
            |v: &serde_json::Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
        health.as_object().is_some()
            && keys(&health) == keys(&said)
            && ["draining", "notices", "redis", "status"]
                .iter()
                .all(|k| health[k] == said[k])
            // A count (moka's estimate, which it updates lazily).
            && health["l1_entries"].is_u64()
    })
    .await;
    assert!(healthy, "{}", fetch(admin, "/healthz", &[]).await.body);
    assert!(squeezed(&readme).contains("`GET /readyz` answers 200"));
    assert_eq!(fetch(admin, "/readyz", &[]).await.status, StatusCode::OK);

    let before = calls.load(Ordering::SeqCst);
    let mut curl = shell(
        &swapped(
            purge,
            &[("http://127.0.0.1:9101", &format!("http://{admin}"))],
        ),
        dir.path(),
    );
    curl.env("TOKEN", TOKEN);
    let out = finished(curl);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let answered: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let said: serde_json::Value =
        serde_json::from_str(&quoted_after(&readme, "and answers how many tags (")).unwrap();
    assert_eq!(answered, said);
    // Soft: stale, and refreshed.
    let after = fetch(sidecar.listen, "/items/1", &[]).await;
    if began.elapsed() < Duration::from_secs(10) {
        assert_eq!(after.x_cache(), "stale", "{}", after.body);
    }
    assert!(
        eventually(HANG, || async { calls.load(Ordering::SeqCst) > before }).await,
        "refreshed"
    );
}

/// `stampede-sidecar --config sidecar.toml --check` on the README's config (the fixture,
/// shown in the README as it is) says it is ok; with a Cluster, it says what the README
/// quotes; with a field the file may not have, exit 2 naming it.
#[test]
fn check_says_what_the_readme_quotes() {
    let [check] = run_by("check_says_what_the_readme_quotes");
    let readme = readme();
    let fixture = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/sidecar.toml"
    ))
    .unwrap();
    assert!(
        readme.contains(&format!("```toml\n{fixture}```")),
        "the README shows tests/fixtures/sidecar.toml as it is"
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("sidecar.toml"), &fixture).unwrap();
    let out = finished(shell(check, dir.path()));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        "settings ok: 3 route(s), the local cache only\n"
    );

    let quoted = quoted_after(&readme, "`--check` says which it would use");
    let quoted = quoted
        .strip_suffix("...")
        .expect("the README's quote ends in ...");
    let mut cluster = shell(
        &format!(
            "{check} --redis-cluster redis://10.0.0.1:7000 --redis-cluster redis://10.0.0.2:7000"
        ),
        dir.path(),
    );
    cluster.env("STAMPEDE_GUARD_SECRET", SECRET);
    let out = finished(cluster);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with(quoted),
        "{}",
        text(&out.stdout)
    );

    std::fs::write(
        dir.path().join("sidecar.toml"),
        format!("{fixture}\nfressh = \"1s\"\n"),
    )
    .unwrap();
    let out = finished(shell(check, dir.path()));
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("fressh"),
        "{}",
        text(&out.stderr)
    );
}

/// Of the help text: each flag and its `[default: …]`, less asides in parentheses.
fn help_defaults(help: &str) -> BTreeMap<String, Option<String>> {
    let mut flags = BTreeMap::new();
    let mut current: Option<(String, String)> = None;
    fn end(current: &mut Option<(String, String)>, flags: &mut BTreeMap<String, Option<String>>) {
        if let Some((flag, said)) = current.take() {
            let said = squeezed(&said);
            let default = said.find("[default: ").map(|at| {
                let rest = &said[at + "[default: ".len()..];
                let mut depth = 0;
                let mut kept = String::new();
                for c in rest.chars() {
                    match c {
                        '[' | '(' => depth += 1,
                        ']' if depth == 0 => break,
                        ']' | ')' => depth -= 1,
                        c if depth == 0 => kept.push(c),
                        _ => {}
                    }
                }
                squeezed(&kept).replace(" ,", ",")
            });
            flags.insert(flag, default);
        }
    }
    for line in help.lines() {
        let trimmed = line.trim_start();
        let flag = trimmed
            .split_whitespace()
            .find(|w| w.starts_with("--"))
            .filter(|_| trimmed.starts_with('-'))
            .map(|w| w.trim_end_matches(',').to_owned());
        match flag {
            Some(flag) => {
                end(&mut current, &mut flags);
                current = Some((flag, String::new()));
            }
            None => {
                if let Some((_, said)) = &mut current {
                    said.push(' ');
                    said.push_str(trimmed);
                }
            }
        }
    }
    end(&mut current, &mut flags);
    flags
}

/// What the README's **Flags.** paragraph and limits table say of each flag's default:
/// `(default X` or `; default X`, to the first `;`, `)` or `: `; the table's column.
fn readme_defaults(readme: &str) -> (BTreeSet<String>, BTreeMap<String, String>) {
    let at = readme.find("**Flags.**").expect("the Flags paragraph");
    let paragraph = squeezed(&readme[at..at + readme[at..].find("\n\n").unwrap()]);
    let mut named = BTreeSet::new();
    let mut stated = BTreeMap::new();
    let mentions: Vec<usize> = paragraph.match_indices("`--").map(|(at, _)| at).collect();
    for (i, &start) in mentions.iter().enumerate() {
        let end = mentions.get(i + 1).copied().unwrap_or(paragraph.len());
        let segment = &paragraph[start + 1..end];
        let flag: String = segment
            .chars()
            .take_while(|c| *c != ' ' && *c != '`')
            .collect();
        named.insert(flag.clone());
        let Some(at) = ["(default ", "; default "]
            .iter()
            .find_map(|m| segment.find(m).map(|at| at + m.len()))
        else {
            continue;
        };
        let rest = &segment[at..];
        let stop = [rest.find(';'), rest.find(')'), rest.find(": ")]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(rest.len());
        let default = rest[..stop].replace('`', "");
        if let Some(other) = stated.insert(flag.clone(), default.clone()) {
            assert_eq!(other, default, "the README states two defaults of {flag}");
        }
    }
    for row in readme.lines().filter(|l| l.starts_with("| `--")) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let flag = cells[1].trim_matches('`').to_owned();
        named.insert(flag.clone());
        stated.insert(flag, cells[2].to_owned());
    }
    (named, stated)
}

/// `--help` runs as the README shows it (the built binary for `cargo run … --`); every
/// flag it lists is in the README, and every default the README's Flags paragraph and
/// limits table state is the one `--help` gives, and stated for each flag they name
/// that has one.
#[test]
fn help_runs_and_the_readme_states_its_defaults() {
    let [help] = run_by("help_runs_and_the_readme_states_its_defaults");
    let help = swapped(
        help,
        &[(
            "cargo run --release --features sidecar --bin stampede-sidecar --",
            "stampede-sidecar",
        )],
    );
    let dir = tempfile::tempdir().unwrap();
    let out = finished(shell(&help, dir.path()));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let help = help_defaults(&text(&out.stdout));
    assert!(help.len() > 30, "{help:?}");

    let readme = readme();
    let mut wrong = Vec::new();
    for flag in help
        .keys()
        .filter(|f| !["--help", "--version"].contains(&f.as_str()))
    {
        if !readme.contains(&format!("`{flag}")) {
            wrong.push(format!("{flag} is not in the README"));
        }
    }
    let (named, stated) = readme_defaults(&readme);
    for flag in &named {
        match (help.get(flag), stated.get(flag)) {
            (None, _) => wrong.push(format!("the README names {flag}, which --help does not")),
            (Some(Some(default)), None) => {
                wrong.push(format!(
                    "the README states no default of {flag} ({default})"
                ));
            }
            (Some(None), Some(said)) => {
                wrong.push(format!(
                    "the README says {flag} defaults to {said}; --help, nothing"
                ));
            }
            (Some(Some(default)), Some(said)) if default != said => {
                wrong.push(format!(
                    "{flag}: the README says {said:?}, --help {default:?}"
                ));
            }
            _ => {}
        }
    }
    assert!(stated.len() >= 15, "{stated:?}");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
