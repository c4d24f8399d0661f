//! What each caller of a fill gets, row by row of the guard's "every way a fill ends"
//! table (see `guard`'s module docs): the caller that led, and every other waiter.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};

use super::*;
use crate::cache::Stored;
use crate::cache::entry::CachedResponse;
use crate::guard::inflight::SharedAnswer;
use crate::guard::stream::Stream;
use crate::lease::FencingToken;

/// Every way the origin can fail a fill.
const FAILURES: [Failure; 5] = [
    Failure::Error,
    Failure::Timeout,
    Failure::LeaseLost,
    Failure::Panicked,
    Failure::Cancelled,
];

fn entry() -> Landed {
    let response = CachedResponse {
        status: StatusCode::OK,
        headers: HeaderMap::new(),
        body: Bytes::from_static(b"x"),
        fresh_for: Duration::from_secs(5),
        grace: Duration::from_secs(5),
        keep: Duration::from_secs(10),
        token: FencingToken::new(2),
    };
    Landed::Entry {
        stored: Arc::new(Stored::aged(response, Duration::ZERO)),
        kept: true,
        variant_of: None,
    }
}

fn shared(failure: bool, leader_only: bool) -> Landed {
    Landed::Shared {
        response: Arc::new(SharedAnswer {
            status: if failure {
                StatusCode::BAD_GATEWAY
            } else {
                StatusCode::OK
            },
            headers: HeaderMap::new(),
            body: Stream::whole(Bytes::from_static(b"x")),
            storing: !failure,
            leader_only,
        }),
        failure,
        origin_saw: Arc::new(Request::new(())),
    }
}

/// The caller that led, with or without an answer of its own.
fn leader(has_own: bool) -> Waiter {
    Waiter {
        is_leader: true,
        has_own,
        stands_in: false,
        rejects: false,
        fit: Fit::Serves,
    }
}

/// Another waiter, of the leader's variant.
fn other() -> Waiter {
    Waiter {
        is_leader: false,
        has_own: false,
        stands_in: false,
        rejects: false,
        fit: Fit::Serves,
    }
}

fn standing_in(waiter: Waiter) -> Waiter {
    Waiter {
        stands_in: true,
        ..waiter
    }
}

#[test]
fn stored() {
    // The entry, for every caller of its variant; one of another looks again.
    assert_eq!(reply(&entry(), leader(false)), Reply::Entry);
    assert_eq!(reply(&entry(), other()), Reply::Entry);
    let elsewhere = Waiter {
        fit: Fit::Other,
        ..other()
    };
    assert_eq!(reply(&entry(), elsewhere), Reply::Rekey);
    // An entry revalidated on every use is its leader's alone.
    let each_use = |waiter| Waiter {
        fit: Fit::EachUse,
        ..waiter
    };
    assert_eq!(reply(&entry(), each_use(leader(false))), Reply::Entry);
    assert_eq!(reply(&entry(), each_use(other())), Reply::PassThrough);
}

#[test]
fn not_storable_not_private() {
    // The answer as it streams, to every caller of its variant.
    assert_eq!(reply(&shared(false, false), leader(false)), Reply::Shared);
    assert_eq!(reply(&shared(false, false), other()), Reply::Shared);
    let elsewhere = Waiter {
        fit: Fit::Other,
        ..other()
    };
    assert_eq!(reply(&shared(false, false), elsewhere), Reply::Rekey);
    // A 5xx is an origin error: an entry that may stand in is served instead.
    assert_eq!(reply(&shared(true, false), other()), Reply::Shared);
    assert_eq!(
        reply(&shared(true, false), standing_in(other())),
        Reply::StandIn
    );
    assert_eq!(
        reply(&shared(true, false), standing_in(leader(false))),
        Reply::StandIn
    );
    // Stored, but revalidated on every use: its leader's alone.
    assert_eq!(reply(&shared(false, true), leader(false)), Reply::Shared);
    assert_eq!(reply(&shared(false, true), other()), Reply::PassThrough);
}

#[test]
fn private_to_its_caller() {
    assert_eq!(reply(&Landed::Pass, leader(true)), Reply::Own);
    assert_eq!(reply(&Landed::Pass, other()), Reply::PassThrough);
    // A private 5xx: an entry that may stand in, else 502.
    let failed = Landed::Failed(Failure::Error);
    assert_eq!(reply(&failed, leader(true)), Reply::Own);
    assert_eq!(reply(&failed, standing_in(other())), Reply::StandIn);
    assert_eq!(reply(&failed, other()), Reply::Failed(Failure::Error));
}

#[test]
fn body_cut_mid_way() {
    // The leader that was handed nothing yet has the answer as far as it came (its
    // own); the others, an entry that may stand in, or 502.
    let cut = Landed::Failed(Failure::Error);
    assert_eq!(reply(&cut, leader(true)), Reply::Own);
    assert_eq!(reply(&cut, leader(false)), Reply::Failed(Failure::Error));
    assert_eq!(reply(&cut, standing_in(leader(true))), Reply::StandIn);
    assert_eq!(reply(&cut, other()), Reply::Failed(Failure::Error));
}

#[test]
fn another_variants() {
    // Its leader has its own answer; the others look again under their own keys.
    assert_eq!(reply(&Landed::Rekey, leader(true)), Reply::Own);
    assert_eq!(reply(&Landed::Rekey, other()), Reply::Rekey);
    // The URL learned a `Vary` header meanwhile: everyone looks again.
    assert_eq!(reply(&Landed::Rekey, leader(false)), Reply::Rekey);
}

#[test]
fn origin_error_timeout_lease_lost_panicked_cancelled() {
    for failure in FAILURES {
        let failed = Landed::Failed(failure);
        assert_eq!(reply(&failed, standing_in(leader(false))), Reply::StandIn);
        assert_eq!(reply(&failed, standing_in(other())), Reply::StandIn);
        assert_eq!(reply(&failed, leader(false)), Reply::Failed(failure));
        assert_eq!(reply(&failed, other()), Reply::Failed(failure));
    }
    // The inner service's error goes to the caller that led, and to it only.
    let failed = Landed::Failed(Failure::Error);
    assert_eq!(reply(&failed, leader(true)), Reply::Own);
}

#[test]
fn backed_off_over_budget_or_not_landed_within_the_cold_wait() {
    let stood = Landed::StoodAside;
    // With an entry that may stand in: that entry, for leader and others alike.
    assert_eq!(reply(&stood, standing_in(leader(false))), Reply::StandIn);
    assert_eq!(reply(&stood, standing_in(other())), Reply::StandIn);
    // On a route that rejects: 503.
    let rejecting = |waiter| Waiter {
        rejects: true,
        ..waiter
    };
    assert_eq!(reply(&stood, rejecting(leader(false))), Reply::Rejected);
    assert_eq!(reply(&stood, rejecting(other())), Reply::Rejected);
    // Else the caller looks again, and fills (one call for its process).
    assert_eq!(reply(&stood, leader(false)), Reply::Rekey);
    assert_eq!(reply(&stood, other()), Reply::Rekey);
}

/// The row of the guard's "every way a fill ends" table a landing is (its first
/// column's first words): every way a fill lands has a row (the match is exhaustive).
fn row_of(landed: &Landed) -> &'static [&'static str] {
    match landed {
        Landed::Entry { kept: true, .. } => &["stored"],
        Landed::Entry { kept: false, .. } => &["write refused"],
        Landed::Shared { .. } => &["not storable, not private"],
        Landed::Pass => &[
            "private to its caller",
            "another instance's fill ended with an answer that may not be stored",
        ],
        Landed::Failed(Failure::Error) => &["its body failed", "origin error"],
        Landed::Failed(Failure::Timeout) => &["origin timeout"],
        Landed::Failed(Failure::LeaseLost) => &["lease lost while calling"],
        Landed::Failed(Failure::Panicked) => &["panicked"],
        Landed::Failed(Failure::Cancelled) => &["cancelled"],
        Landed::StoodAside => &["backed off"],
        Landed::Rekey => &["another variant's", "the URL learned a `Vary` header"],
    }
}

/// The table's rows, as the guard's module docs write them: their first column.
fn table_rows() -> Vec<&'static str> {
    include_str!("../mod.rs")
        .lines()
        .filter_map(|line| line.strip_prefix("//! | "))
        .map(|row| row.split(" | ").next().unwrap_or_default())
        .filter(|ending| *ending != "ending" && !ending.starts_with("---"))
        .collect()
}

/// Each row of the "every way a fill ends" table is a way a fill lands (a variant of
/// `Landed`, with its failure), and each way a fill lands is a row: the table and the
/// code cannot drift apart.
#[test]
fn every_row_of_the_table_is_a_landing_and_every_landing_a_row() {
    let rows = table_rows();
    assert_eq!(rows.len(), 14, "{rows:#?}");
    let landings = [
        entry(),
        {
            let Landed::Entry {
                stored, variant_of, ..
            } = entry()
            else {
                unreachable!()
            };
            Landed::Entry {
                stored,
                kept: false,
                variant_of,
            }
        },
        shared(false, false),
        Landed::Pass,
        Landed::Failed(Failure::Error),
        Landed::Failed(Failure::Timeout),
        Landed::Failed(Failure::LeaseLost),
        Landed::Failed(Failure::Panicked),
        Landed::Failed(Failure::Cancelled),
        Landed::StoodAside,
        Landed::Rekey,
    ];
    let named: Vec<&str> = landings.iter().flat_map(row_of).copied().collect();
    for row in &rows {
        assert!(
            named.iter().any(|start| row.starts_with(start)),
            "the table's row `{row}` is no way a fill lands"
        );
    }
    for start in &named {
        assert!(
            rows.iter().any(|row| row.starts_with(start)),
            "a fill lands as `{start}`, which is no row of the table"
        );
    }
}

/// A refresh that lands with an entry (stored, renewed, or one that landed meanwhile)
/// or with another variant's answer leaves the origin to the fleet; one that fails,
/// or whose answer may not be stored, backs off.
#[test]
fn a_refresh_backs_off_after_anything_but_an_entry() {
    assert!(!backs_off(&entry()));
    assert!(!backs_off(&Landed::Rekey));
    for failure in FAILURES {
        assert!(backs_off(&Landed::Failed(failure)), "{failure:?}");
    }
    assert!(backs_off(&Landed::Pass));
    assert!(backs_off(&Landed::StoodAside));
    assert!(backs_off(&shared(true, false)));
}
