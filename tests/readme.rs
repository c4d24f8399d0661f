//! The commands of the README and of every guide (`docs/*.md`), run as they show them,
//! so that they cannot drift: every shell command in them (in a `sh` block, or quoted
//! in prose) is either run here and does what the text says, on the test's own ports,
//! files and servers, or listed in [`NOT_RUN`] by its exact text with why. A command
//! that is neither fails `every_readme_command_is_run_or_listed`, and so does a listed
//! one no text shows any more. The defaults the README's tables state are those of the
//! code and of `stampede-sidecar --help`, and the README stays a front door (at most
//! 300 lines).

mod support;

use std::collections::BTreeMap;
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
        "CACHE_KEY_SECRET=$(openssl rand -hex 32) cargo run --example quickstart",
        "the_quick_start_runs_as_written",
    ),
    (
        "curl -si http://127.0.0.1:3000/products/1",
        "the_quick_start_runs_as_written",
    ),
    (
        "openssl rand -hex 32 > secret",
        "the_sidecar_section_runs_as_written",
    ),
    (
        "export STAMPEDE_SIDECAR_ADMIN_TOKEN=$(openssl rand -hex 16)",
        "the_sidecar_section_runs_as_written",
    ),
    (
        "stampede-sidecar --listen 127.0.0.1:8080 --upstream http://127.0.0.1:9000 \
         --redis redis://127.0.0.1:6379 --secret-file secret --follow-origin false \
         --fresh 1s --grace 10s --metrics 127.0.0.1:9100 --admin 127.0.0.1:9101",
        "the_sidecar_section_runs_as_written",
    ),
    (
        "curl -X POST -H \"Authorization: Bearer $STAMPEDE_SIDECAR_ADMIN_TOKEN\" \
         -H \"Content-Type: application/json\" \
         -d '{\"tags\":[\"product-42\"],\"soft\":true}' http://127.0.0.1:9101/purge/tags",
        "the_sidecar_section_runs_as_written",
    ),
    (
        "stampede-sidecar --config sidecar.toml --check",
        "check_says_what_the_readme_quotes",
    ),
    (
        // Run as the example cargo built for the tests, on a Redis of the test's own.
        "cargo run --release --example values",
        "the_values_example_runs_as_written",
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
        "release builds of four binaries, minutes: its figures are in docs/redis.md",
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
        "cargo install --locked --path . --features sidecar",
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

fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap()
}

/// The README and every guide, one after the other (in the guides' order by name).
fn docs() -> String {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/docs");
    let mut guides: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "md"))
        .collect();
    guides.sort();
    let mut text = readme();
    for guide in guides {
        text.push_str("\n\n");
        text.push_str(&std::fs::read_to_string(guide).unwrap());
    }
    text
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
    let shown = commands(&docs());
    for command in &mine {
        assert!(
            shown.iter().any(|c| c == command),
            "not in the README or a guide: {command}"
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
    let found = commands(&docs());
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
            wrong.push(format!("no longer in the README or a guide: {command}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The README's sidecar quick start, in order: the secret made with `openssl`, the admin
/// token exported, the sidecar started with the README's flags (on the test's Redis,
/// origin and ports), caching an origin that sends no Cache-Control (the second request
/// a hit); `/metrics`, `/healthz` and `/readyz` answering as the sidecar guide says; the
/// purge `curl`, with the exported token, answering what the README and the guide
/// quote, and its entry served stale, then refreshed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_section_runs_as_written() {
    let [openssl, export, sidecar, purge] = run_by("the_sidecar_section_runs_as_written");
    let readme = docs();
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
    // The token as the export makes it: what the sidecar and the purge are given.
    let out = finished(shell(
        &format!("{export} && printf %s \"$STAMPEDE_SIDECAR_ADMIN_TOKEN\""),
        dir.path(),
    ));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let token = text(&out.stdout);
    assert_eq!(token.len(), 32, "{token:?}");
    // No STAMPEDE_GUARD_SECRET: with Redis, the sidecar starts only on the secret file.
    let mut started = shell(&format!("exec {command}"), dir.path());
    started.env("STAMPEDE_SIDECAR_ADMIN_TOKEN", &token);
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
    curl.env("STAMPEDE_SIDECAR_ADMIN_TOKEN", &token);
    let out = finished(curl);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let answered: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for quote in ["It answers how many tags (", "and answers how many tags ("] {
        let said: serde_json::Value = serde_json::from_str(&quoted_after(&readme, quote)).unwrap();
        assert_eq!(answered, said, "{quote}");
    }
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
    let readme = docs();
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

/// The rows of the tables in `text` whose first cell names flags (`` `--a`, `--b` ``):
/// each flag named, and what the second cell says of its default (`—`: none).
fn table_defaults(text: &str) -> Vec<(String, Option<String>)> {
    let mut rows = Vec::new();
    for row in text.lines().filter(|l| l.starts_with("| `--")) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let default = (cells[2] != "—").then(|| cells[2].to_owned());
        for flag in spans(cells[1]) {
            rows.push((flag, default.clone()));
        }
    }
    rows
}

/// `--help` runs as the guide shows it (the built binary for `cargo run … --`); every
/// flag it lists is a row of the README's table of flags, and every default a table
/// states (the README's, the sidecar guide's limits) is the one `--help` gives, and
/// stated for each flag that has one.
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

    let mut wrong = Vec::new();
    let readme = table_defaults(&readme());
    for flag in help
        .keys()
        .filter(|f| !["--help", "--version"].contains(&f.as_str()))
    {
        if !readme.iter().any(|(named, _)| named == flag) {
            wrong.push(format!("{flag} is not a row of the README's table"));
        }
    }
    let stated = table_defaults(&docs());
    for (flag, said) in &stated {
        match (help.get(flag), said) {
            (None, _) => wrong.push(format!("a table names {flag}, which --help does not")),
            (Some(Some(default)), None) => {
                wrong.push(format!("a table states no default of {flag} ({default})"));
            }
            (Some(None), Some(said)) => {
                wrong.push(format!(
                    "a table says {flag} defaults to {said}; --help, nothing"
                ));
            }
            (Some(Some(default)), Some(said)) if default != said => {
                wrong.push(format!("{flag}: a table says {said:?}, --help {default:?}"));
            }
            _ => {}
        }
    }
    assert!(stated.len() >= 40, "{stated:?}");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The first code span of a table cell, with what follows it (a gloss) left out.
fn first_span(cell: &str) -> Option<String> {
    spans(cell).into_iter().next()
}

/// The rows of the README's tables whose first cell names settings (`` `a`, `b` ``),
/// by each name: the default's first code span.
fn settings_table(readme: &str) -> BTreeMap<String, Option<String>> {
    let mut rows = BTreeMap::new();
    for row in readme
        .lines()
        .filter(|l| l.starts_with("| `") && !l.starts_with("| `--"))
    {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        for name in spans(cells[1]) {
            rows.insert(name, first_span(cells[2]));
        }
    }
    rows
}

/// `Debug` of a struct on one line, as `field: value` pairs (values may hold commas
/// inside brackets).
fn debug_fields(debug: &str) -> BTreeMap<String, String> {
    let inner = &debug[debug.find('{').unwrap() + 1..debug.rfind('}').unwrap()];
    let (mut fields, mut depth, mut current) = (BTreeMap::new(), 0, String::new());
    for c in inner.chars().chain([',']) {
        match c {
            '[' | '{' | '(' => depth += 1,
            ']' | '}' | ')' => depth -= 1,
            ',' if depth == 0 => {
                if let Some((name, value)) = current.split_once(": ") {
                    fields.insert(name.trim().to_owned(), value.trim().to_owned());
                }
                current.clear();
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    fields
}

/// The README's tables of the library's settings state the code's defaults: each field
/// of a default `Policy` is a row, whose default is the field's value; each of
/// `PolicyBuilder`'s settings is named by a row; the guard's and the store's defaults
/// are their constants'.
#[test]
fn the_readme_states_the_librarys_defaults() {
    use stampede_guard::guard::{
        DEFAULT_FILL_MEMORY, DEFAULT_L1_CAPACITY, DEFAULT_L1_MAX_VARIANTS, DEFAULT_PURGE_CAPACITY,
        DEFAULT_REFRESH_BUDGET,
    };
    use stampede_guard::store::{
        BreakerConfig, DEFAULT_COMMAND_TIMEOUT, DEFAULT_CONNECT_TIMEOUT, DEFAULT_POOL_SIZE,
    };
    let table = settings_table(&readme());
    let mut wrong = Vec::new();
    let policy = stampede_guard::Policy::builder("x").build().unwrap();
    let fields = debug_fields(&format!("{policy:?}"));
    assert!(fields.len() > 30, "{fields:?}");
    // (`cache` is what `never_cache` turns off: a row of its own, with no default.)
    for (field, value) in fields
        .iter()
        .filter(|(f, _)| !["route", "cache"].contains(&f.as_str()))
    {
        match table.get(field) {
            None => wrong.push(format!("{field} is not a row")),
            Some(said) if said.as_deref() != Some(value.as_str()) => {
                wrong.push(format!(
                    "{field}: the README says {said:?}, the code `{value}`"
                ));
            }
            Some(_) => {}
        }
    }
    let source =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/policy.rs")).unwrap();
    let builder = &source[source.find("impl PolicyBuilder {").unwrap()..];
    for setting in builder
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub fn "))
        .map(|l| l.split(['(', '<']).next().unwrap())
        .filter(|name| *name != "build")
    {
        if !table.contains_key(setting) {
            wrong.push(format!("PolicyBuilder::{setting} is not a row"));
        }
    }
    for (setting, value) in [
        ("l1_capacity", format!("{DEFAULT_L1_CAPACITY:?}")),
        ("l1_max_variants", format!("{DEFAULT_L1_MAX_VARIANTS:?}")),
        ("refresh_budget", format!("{DEFAULT_REFRESH_BUDGET:?}")),
        ("fill_memory", format!("{DEFAULT_FILL_MEMORY:?}")),
        ("purge_capacity", format!("{DEFAULT_PURGE_CAPACITY:?}")),
        ("command_timeout", format!("{DEFAULT_COMMAND_TIMEOUT:?}")),
        ("connect_timeout", format!("{DEFAULT_CONNECT_TIMEOUT:?}")),
        ("pool_size", format!("{DEFAULT_POOL_SIZE:?}")),
        ("breaker", format!("{:?}", BreakerConfig::default())),
    ] {
        let said = table.get(setting).cloned().flatten();
        if said.as_deref() != Some(value.as_str()) {
            wrong.push(format!(
                "{setting}: the README says {said:?}, the code `{value}`"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The README is a front door: at most 300 lines, and each guide it links to is there.
#[test]
fn the_readme_is_short_and_its_guides_are_there() {
    let readme = readme();
    let lines = readme.lines().count();
    assert!(lines <= 300, "the README has {lines} lines");
    let linked: Vec<&str> = readme
        .split("](docs/")
        .skip(1)
        .map(|rest| rest.split(')').next().unwrap())
        .collect();
    assert!(linked.len() >= 8, "{linked:?}");
    for guide in linked {
        let path = format!("{}/docs/{guide}", env!("CARGO_MANIFEST_DIR"));
        assert!(
            Path::new(&path).exists(),
            "the README links to docs/{guide}"
        );
    }
}

/// The typed values' example, as the README runs it (built by `cargo test`, on a Redis
/// of the test's own): every phase without an error, and its last line the fetches the
/// README promises: one for 200 cold callers over two instances, one refresh for the
/// fleet, one after an invalidation, one per instance with Redis unreachable.
#[tokio::test]
async fn the_values_example_runs_as_written() {
    let [run] = run_by("the_values_example_runs_as_written");
    assert_eq!(run, "cargo run --release --example values");
    let built = Path::new(BIN).parent().unwrap().join("examples/values");
    assert!(built.exists(), "{} is built", built.display());
    let redis = RedisServer::start();
    let out = tokio::process::Command::new(&built)
        .env_clear()
        .env("REDIS_URL", redis.url())
        .output();
    let out = support::within(HANG * 2, out, "the values example")
        .await
        .unwrap();
    let said = text(&out.stdout);
    assert!(out.status.success(), "{said}{}", text(&out.stderr));
    assert_eq!(
        said.lines().last(),
        Some("fetches: cold=1 stale=1 invalidated=1 redis-down=2"),
        "{said}"
    );
    for phase in ["cold", "stale", "invalidated", "redis-down"] {
        let row = said
            .lines()
            .find(|l| l.starts_with(phase) && !l.starts_with("fetches"))
            .unwrap_or_else(|| panic!("no row for {phase}: {said}"));
        let errors: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(errors[2], "0", "{phase}: errors in {row}");
    }
}

/// A process killed when dropped.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The README's axum quick start is `examples/quickstart.rs` as it stands, and runs as
/// the README says: on the test's Redis and port, with a secret made by `openssl`, its
/// first `curl` a miss that took the slow origin's time and the next a hit, and twenty
/// callers at once of a cold product served by one fill (all answered, none waiting for
/// twenty origin calls in a row); a second instance on another port with the same
/// secret is served what the first filled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quick_start_runs_as_written() {
    let [run, curl] = run_by("the_quick_start_runs_as_written");
    let example = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/examples/quickstart.rs"
    ))
    .unwrap();
    assert!(
        readme().contains(&format!("```rust,no_run\n{example}```")),
        "the README shows examples/quickstart.rs as it is"
    );
    // The example as `cargo test` built it, beside the sidecar's binary.
    let built = Path::new(BIN).parent().unwrap().join("examples/quickstart");
    assert!(built.exists(), "{} is built", built.display());
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    // Two instances share with one secret, as the README says: one `openssl` made.
    let secret = finished(shell("openssl rand -hex 32", dir.path()));
    let secret = text(&secret.stdout).trim().to_owned();
    assert_eq!(secret.len(), 64, "{secret:?}");
    let command = swapped(
        run,
        &[
            ("$(openssl rand -hex 32)", &secret),
            ("cargo run --example quickstart", built.to_str().unwrap()),
        ],
    );
    let start = |port: u16| {
        // (bash runs a lone command in its own place, as `exec` would.)
        let mut started = shell(&command, dir.path());
        started
            .env("REDIS_URL", redis.url())
            .env("LISTEN", format!("127.0.0.1:{port}"))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = started.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
        let line = lines.next().unwrap().unwrap();
        assert_eq!(line, format!("listening on http://127.0.0.1:{port}"));
        Running(child)
    };
    let (first, second) = (free_port(), free_port());
    let _a = start(first);
    let at = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    let curl = swapped(curl, &[("127.0.0.1:3000", &at(first).to_string())]);
    let began = Instant::now();
    let out = finished(shell(&curl, dir.path()));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(
        said.contains("x-cache: miss") && said.ends_with("product 1\n"),
        "{said}"
    );
    assert!(
        began.elapsed() >= Duration::from_millis(500),
        "the origin took its time"
    );
    let out = finished(shell(&curl, dir.path()));
    assert!(
        text(&out.stdout).contains("x-cache: hit"),
        "{}",
        text(&out.stdout)
    );

    let began = Instant::now();
    let crowd: Vec<_> = (0..20)
        .map(|_| tokio::spawn(async move { fetch(at(first), "/products/2", &[]).await }))
        .collect();
    for caller in crowd {
        let got = support::joined(caller, HANG, "a caller").await;
        assert_eq!(
            (got.status, got.body.as_str()),
            (StatusCode::OK, "product 2\n")
        );
    }
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "one fill, not twenty in a row"
    );

    let _b = start(second);
    let other = fetch(at(second), "/products/2", &[]).await;
    // From the entry the first filled, not from the origin (`miss`): a hit, or, when
    // the second instance's notice subscription came up between its read of Redis and
    // its answer (its first request starts it), stale: an entry it got before it
    // listened may have missed an invalidation, and is refreshed in the background.
    assert!(
        matches!(other.x_cache(), "hit" | "stale"),
        "the second instance shares what the first filled: {}",
        other.x_cache()
    );
    assert_eq!(other.body, "product 2\n");
}
