//! The verdict's rules, one answer's head at a time (no Redis, no origin).

use std::time::Duration;

use http::{Response, StatusCode};

use super::*;

fn route() -> Policy {
    Policy::builder("r")
        .fresh_ttl(Duration::from_secs(5))
        .max_body(1024 * 1024)
        .build()
        .unwrap()
}

fn head(status: u16, headers: &[(&str, &str)]) -> Response<()> {
    let mut head = Response::new(());
    *head.status_mut() = StatusCode::from_u16(status).unwrap();
    for (name, value) in headers {
        head.headers_mut().append(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    head
}

#[test]
fn a_plain_answer_is_shared_and_stored() {
    let verdict = judge(&route(), &head(200, &[("content-length", "10")]));
    assert_eq!(verdict.sharing, Sharing::Shared);
    assert_eq!(verdict.stores, Ok(()));
    assert!(verdict.storing());
    assert_eq!(verdict.refreshes(), Ok(()));
}

#[test]
fn what_is_private_is_its_callers_alone() {
    for (headers, why) in [
        (&[("cache-control", "private")][..], NotStored::Private),
        (&[("set-cookie", "a=b")], NotStored::SetCookie),
        (&[("cache-control", "no-store")], NotStored::NoStore),
        (&[("vary", "*")], NotStored::VaryStar),
        (
            &[("content-type", "text/event-stream")],
            NotStored::EventStream,
        ),
        (
            &[("content-type", " Text/Event-Stream; charset=utf-8")],
            NotStored::EventStream,
        ),
    ] {
        let verdict = judge(&route(), &head(200, headers));
        assert_eq!(verdict.sharing, Sharing::Own(why), "{headers:?}");
        if why != NotStored::EventStream {
            assert_eq!(verdict.stores, Err(why));
            assert_eq!(verdict.refreshes(), Err(Refused::NotStored(why)));
        }
    }
}

#[test]
fn no_cache_is_stored_for_the_leader_alone_where_it_may_be_stored() {
    let following = Policy::builder("r").follow_origin(true).build().unwrap();
    let answer = head(200, &[("cache-control", "no-cache, max-age=60")]);
    assert_eq!(judge(&following, &answer).sharing, Sharing::StoredOnly);
    // On a route that stores only what it was told to, `no-cache` alone is not stored,
    // and its answer is its caller's.
    let verdict = judge(&route(), &head(200, &[("cache-control", "no-cache")]));
    if verdict.stores.is_err() {
        assert_eq!(verdict.sharing, Sharing::Own(NotStored::NoCache));
    } else {
        assert_eq!(verdict.sharing, Sharing::StoredOnly);
    }
}

#[test]
fn a_failure_is_shared_not_stored_and_refused_by_a_refresh() {
    let verdict = judge(&route(), &head(503, &[]));
    assert_eq!(verdict.sharing, Sharing::Shared);
    assert_eq!(verdict.stores, Err(NotStored::Status));
    assert!(verdict.failure);
    assert_eq!(verdict.refreshes(), Err(Refused::Failure));
}

#[test]
fn a_status_the_route_does_not_store_is_shared_unless_it_follows_the_origin() {
    let verdict = judge(&route(), &head(404, &[]));
    assert_eq!(verdict.sharing, Sharing::Shared);
    assert_eq!(
        verdict.refreshes(),
        Err(Refused::NotStored(NotStored::Status))
    );
    let following = Policy::builder("r").follow_origin(true).build().unwrap();
    let verdict = judge(&following, &head(404, &[]));
    assert_eq!(verdict.sharing, Sharing::Own(verdict.stores.unwrap_err()));
}

#[test]
fn with_credentials_forwarded_what_is_not_stored_is_the_leaders() {
    let tokens = Policy::builder("r")
        .allow_authorization(true)
        .build()
        .unwrap();
    let verdict = judge(&tokens, &head(401, &[]));
    assert_eq!(verdict.sharing, Sharing::Own(NotStored::Status));
    assert!(is_own(&tokens, NotStored::Status, &http::HeaderMap::new()));
    assert!(!is_own(
        &route(),
        NotStored::Status,
        &http::HeaderMap::new()
    ));
    assert!(is_own(
        &route(),
        NotStored::Private,
        &http::HeaderMap::new()
    ));
}

#[test]
fn length_decides_storing_and_sharing() {
    let policy = route();
    // Declared past `max_body`: shared as it streams, never stored; a refresh leaves it.
    let verdict = judge(&policy, &head(200, &[("content-length", "2000000")]));
    assert_eq!(verdict.sharing, Sharing::Shared);
    assert!(!verdict.storing());
    assert_eq!(
        verdict.refreshes(),
        Err(Refused::NotStored(NotStored::TooLarge))
    );
    // Declared past what a crowd shares: each caller's own.
    let huge = (SHARED_AT_MOST + 1).to_string();
    let verdict = judge(&policy, &head(200, &[("content-length", &huge)]));
    assert_eq!(verdict.sharing, Sharing::Own(NotStored::TooLarge));
    // Declaring nothing: judged by what comes.
    let verdict = judge(&policy, &head(200, &[]));
    assert!(verdict.storing());
    assert!(verdict.storing_at(1024 * 1024));
    assert!(!verdict.storing_at(1024 * 1024 + 1));
}

#[test]
fn too_many_header_values_are_never_stored() {
    let mut answer = head(200, &[]);
    for i in 0..=MAX_HEADERS {
        answer
            .headers_mut()
            .append("x-n", i.to_string().parse().unwrap());
    }
    let verdict = judge(&route(), &answer);
    assert!(!verdict.storing());
    assert_eq!(
        verdict.refreshes(),
        Err(Refused::NotStored(NotStored::TooLarge))
    );
}

#[test]
fn what_no_cache_names_is_judged_stripped_but_sharing_is_not() {
    let following = Policy::builder("r").follow_origin(true).build().unwrap();
    // `no-store` in `Cache-Control`, the field targeted at this cache named by
    // `no-cache`: once it is stripped, `Cache-Control` rules, and says not to store.
    let mut answer = head(
        200,
        &[
            ("cdn-cache-control", "max-age=60"),
            ("cache-control", "no-store, no-cache=\"CDN-Cache-Control\""),
        ],
    );
    let verdict = judge(&following, &answer);
    assert_eq!(verdict.stores, Ok(()));
    let verdict = verdict.stripped(&following, &mut answer);
    assert!(!answer.headers().contains_key("cdn-cache-control"));
    assert_eq!(verdict.stores, Err(NotStored::NoStore));
    // A `Set-Cookie` its `no-cache` names: stripped, but still its caller's alone.
    let mut answer = head(
        200,
        &[
            ("set-cookie", "a=b"),
            ("cache-control", "max-age=60, no-cache=\"Set-Cookie\""),
        ],
    );
    let verdict = judge(&following, &answer).stripped(&following, &mut answer);
    assert_eq!(verdict.sharing, Sharing::Own(NotStored::SetCookie));
    assert!(!answer.headers().contains_key("set-cookie"));
}
