//! The settings as the file and the flags give them, and their refusals.

use std::path::Path;

use clap::Parser;

use super::policy::ROUTE_SETTINGS;
use super::*;
use crate::args::redacted;

fn load(flags: &[&str], text: &str) -> Result<Settings, SettingError> {
    let mut argv = vec!["stampede-sidecar", "--config", "sidecar.toml"];
    argv.extend_from_slice(flags);
    let args = Args::try_parse_from(argv).unwrap();
    Settings::resolve(&args, file::parse(text, Path::new("sidecar.toml"))?)
}

#[test]
fn the_fixture_loads() {
    let text = include_str!("../../../../tests/fixtures/sidecar.toml");
    let settings = load(&[], text).unwrap();
    let prefixes: Vec<&str> = settings.routes.iter().map(|r| r.prefix.as_str()).collect();
    assert_eq!(prefixes, ["/items/featured", "/reports/", "/items/"]);
    assert_eq!(
        settings.routes[2].policy.fresh_ttl(),
        Duration::from_secs(5)
    );
    // Inherited from the top level.
    assert_eq!(settings.routes[2].policy.grace(), Duration::ZERO);
    assert!(settings.default.is_none());
}

#[test]
fn query_rules_are_a_routes_own() {
    let text = "listen = \"127.0.0.1:1\"\n\
                [[routes]]\nname = \"search\"\nprefix = \"/search\"\n\
                key_query = { drop = [\"utm_*\", \"fbclid\"] }\n\
                [[routes]]\nname = \"convert\"\nprefix = \"/convert\"\n";
    let s = load(&[], text).unwrap();
    let rule = |name: &str| {
        s.routes
            .iter()
            .find(|r| r.policy.route() == name)
            .unwrap()
            .policy
            .key_query()
            .clone()
    };
    assert_eq!(
        rule("search"),
        stampede_guard::KeyQuery::Drop(vec!["fbclid".into(), "utm_*".into()])
    );
    assert_eq!(rule("convert"), stampede_guard::KeyQuery::All);
}

#[test]
fn sizes_take_their_units_in_the_file_and_the_flag() {
    let text = "follow_origin = false\nmax_body = \"8MiB\"\nlisten = \"127.0.0.1:1\"\n\
                [[routes]]\nname = \"a\"\nprefix = \"/a\"\nmax_body = 512\n\
                [[routes]]\nname = \"b\"\nprefix = \"/b\"\n";
    let s = load(&[], text).unwrap();
    let max_body = |s: &Settings, name: &str| {
        s.routes
            .iter()
            .find(|r| r.policy.route() == name)
            .unwrap()
            .policy
            .max_body()
    };
    assert_eq!(s.default.as_ref().unwrap().max_body(), 8 << 20);
    assert_eq!(max_body(&s, "a"), 512);
    assert_eq!(max_body(&s, "b"), 8 << 20, "inherits the top level");
    let s = load(&["--max-body", "16MiB"], text).unwrap();
    assert_eq!(max_body(&s, "b"), 16 << 20, "inherits the flag");
    let refused = load(&[], "max_body = \"huge\"\n")
        .err()
        .unwrap()
        .to_string();
    assert!(
        refused.contains("max_body") && refused.contains("`huge` is not a size"),
        "{refused}"
    );
}

#[test]
fn flags_override_the_top_level() {
    let text = "follow_origin = false\nfresh = \"3s\"\nlisten = \"127.0.0.1:1\"\n[[routes]]\nname = \"a\"\nprefix = \"/a\"\n\
                [[routes]]\nname = \"b\"\nprefix = \"/b\"\nfresh = \"7s\"\n";
    let s = load(&["--fresh", "250ms", "--listen", "127.0.0.1:2"], text).unwrap();
    assert_eq!(s.listen, "127.0.0.1:2".parse().unwrap());
    assert_eq!(s.default.unwrap().fresh_ttl(), Duration::from_millis(250));
    let fresh = |name: &str| {
        s.routes
            .iter()
            .find(|r| r.policy.route() == name)
            .unwrap()
            .policy
            .fresh_ttl()
    };
    assert_eq!(fresh("a"), Duration::from_millis(250), "inherits the flag");
    assert_eq!(fresh("b"), Duration::from_secs(7), "its own value stands");
}

#[test]
fn errors_name_the_file_the_route_and_the_field() {
    let route = |body: &str| {
        format!("fresh = \"1s\"\n\n[[routes]]\nname = \"items\"\nprefix = \"/items/\"\n{body}\n")
    };
    for (body, field) in [
        ("fresh = \"1x\"", "`fresh`"),
        ("fresh = \"0s\"", "`fresh`"),
        ("grace = \"2 fortnights\"", "`grace`"),
        ("key_query = \"some\"", "`key_query`"),
        ("key_query = { drop = [\"*\"] }", "`key_query`"),
        ("key_query = { keep = [\"q\"] }", "key_query = {"),
        ("key_headers = [\"bad header\"]", "`key_headers`"),
        (
            "cold_miss = { reject = { retry_after = \"soon\" } }",
            "retry_after",
        ),
        ("prefix2 = \"/x\"", "prefix2"),
    ] {
        let error = load(&[], &route(body)).map(|_| ()).unwrap_err().to_string();
        assert!(error.contains("sidecar.toml"), "{body}: {error}");
        assert!(error.contains("\"items\""), "{body}: {error}");
        assert!(error.contains(field), "{body}: {error}");
    }
    let error = load(&[], "fressh = \"1s\"")
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(error.contains("fressh"), "{error}");
    let error = load(&[], "drain_timeout = \"x\"")
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(error.contains("`drain_timeout`"), "{error}");
    let twice =
        "[[routes]]\nname = \"a\"\nprefix = \"/a\"\n[[routes]]\nname = \"b\"\nprefix = \"/a\"\n";
    let error = load(&[], twice).map(|_| ()).unwrap_err().to_string();
    assert!(
        error.contains("`prefix`") && error.contains("\"b\""),
        "{error}"
    );
}

/// `fresh` where the origin is followed, `min_fresh` and `max_fresh` where it is
/// not, would do nothing: refused, naming where; read somewhere, accepted.
#[test]
fn fields_that_would_do_nothing_are_refused() {
    let refused = |flags: &[&str], text: &str| match load(flags, text) {
        Ok(_) => panic!("accepted: {flags:?} {text}"),
        Err(error) => error.to_string(),
    };
    let said = refused(&["--fresh", "1s"], "");
    assert!(said.starts_with("settings, field `fresh`"), "{said}");
    assert!(
        said.contains("--fresh") && said.contains("--follow-origin false"),
        "{said}"
    );
    let said = refused(&[], "fresh = \"1s\"\n");
    assert!(said.contains("sidecar.toml, field `fresh`"), "{said}");
    assert!(said.contains("follow_origin = false"), "{said}");
    let route = "[[routes]]\nname = \"items\"\nprefix = \"/items/\"\n";
    let said = refused(
        &["--follow-origin", "false"],
        &format!("default = \"pass\"\n{route}follow_origin = true\nfresh = \"5s\"\n"),
    );
    assert!(
        said.contains("route \"items\" (routes[0]), field `fresh`"),
        "{said}"
    );
    assert!(said.contains("on the route"), "{said}");
    for field in ["min_fresh", "max_fresh"] {
        let said = refused(
            &["--follow-origin", "false"],
            &format!("{field} = \"1s\"\n"),
        );
        assert!(said.contains(&format!("field `{field}`")), "{said}");
        let said = refused(
            &[],
            &format!("{route}follow_origin = false\n{field} = \"1s\"\n"),
        );
        assert!(
            said.contains("\"items\"") && said.contains(&format!("`{field}`")),
            "{said}"
        );
    }

    // Read by some policy: accepted.
    for (flags, text) in [
        (
            &["--follow-origin", "false", "--fresh", "1s"][..],
            String::new(),
        ),
        // The default follows, a route of its own reads the top level's `fresh`.
        (
            &["--fresh", "1s"][..],
            format!("{route}follow_origin = false\n"),
        ),
        // No policy takes the top level's `fresh` at all: not this check's business.
        (
            &[][..],
            format!(
                "default = \"pass\"\nfresh = \"1s\"\n{route}follow_origin = false\nfresh = \"2s\"\n"
            ),
        ),
        (
            &[][..],
            "min_fresh = \"1s\"\nmax_fresh = \"1h\"\n".to_owned(),
        ),
    ] {
        if let Err(error) = load(flags, &text) {
            panic!("{flags:?} {text}: {error}");
        }
    }
}

#[test]
fn passwords_stay_out() {
    assert_eq!(
        redacted("redis://user:secret@h:6379/0"),
        "redis://user:***@h:6379/0"
    );
    assert_eq!(redacted("redis://:secret@h"), "redis://:***@h");
    assert_eq!(redacted("rediss://secret@h"), "rediss://***@h");
    assert_eq!(redacted("redis://h:6379"), "redis://h:6379");
    let args = Args::try_parse_from(["s", "--redis", "redis://u:hunter2@h"]).unwrap();
    assert!(!format!("{args:?}").contains("hunter2"));
    let settings = Settings::resolve(&args, File::default()).unwrap();
    assert!(!format!("{settings:?}").contains("hunter2"));
}

#[test]
fn the_default_service_is_named_after_the_upstream() {
    let service = |uri: &str| service_of(&uri.parse().unwrap());
    assert_eq!(service("http://127.0.0.1:9000"), "127-0-0-1-9000");
    assert_eq!(service("http://Origin.example"), "origin-example-80");
    assert_ne!(
        service("http://a.example:80"),
        service("http://b.example:80")
    );
    let long = service(&format!("http://{}.example:8080", "x".repeat(80)));
    assert_eq!(long.len(), 48);
    // Every default is a service the key space takes.
    for uri in [
        "http://127.0.0.1:9000",
        "http://[::1]:8080",
        "http://Origin.example",
    ] {
        stampede_guard::KeySpace::builder()
            .env("sidecar")
            .service(service(uri))
            .secret("a test secret of sixteen bytes")
            .build()
            .unwrap();
    }
}

#[test]
fn limits_have_defaults_flags_and_refusals() {
    let settings = load(&[], "").unwrap();
    assert_eq!(settings.limits.header_read, Duration::from_secs(10));
    assert_eq!(settings.limits.max_connections, 10_000);
    assert_eq!(settings.origin.connect, Duration::from_secs(5));
    assert!(!settings.origin.http2);
    let set = load(
        &["--connect-timeout", "250ms"],
        "connect_timeout = \"9s\"\nresponse_timeout = \"3s\"\nmax_connections = 7\n",
    )
    .unwrap();
    assert_eq!(set.origin.connect, Duration::from_millis(250));
    assert_eq!(set.origin.response, Duration::from_secs(3));
    assert_eq!(set.limits.max_connections, 7);
    for (text, field) in [
        ("keep_alive_timeout = \"0s\"\n", "keep_alive_timeout"),
        ("max_connections = 0\n", "max_connections"),
        ("tls_cert = \"c.pem\"\n", "tls_key"),
        ("upstream_ca = \"ca.pem\"\n", "upstream_ca"),
    ] {
        let refused = load(&[], text).unwrap_err().to_string();
        assert!(refused.contains(field), "{text}: {refused}");
    }
}

#[test]
fn via_names_a_token_or_nothing() {
    let via = |flags: &[&str], text: &str| load(flags, text).map(|s| s.origin.via);
    assert_eq!(via(&[], "").unwrap().as_deref(), Some("stampede-sidecar"));
    assert_eq!(
        via(&[], "via = \"edge-7\"\n").unwrap().as_deref(),
        Some("edge-7")
    );
    assert_eq!(via(&["--via", ""], "via = \"edge-7\"\n").unwrap(), None);
    let refused = via(&[], "via = \"two words\"\n").unwrap_err().to_string();
    assert!(refused.contains("via"), "{refused}");
}

#[test]
fn trusted_proxies_are_address_blocks() {
    let trusted = load(&[], "trusted_proxies = [\"10.0.0.0/8\", \"::1\"]\n").unwrap();
    assert_eq!(trusted.origin.trusted_proxies.len(), 2);
    let flagged = load(
        &["--trusted-proxy", "127.0.0.1"],
        "trusted_proxies = [\"10.0.0.0/8\"]\n",
    );
    assert_eq!(
        flagged.unwrap().origin.trusted_proxies.len(),
        1,
        "the flags replace the file's"
    );
    let refused = load(&["--trusted-proxy", "10.0.0.0/40"], "")
        .unwrap_err()
        .to_string();
    assert!(refused.contains("trusted_proxies"), "{refused}");
}

/// The one list of per-route settings is what a `[[routes]]` table takes (serde's own
/// list of its fields), what the sidecar guide's annotated file shows, and, by its
/// builder methods, what the README's table of a route's policy names.
#[test]
fn the_route_settings_are_one_list() {
    let refused = load(&[], "[[routes]]\nname = \"a\"\nprefix = \"/a\"\nnope = 1\n")
        .err()
        .unwrap()
        .to_string();
    let expected = refused
        .split("expected one of ")
        .nth(1)
        .unwrap_or_else(|| panic!("{refused}"));
    let mut taken: Vec<&str> = expected
        .split(',')
        .map(|f| f.trim().trim_matches('`'))
        .filter(|f| !["name", "prefix"].contains(f))
        .collect();
    let mut listed: Vec<&str> = ROUTE_SETTINGS.iter().map(|(file, _)| *file).collect();
    taken.sort_unstable();
    listed.sort_unstable();
    assert_eq!(taken, listed, "a [[routes]] table takes what the list says");
    let guide = include_str!("../../../../docs/sidecar.md");
    let readme = include_str!("../../../../README.md");
    for (file, method) in ROUTE_SETTINGS {
        let shown = guide.lines().any(|line| {
            let line = line.strip_prefix("# ").unwrap_or(line);
            line.starts_with(&format!("{file} = "))
        });
        assert!(shown, "docs/sidecar.md's annotated file shows no `{file}`");
        assert!(
            readme.contains(&format!("| `{method}`")),
            "the README's policy table names no `{method}` (the file's `{file}`)"
        );
    }
}
