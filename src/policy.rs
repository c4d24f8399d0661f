//! Per-route settings: how long a response is fresh, how long it may be served stale,
//! what a cold miss does, what is cacheable and what makes up the key.
//!
//! A [`Policy`] is built and checked on its own ([`PolicyBuilder::build`]), then checked
//! again against the Redis store when a layer is made from it
//! ([`StampedeGuard::layer`](crate::StampedeGuard::layer)): every refusal names the field.
//!
//! # The life of an entry
//!
//! ```text
//! written        fresh_ttl             fresh_ttl + grace     fresh_ttl + stale_if_error
//!   |── fresh: hit ──|── stale: served at once, ──|── kept only to be served ──|
//!                    |   one refresh in the fleet |   when the origin fails    |
//! ```
//!
//! Ages are measured with Redis's own TTLs and the local monotonic clock, never by
//! comparing wall clocks of two machines.

use std::fmt;
use std::time::Duration;

use http::{HeaderName, StatusCode};

use crate::error::ConfigError;

/// What the callers of a key with no entry at all do when the fill they wait for cannot
/// call the origin under the fleet's lease: another instance holds it and its entry did
/// not come within the route's [`cold_wait`](PolicyBuilder::cold_wait), the fleet backs
/// off after an origin failure, or the refresh budget is spent.
///
/// Either way, an entry that may stand in for a failed origin (stale-if-error) is served
/// if there is one; and never does each caller go to the origin on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ColdMiss {
    /// The fill goes to the origin itself, without the lease: one call of this process
    /// for all its callers of the key, whose answer they share (and that this process's
    /// L1 keeps, if it may be stored).
    Passthrough,
    /// Answer `503 Service Unavailable` with `Retry-After` (in whole seconds, at least 1).
    Reject {
        /// The `Retry-After` to send.
        retry_after: Duration,
    },
}

/// Which query parameters are part of the key (set with [`PolicyBuilder::key_query`],
/// [`PolicyBuilder::drop_query`], [`PolicyBuilder::ignore_query`]). In every mode a
/// fill gives the handler (the origin) the keyed parameters, sorted, and nothing else:
/// what the origin answers is what is stored under the key. (A request the guard does
/// not fill, a pass or a bypass, reaches it as it came.) Names are matched as sent,
/// percent-encoding and all.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyQuery {
    /// All of them, sorted, so that `?a=1&b=2` and `?b=2&a=1` share an entry.
    All,
    /// Only these.
    Only(Vec<String>),
    /// All but these, by name (`fbclid`) or by prefix (`utm_*`): parameters that change
    /// nothing in the answer.
    Drop(Vec<String>),
    /// None: the query string is left out of the key.
    Ignore,
}

impl KeyQuery {
    /// Whether the query parameter `name` is part of the key.
    pub(crate) fn keys(&self, name: &str) -> bool {
        match self {
            Self::All => true,
            Self::Only(names) => names.iter().any(|n| n == name),
            Self::Drop(patterns) => !patterns.iter().any(|p| match p.strip_suffix('*') {
                Some(prefix) => name.starts_with(prefix),
                None => p == name,
            }),
            Self::Ignore => false,
        }
    }
}

/// The settings of one route. Build one with [`Policy::builder`].
#[derive(Clone)]
pub struct Policy {
    pub(crate) route: String,
    pub(crate) fresh_ttl: Duration,
    pub(crate) grace: Duration,
    pub(crate) lease_ttl: Duration,
    pub(crate) refresh_timeout: Duration,
    pub(crate) pass_timeout: Duration,
    pub(crate) cold_wait: Duration,
    pub(crate) cold_miss: ColdMiss,
    pub(crate) stale_if_error: Duration,
    pub(crate) error_backoff: Duration,
    pub(crate) watchdog: Option<Duration>,
    pub(crate) soft_timeout: Option<Duration>,
    pub(crate) statuses: Vec<StatusCode>,
    pub(crate) max_body: usize,
    pub(crate) key_query: KeyQuery,
    pub(crate) key_headers: Vec<HeaderName>,
    pub(crate) forward_headers: Vec<HeaderName>,
    pub(crate) key_host: bool,
    pub(crate) allow_authorization: bool,
    pub(crate) allow_cookies: bool,
    /// Whether callers with different credentials share entries (else each credential
    /// the route allows is keyed).
    pub(crate) share_across_credentials: bool,
    /// Whether fill requests carry the caller's extensions (unset: unless the route
    /// forwards strictly).
    pub(crate) forward_extensions: Option<bool>,
    pub(crate) strict_forwarding: bool,
    pub(crate) hit_for_pass: Duration,
    pub(crate) fresh_jitter: Duration,
    /// How long past its grace and stale-if-error windows an entry is kept, only to be
    /// revalidated (Varnish's `keep`).
    pub(crate) keep: Duration,
    /// When fresh entries are refreshed before they go stale.
    pub(crate) early: Early,
    /// Whether the origin's `Cache-Control`, `Expires` and `Age` set each entry's
    /// lifetimes, within `min_fresh` and `max_fresh`.
    pub(crate) follow_origin: bool,
    pub(crate) min_fresh: Duration,
    pub(crate) max_fresh: Duration,
    /// Tags every entry of the route carries, for purges.
    pub(crate) tags: Vec<String>,
    /// The lease TTL from measured hold times, if set.
    pub(crate) adaptive: Option<Adaptive>,
    /// Whether a successful unsafe request (POST, PUT, DELETE...) invalidates the
    /// entries of its URI (unset: as the route follows the origin).
    pub(crate) invalidate_on_unsafe: Option<bool>,
    /// False for a route that is never cached: every request goes to the origin.
    pub(crate) cache: bool,
    /// Part of every key of the route when not 0: what its entries hold changed shape.
    pub(crate) version: u32,
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("route", &self.route)
            .field("fresh_ttl", &self.fresh_ttl)
            .field("grace", &self.grace)
            .field("lease_ttl", &self.lease_ttl)
            .field("refresh_timeout", &self.refresh_timeout)
            .field("pass_timeout", &self.pass_timeout)
            .field("cold_wait", &self.cold_wait)
            .field("cold_miss", &self.cold_miss)
            .field("stale_if_error", &self.stale_if_error)
            .field("error_backoff", &self.error_backoff)
            .field("watchdog", &self.watchdog)
            .field("soft_timeout", &self.soft_timeout)
            .field("cacheable_statuses", &self.statuses)
            .field("max_body", &self.max_body)
            .field("key_query", &self.key_query)
            .field("key_headers", &self.key_headers)
            .field("forward_headers", &self.forward_headers)
            .field("key_host", &self.key_host)
            .field("allow_authorization", &self.allow_authorization)
            .field("allow_cookies", &self.allow_cookies)
            .field("share_across_credentials", &self.share_across_credentials)
            .field("forward_extensions", &self.forward_extensions())
            .field("strict_forwarding", &self.strict_forwarding)
            .field("hit_for_pass", &self.hit_for_pass)
            .field("fresh_jitter", &self.fresh_jitter)
            .field("keep", &self.keep)
            .field("eager_refresh", &self.early.fraction)
            .field("xfetch", &self.early.beta)
            .field("follow_origin", &self.follow_origin)
            .field("min_fresh", &self.min_fresh)
            .field("max_fresh", &self.max_fresh)
            .field("tags", &self.tags)
            .field("adaptive_lease_ttl", &self.adaptive)
            .field("invalidate_on_unsafe", &self.invalidate_on_unsafe())
            .field("cache", &self.cache)
            .field("version", &self.version)
            .finish()
    }
}

pub mod defaults;

impl Policy {
    /// Starts the policy of a route. The name is a metric label and a part of every key
    /// of the route: 1 to 32 characters of `a-z`, `0-9`, `_` and `-`.
    pub fn builder(route: impl Into<String>) -> PolicyBuilder {
        PolicyBuilder {
            policy: Policy {
                route: route.into(),
                fresh_ttl: defaults::FRESH_TTL,
                grace: defaults::GRACE,
                lease_ttl: defaults::LEASE_TTL,
                refresh_timeout: defaults::REFRESH_TIMEOUT,
                pass_timeout: defaults::PASS_TIMEOUT,
                cold_wait: defaults::COLD_WAIT,
                cold_miss: ColdMiss::Passthrough,
                stale_if_error: defaults::STALE_IF_ERROR,
                error_backoff: defaults::ERROR_BACKOFF,
                watchdog: None,
                soft_timeout: None,
                statuses: vec![StatusCode::OK],
                max_body: defaults::MAX_BODY,
                key_query: KeyQuery::All,
                key_headers: Vec::new(),
                forward_headers: Vec::new(),
                key_host: true,
                allow_authorization: false,
                allow_cookies: false,
                share_across_credentials: false,
                forward_extensions: None,
                strict_forwarding: false,
                hit_for_pass: defaults::HIT_FOR_PASS,
                fresh_jitter: Duration::ZERO,
                keep: Duration::ZERO,
                early: Early::default(),
                follow_origin: false,
                min_fresh: Duration::ZERO,
                max_fresh: Duration::from_secs(24 * 3600),
                tags: Vec::new(),
                adaptive: None,
                invalidate_on_unsafe: None,
                cache: true,
                version: 0,
            },
            header_error: None,
            cold_wait_set: false,
            refresh_timeout_set: false,
            error_backoff_set: false,
        }
    }

    /// The route's name.
    pub fn route(&self) -> &str {
        &self.route
    }

    /// Whether the requests that fill and refresh entries carry the caller's extensions.
    pub fn forward_extensions(&self) -> bool {
        self.forward_extensions.unwrap_or(!self.strict_forwarding)
    }

    /// Whether a successful unsafe request invalidates the entries of its URI.
    pub fn invalidate_on_unsafe(&self) -> bool {
        self.invalidate_on_unsafe.unwrap_or(self.follow_origin)
    }

    /// How long a response is fresh.
    pub fn fresh_ttl(&self) -> Duration {
        self.fresh_ttl
    }

    /// How long past freshness a response is served stale while being refreshed.
    pub fn grace(&self) -> Duration {
        self.grace
    }

    /// How long a caller with nothing to serve waits for another instance's fill.
    pub fn cold_wait(&self) -> Duration {
        self.cold_wait
    }

    /// The largest body that is stored, in bytes.
    pub fn max_body(&self) -> usize {
        self.max_body
    }

    /// Which query parameters are part of the key.
    pub fn key_query(&self) -> &KeyQuery {
        &self.key_query
    }

    /// How long past freshness a response is kept in the caches: the longer of the grace
    /// window and the stale-if-error window, and the [`keep`](PolicyBuilder::keep)
    /// window after it.
    pub fn stale_keep(&self) -> Duration {
        self.grace.max(self.stale_if_error) + self.keep
    }

    /// The whole time an entry is kept, from its write.
    pub(crate) fn kept_for(&self) -> Duration {
        self.fresh_ttl + self.stale_keep()
    }

    pub(crate) fn is_cacheable_status(&self, status: StatusCode) -> bool {
        self.statuses.contains(&status)
    }

    /// Checks what can only be checked against the store: lease TTLs against its command
    /// timeout.
    pub(crate) fn check_against(&self, command_timeout: Duration) -> Result<(), ConfigError> {
        // The text below says 4.
        const _: () = assert!(crate::lease::MIN_TTL_PER_COMMAND_TIMEOUT == 4);
        let min = command_timeout * crate::lease::MIN_TTL_PER_COMMAND_TIMEOUT;
        let floor = self.adaptive.map(|a| a.floor);
        for (field, value, default) in [
            ("lease_ttl", Some(self.lease_ttl), Some(defaults::LEASE_TTL)),
            (
                "error_backoff",
                Some(self.error_backoff),
                Some(defaults::ERROR_BACKOFF),
            ),
            ("adaptive_lease_ttl", floor, None),
        ] {
            let Some(value) = value else { continue };
            if value >= min {
                continue;
            }
            // At its default, the setting the user set is the store's command timeout.
            if Some(value) == default {
                return Err(ConfigError::invalid(
                    "command_timeout",
                    format!(
                        "{command_timeout:?} is too long for route `{}`: its {field} \
                         ({value:?}, the default) is a lease TTL, and a lease must last 4 \
                         command timeouts ({min:?}); shorten command_timeout, or set \
                         {field} to at least {min:?}",
                        self.route
                    ),
                ));
            }
            return Err(ConfigError::TooShort {
                field,
                value,
                min,
                why: "it is a lease TTL, and a lease must last 4 times the store's command_timeout",
            });
        }
        Ok(())
    }
}

/// Builds a [`Policy`].
#[must_use]
pub struct PolicyBuilder {
    policy: Policy,
    header_error: Option<ConfigError>,
    /// Whether `cold_wait` was set; if not, it follows the refresh timeout.
    cold_wait_set: bool,
    /// Whether `refresh_timeout` was set (else a check that fails on its default names
    /// the setting the user did set).
    refresh_timeout_set: bool,
    /// Whether `error_backoff` was set (the same, for it).
    error_backoff_set: bool,
}

impl fmt::Debug for PolicyBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PolicyBuilder")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl PolicyBuilder {
    /// How long a response is fresh (default 10 s).
    pub fn fresh_ttl(mut self, ttl: Duration) -> Self {
        self.policy.fresh_ttl = ttl;
        self
    }

    /// How long past freshness a response may be served, at once, while one caller in the
    /// fleet refreshes it (default 60 s). Zero: never serve stale; an expired entry is a
    /// cold miss.
    pub fn grace(mut self, grace: Duration) -> Self {
        self.policy.grace = grace;
        self
    }

    /// The TTL of the lease a refresh holds (default 5 s). At least 4 Redis command
    /// timeouts; checked when the layer is made.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.policy.lease_ttl = ttl;
        self
    }

    /// How long a refresh or a cold fill may wait on the origin, its whole answer read
    /// (default 4 s). It must end within the lease: at most the lease TTL. A call that
    /// runs past it is cut and counted (`origin_failures_total{reason="timeout"}`); the
    /// callers that waited for it get an entry that may stand in, or `504`.
    pub fn refresh_timeout(mut self, timeout: Duration) -> Self {
        self.policy.refresh_timeout = timeout;
        self.refresh_timeout_set = true;
        self
    }

    /// How long a call that passes through to the origin may wait for its answer's head
    /// (default 60 s): requests the route does not cache (`x-cache: bypass`), the
    /// callers of a key whose answers are not stored (`pass`), and those of an answer
    /// private to another caller. The body then streams on as it comes. A call whose
    /// head does not come in time is cut and counted, and its caller gets `504`.
    pub fn pass_timeout(mut self, timeout: Duration) -> Self {
        self.policy.pass_timeout = timeout;
        self
    }

    /// How long a caller that has nothing to serve waits for a fill that another instance
    /// is doing, and for a slot of the guard's refresh budget; then it follows
    /// [`cold_miss`](Self::cold_miss). Zero: not at all.
    ///
    /// Default: the refresh timeout plus one second, as long as the other instance's
    /// fill may take with its write. A shorter wait trades origin calls for latency:
    /// with an origin slower than the wait, each other instance makes one call of its
    /// own for all its callers ([`ColdMiss::Passthrough`]), or they get a 503
    /// ([`ColdMiss::Reject`]). Callers of the instance that fills wait for its fill,
    /// however long it takes (up to the refresh timeout).
    pub fn cold_wait(mut self, wait: Duration) -> Self {
        self.policy.cold_wait = wait;
        self.cold_wait_set = true;
        self
    }

    /// What the callers of a cold key do when their fill cannot call the origin under the
    /// lease (default [`ColdMiss::Passthrough`]; see [`ColdMiss`]).
    pub fn cold_miss(mut self, behaviour: ColdMiss) -> Self {
        self.policy.cold_miss = behaviour;
        self
    }

    /// How long past freshness a response is still served when the origin fails (an
    /// error, a timeout or a 5xx) instead of the failure (default 5 min). Entries are
    /// kept for the longer of this and the grace window.
    pub fn stale_if_error(mut self, window: Duration) -> Self {
        self.policy.stale_if_error = window;
        self
    }

    /// After a failed refresh, the fleet leaves the origin alone this long: the lease is
    /// shortened to it instead of released (default 1 s; at least 4 Redis command
    /// timeouts, at most the lease TTL).
    pub fn error_backoff(mut self, backoff: Duration) -> Self {
        self.policy.error_backoff = backoff;
        self.error_backoff_set = true;
        self
    }

    /// Renew the lease while the origin works, every third of its TTL, for at most
    /// `max_total` from the acquire (default: no renewal). With it, the refresh timeout
    /// may be longer than the lease TTL, up to `max_total`. When a renewal finds the
    /// lease taken, or `max_total` is reached, the origin call is cancelled and nothing
    /// is written.
    pub fn watchdog(mut self, max_total: Duration) -> Self {
        self.policy.watchdog = Some(max_total);
        self
    }

    /// How long a caller waits for a fill when it has an expired entry it may serve
    /// instead (within stale-if-error): past it, the caller gets the entry (`x-cache:
    /// stale`) and the fill goes on in the background. Default: wait for the fill, up to
    /// the refresh timeout (the hard timeout).
    pub fn soft_timeout(mut self, timeout: Duration) -> Self {
        self.policy.soft_timeout = Some(timeout);
        self
    }

    /// Which statuses are cached (default: 200 only). 1xx, 206 and 304 are refused.
    pub fn cacheable_statuses(mut self, statuses: impl IntoIterator<Item = StatusCode>) -> Self {
        self.policy.statuses = statuses.into_iter().collect();
        self
    }

    /// The largest body that is stored (default 16 MiB, at most 64 MiB). A larger answer
    /// is not stored, but the callers that share its fill still share it, as it streams
    /// to them (one origin call); when its `Content-Length` says so at its head, the
    /// other instances hear it at once and call once each, instead of waiting for an
    /// entry that will not come. The first such answer of a route is logged, and each
    /// is counted (`stampede_guard_not_stored_total{reason="too_large"}`).
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.policy.max_body = bytes;
        self
    }

    /// The query parameters that make up the key: only these, sorted; the others are
    /// ignored and not passed to the origin on a fill. By default every parameter is
    /// keyed, which lets junk query strings make entries: public routes should name
    /// theirs. Takes its list as [`key_headers`](Self::key_headers) does.
    pub fn key_query<I, P>(mut self, params: I) -> Self
    where
        I: IntoIterator<Item = P>,
        P: AsRef<str>,
    {
        let mut names: Vec<String> = params.into_iter().map(|p| p.as_ref().to_owned()).collect();
        names.sort();
        names.dedup();
        self.policy.key_query = KeyQuery::Only(names);
        self
    }

    /// Query parameters left out of the key, by exact name (`fbclid`) or by prefix, a
    /// name ending in `*` (`utm_*`), matched as sent: tracking parameters that change
    /// nothing in the answer. Every other parameter is keyed, sorted, and a handler
    /// that reads `amount` still gets it, unlike with a [`key_query`](Self::key_query)
    /// list that forgot it. A fill gives the handler the keyed parameters only: a
    /// dropped one passed on could put one caller's text in the answer every caller
    /// of the key is served (count tracking parameters where requests arrive, not in a
    /// handler behind a cache, which sees one request in many). Answers to a request
    /// that had any say so in `Cache-Status` (`detail=query-dropped`).
    ///
    /// ```
    /// let policy = stampede_guard::Policy::builder("search")
    ///     .drop_query(["utm_*", "fbclid", "gclid"])
    ///     .build()?;
    /// # Ok::<(), stampede_guard::ConfigError>(())
    /// ```
    pub fn drop_query<I, P>(mut self, patterns: I) -> Self
    where
        I: IntoIterator<Item = P>,
        P: AsRef<str>,
    {
        let mut patterns: Vec<String> = patterns
            .into_iter()
            .map(|p| p.as_ref().to_owned())
            .collect();
        patterns.sort();
        patterns.dedup();
        self.policy.key_query = KeyQuery::Drop(patterns);
        self
    }

    /// Ignore the query string: it is not part of the key, and not passed to the origin
    /// on a fill.
    pub fn ignore_query(mut self) -> Self {
        self.policy.key_query = KeyQuery::Ignore;
        self
    }

    /// Request headers that make up the key, besides `Host`. Headers the route's
    /// responses name in `Vary` are learned and keyed too, whatever is set here (see
    /// the [guard docs](crate::guard)); naming them here keys on them from the first
    /// request.
    ///
    /// Like the learned ones, they tell apart the variants of one URL, not URLs: the
    /// entries of every value of them share their URL's invalidation, so that
    /// [`GuardLayer::invalidate_path`](crate::GuardLayer::invalidate_path) reaches them
    /// all.
    pub fn key_headers<I, H>(mut self, headers: I) -> Self
    where
        I: IntoIterator<Item = H>,
        H: AsRef<str>,
    {
        match parse_headers("key_headers", headers) {
            Ok(parsed) => self.policy.key_headers = parsed,
            Err(error) => self.header_error = Some(error),
        }
        self
    }

    /// With [`strict_forwarding`](Self::strict_forwarding): request headers passed to
    /// the origin on a fill without being part of the key (trace context, say). Only
    /// name headers that cannot change the response.
    pub fn forward_headers<I, H>(mut self, headers: I) -> Self
    where
        I: IntoIterator<Item = H>,
        H: AsRef<str>,
    {
        match parse_headers("forward_headers", headers) {
            Ok(parsed) => self.policy.forward_headers = parsed,
            Err(error) => self.header_error = Some(error),
        }
        self
    }

    /// Whether the host (the `Host` header or the URI's authority) is part of the key
    /// (default true). Turn it off only when every host serves the same content: with it
    /// on, instances reached under different host names (`localhost:3000` and
    /// `localhost:3001`, say) do not share entries.
    pub fn key_host(mut self, key_host: bool) -> Self {
        self.policy.key_host = key_host;
        self
    }

    /// Cache requests that carry `Authorization` (default false: they bypass). Each
    /// credential gets entries of its own, and one fill of its own: the route keys on
    /// `Authorization` (a keyed hash of it, as of every part of a key: never the
    /// credential itself in Redis), so that a `/me` answers each caller with its own.
    /// To share one answer among every authorized caller, say so with
    /// [`share_across_credentials`](Self::share_across_credentials).
    ///
    /// The layer does not check credentials on a hit: authentication must run outside
    /// (before) the guard, or an entry filled for a credential is served to anyone who
    /// sends the same one. Responses that are not stored are never shared between
    /// callers on such a route.
    pub fn allow_authorization(mut self, allow: bool) -> Self {
        self.policy.allow_authorization = allow;
        self
    }

    /// Cache requests that carry `Cookie` (default false: they bypass), each cookie
    /// header's value with entries of its own, as
    /// [`allow_authorization`](Self::allow_authorization) keys each credential.
    pub fn allow_cookies(mut self, allow: bool) -> Self {
        self.policy.allow_cookies = allow;
        self
    }

    /// Share one answer among every caller the route allows with credentials
    /// (`Authorization`, `Cookie`), whoever they are (default false: each credential has
    /// entries of its own). Only for answers that are the same for every authorized
    /// caller (a price list behind a login): the origin gets the credentials of
    /// whichever caller fills the entry, and every caller gets that answer.
    pub fn share_across_credentials(mut self, share: bool) -> Self {
        self.policy.share_across_credentials = share;
        self
    }

    /// Whether the requests that fill and refresh entries carry the caller's extensions
    /// (default true, unless [`strict_forwarding`](Self::strict_forwarding) is on): the
    /// wrapped handler sees the request it would see without the guard.
    ///
    /// Routers and outer layers put things there that handlers read: axum's path
    /// parameters (`Path`) and matched route, `State` set by a layer, tracing spans and
    /// request ids. The trade: an extension that changes the answer (a user, a tenant,
    /// set by an authentication layer) changes it for every client served from the
    /// entry. A handler that reads per-user data from an extension must be keyed on it
    /// (a [`key_headers`](Self::key_headers) entry carrying the same identity), or not
    /// be cached (a route without this layer, or [`never_cache`](Self::never_cache));
    /// else turn this off, and the handler sees no extension at all on a fill.
    pub fn forward_extensions(mut self, forward: bool) -> Self {
        self.policy.forward_extensions = Some(forward);
        self
    }

    /// Forward only the keyed headers (and [`forward_headers`](Self::forward_headers))
    /// to the origin on a fill (default false).
    ///
    /// By default a fill forwards the request's headers as a proxy does, so content
    /// negotiation, trace context and request ids keep working, without hop-by-hop
    /// headers and without the [`POISONING_HEADERS`]
    /// (unless keyed). An origin that changes its response on a header it does not name
    /// in `Vary` would then store one client's variant for everyone; strict forwarding
    /// makes that impossible, at the price of those headers. It drops the request's
    /// extensions too, unless [`forward_extensions`](Self::forward_extensions) is set.
    pub fn strict_forwarding(mut self, strict: bool) -> Self {
        self.policy.strict_forwarding = strict;
        self
    }

    /// How long, after a fill whose answer could not be stored (private, `Set-Cookie`,
    /// too large, a status not cached), callers of that key go straight to the origin
    /// instead of waiting behind a leader (Varnish's hit-for-pass; default 10 s; zero:
    /// never). Every instance learns it from the one that filled.
    pub fn hit_for_pass(mut self, lasting: Duration) -> Self {
        self.policy.hit_for_pass = lasting;
        self
    }

    /// Makes each stored entry fresh for the fresh TTL minus a random part of up to
    /// `max` (default zero), so that keys filled together do not go stale together.
    /// Less than the fresh TTL.
    pub fn fresh_jitter(mut self, max: Duration) -> Self {
        self.policy.fresh_jitter = max;
        self
    }

    /// Keep entries this long past their grace and stale-if-error windows, only to be
    /// revalidated (default zero; Varnish's `keep`). Such an entry is never served, but
    /// when it has a validator (`ETag`, `Last-Modified`) the fill that replaces it asks
    /// the origin whether it changed, and a `304` renews it with the body it has: the
    /// origin sends no body. At most 24 hours.
    pub fn keep(mut self, window: Duration) -> Self {
        self.policy.keep = window;
        self
    }

    /// Refresh a fresh entry from `fraction` of its fresh time on (between 0 and 1
    /// exclusive; FusionCache's eager refresh): the hit that finds it due is answered
    /// from it, and starts its refresh in the background, as a stale hit does (one per
    /// key in the fleet, under the lease and within the refresh budget). A key asked
    /// for more often than its fresh time is then never served stale. Default: off.
    pub fn eager_refresh(mut self, fraction: f64) -> Self {
        self.policy.early.fraction = Some(fraction);
        self
    }

    /// Refresh fresh entries early with XFetch's probability (Vattani et al., VLDB
    /// 2015): a hit starts the refresh when `age + δ·β·(−ln U) ≥ fresh time`, `U`
    /// uniform in (0, 1], `δ` what the route's origin calls take (measured), `β` this
    /// (above 0, at most 100; 1 is the paper's optimum, more refreshes earlier). The
    /// busier the key and the slower its origin, the earlier it is refreshed. Default:
    /// off; may be combined with [`eager_refresh`](Self::eager_refresh).
    pub fn xfetch(mut self, beta: f64) -> Self {
        self.policy.early.beta = Some(beta);
        self
    }

    /// Let the origin say how long its answers are fresh and may be served stale
    /// (default false: the route's own settings, whatever the origin says). Then
    /// `s-maxage`, `max-age`, `Expires` and `Age`, or without them a tenth of the time
    /// since `Last-Modified` (RFC 9111's heuristic), set each entry's fresh time, within
    /// [`min_fresh`](Self::min_fresh) and [`max_fresh`](Self::max_fresh);
    /// `stale-while-revalidate` and `stale-if-error` (RFC 5861) its windows (the
    /// route's [`grace`](Self::grace) and [`stale_if_error`](Self::stale_if_error)
    /// when it says nothing); `must-revalidate`, `proxy-revalidate`, `no-cache` and
    /// `s-maxage` without `stale-while-revalidate` forbid serving it stale, and
    /// `no-cache` makes every use a revalidation. An answer with neither a lifetime
    /// nor a validator is not stored; statuses beyond the route's
    /// [`cacheable_statuses`](Self::cacheable_statuses) are stored when the origin
    /// gives them a lifetime (or RFC 9110 lets a cache guess one), but never a 5xx.
    pub fn follow_origin(mut self, follow: bool) -> Self {
        self.policy.follow_origin = follow;
        self
    }

    /// On a route that follows the origin: the shortest fresh time an entry gets,
    /// whatever the origin says (default zero). A floor above zero makes a
    /// micro-cache of an origin that says `max-age=0`; never of a `no-cache` answer,
    /// which may be made for its caller alone (on a header it does not name in `Vary`)
    /// and is revalidated on every use (RFC 9111 §5.2.2.4), whatever the floor.
    pub fn min_fresh(mut self, floor: Duration) -> Self {
        self.policy.min_fresh = floor;
        self
    }

    /// On a route that follows the origin: the longest fresh time an entry gets,
    /// whatever the origin says (default and most 24 hours), so that an origin cannot
    /// pin an entry for a year.
    pub fn max_fresh(mut self, ceiling: Duration) -> Self {
        self.policy.max_fresh = ceiling;
        self
    }

    /// Tags every entry of the route carries, besides those its answers name in
    /// `Surrogate-Key` and `Cache-Tag`: [`StampedeGuard::purge_tags`] with one of them
    /// purges the whole route.
    ///
    /// [`StampedeGuard::purge_tags`]: crate::StampedeGuard::purge_tags
    pub fn tags<I, T>(mut self, tags: I) -> Self
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        self.policy.tags = tags.into_iter().map(Into::into).collect();
        self
    }

    /// Whether an unsafe request (any method but GET, HEAD, OPTIONS and TRACE) that the
    /// origin answers with a 2xx or 3xx invalidates, for the fleet, the entries of its
    /// URI and of the same-origin URIs its answer names in `Location` and
    /// `Content-Location` (RFC 9111 §4.4). Default: on for a route that
    /// [follows the origin](Self::follow_origin), off otherwise (the application then
    /// invalidates what it changes, with [`GuardLayer::invalidate`] or tags). Costs the
    /// request one Redis round trip per URI.
    ///
    /// [`GuardLayer::invalidate`]: crate::GuardLayer::invalidate
    pub fn invalidate_on_unsafe(mut self, invalidate: bool) -> Self {
        self.policy.invalidate_on_unsafe = Some(invalidate);
        self
    }

    /// Set the lease TTL from measured hold times: the 99th percentile of the route's
    /// latest lease holds (its fills and refreshes, from acquire to write), times
    /// `factor` (at least 1), between `floor` and `ceiling`. Until holds are measured,
    /// [`lease_ttl`](Self::lease_ttl) stands. The floor may not be below what a lease
    /// must outlast: the refresh timeout (unless there is a [`watchdog`](Self::watchdog)),
    /// and, checked when the layer is made, four Redis command timeouts. What the route
    /// uses now: [`GuardLayer::lease_ttl`](crate::GuardLayer::lease_ttl), and the
    /// `stampede_guard_lease_ttl_seconds{route, operation="fill"}` gauge (the labels of
    /// the route's hold times).
    pub fn adaptive_lease_ttl(mut self, factor: f64, floor: Duration, ceiling: Duration) -> Self {
        self.policy.adaptive = Some(Adaptive {
            factor,
            floor,
            ceiling,
        });
        self
    }

    /// A version that is part of every key of the route (0, the default, adds nothing):
    /// raise it when what the route's entries hold changes shape, so that instances of
    /// the new code and of the old, running side by side in a rolling deploy, keep
    /// apart entries rather than each reading the other's as a miss and writing over
    /// it. Typed values ([`StampedeGuard::values`](crate::StampedeGuard::values)) need
    /// it when their type's encoding changes; an HTTP route may use it to start afresh.
    pub fn version(mut self, version: u32) -> Self {
        self.policy.version = version;
        self
    }

    /// Never cache this route: every request goes to the origin, marked
    /// `x-cache: bypass`. For routes that must not be cached but sit behind a layer
    /// that is applied to many.
    pub fn never_cache(mut self) -> Self {
        self.policy.cache = false;
        self
    }

    /// Checks the settings and builds the policy: each check by what it is about, in
    /// this order (the first setting found wrong is the one named).
    pub fn build(self) -> Result<Policy, ConfigError> {
        if let Some(error) = self.header_error {
            return Err(error);
        }
        let mut p = self.policy;
        if !self.cold_wait_set {
            // The holder's fill, and the round trips of its write.
            p.cold_wait =
                (p.refresh_timeout + defaults::COLD_WAIT_MARGIN).min(Duration::from_secs(60));
        }
        check_route(&p.route)?;
        check_times(&p)?;
        check_lease(&p, self.refresh_timeout_set)?;
        check_soft_timeout(&p)?;
        check_backoff(&p, self.error_backoff_set)?;
        check_bounds(&p)?;
        check_storing(&p)?;
        check_early(&p)?;
        check_adaptive(&p)?;
        check_origin_bounds(&p)?;
        key_credentials(&mut p);
        Ok(p)
    }
}

/// The credentials a route allows are keyed (each gets entries of its own), unless it
/// shares one answer across them.
fn key_credentials(p: &mut Policy) {
    if p.share_across_credentials {
        return;
    }
    let allowed = [
        (http::header::AUTHORIZATION, p.allow_authorization),
        (http::header::COOKIE, p.allow_cookies),
    ];
    for (name, allowed) in allowed {
        if allowed && !p.key_headers.contains(&name) {
            p.key_headers.push(name);
        }
    }
    p.key_headers.sort_by(|a, b| a.as_str().cmp(b.as_str()));
}

/// At most a day: the longest an entry's windows, a lease and what the origin may ask.
const DAY: Duration = Duration::from_secs(24 * 3600);

/// The times that may not be zero, and the pass timeout's bound.
fn check_times(p: &Policy) -> Result<(), ConfigError> {
    ConfigError::nonzero("fresh_ttl", p.fresh_ttl)?;
    ConfigError::nonzero("lease_ttl", p.lease_ttl)?;
    ConfigError::nonzero("refresh_timeout", p.refresh_timeout)?;
    ConfigError::nonzero("pass_timeout", p.pass_timeout)?;
    if p.pass_timeout > Duration::from_secs(3600) {
        return Err(ConfigError::invalid("pass_timeout", "at most 1 hour"));
    }
    ConfigError::nonzero("error_backoff", p.error_backoff)?;
    Ok(())
}

/// The lease outlasts the refresh: by itself, or renewed by the watchdog within its
/// bounds (a check that fails on a default names the setting the user did set).
fn check_lease(p: &Policy, refresh_timeout_set: bool) -> Result<(), ConfigError> {
    match p.watchdog {
        None if p.refresh_timeout > p.lease_ttl => {
            // Named after what the user set: a short lease against the default
            // refresh timeout is the lease's doing.
            return Err(if refresh_timeout_set {
                ConfigError::invalid(
                    "refresh_timeout",
                    format!(
                        "{:?} is longer than lease_ttl ({:?}) and there is no watchdog: \
                         the refresh would outlive its lease",
                        p.refresh_timeout, p.lease_ttl
                    ),
                )
            } else {
                ConfigError::invalid(
                    "lease_ttl",
                    format!(
                        "{:?} is shorter than refresh_timeout ({:?}, its default) and \
                         there is no watchdog: the refresh would outlive its lease; set \
                         refresh_timeout to at most the lease, or a watchdog",
                        p.lease_ttl, p.refresh_timeout
                    ),
                )
            });
        }
        Some(max) if max < p.lease_ttl || max > Duration::from_secs(3600) => {
            return Err(ConfigError::invalid(
                "watchdog",
                format!(
                    "{max:?} must be between lease_ttl ({:?}) and 1 hour",
                    p.lease_ttl
                ),
            ));
        }
        Some(max) if p.refresh_timeout > max => {
            return Err(ConfigError::invalid(
                "refresh_timeout",
                format!(
                    "{:?} is longer than the watchdog's maximum ({max:?})",
                    p.refresh_timeout
                ),
            ));
        }
        _ => {}
    }
    Ok(())
}

/// A soft timeout is within the refresh timeout.
fn check_soft_timeout(p: &Policy) -> Result<(), ConfigError> {
    if let Some(soft) = p.soft_timeout
        && (soft.is_zero() || soft > p.refresh_timeout)
    {
        return Err(ConfigError::invalid(
            "soft_timeout",
            format!(
                "{soft:?} must be above zero and at most refresh_timeout ({:?})",
                p.refresh_timeout
            ),
        ));
    }
    Ok(())
}

/// The back-off after an error holds the lease off no longer than the lease lasts.
fn check_backoff(p: &Policy, error_backoff_set: bool) -> Result<(), ConfigError> {
    if p.error_backoff > p.lease_ttl {
        // As for the refresh timeout: named after what the user set.
        return Err(if error_backoff_set {
            ConfigError::invalid(
                "error_backoff",
                format!(
                    "{:?} is longer than lease_ttl ({:?})",
                    p.error_backoff, p.lease_ttl
                ),
            )
        } else {
            ConfigError::invalid(
                "lease_ttl",
                format!(
                    "{:?} is shorter than error_backoff ({:?}, its default): set \
                     error_backoff to at most the lease",
                    p.lease_ttl, p.error_backoff
                ),
            )
        });
    }
    Ok(())
}

/// Windows of at most a day, a cold wait of at most a minute, whole milliseconds.
fn check_bounds(p: &Policy) -> Result<(), ConfigError> {
    for (field, value) in [
        ("fresh_ttl", p.fresh_ttl),
        ("grace", p.grace),
        ("stale_if_error", p.stale_if_error),
        ("lease_ttl", p.lease_ttl),
        ("keep", p.keep),
        ("min_fresh", p.min_fresh),
        ("max_fresh", p.max_fresh),
    ] {
        if value > DAY {
            return Err(ConfigError::invalid(field, "at most 24 hours"));
        }
    }
    if p.cold_wait > Duration::from_secs(60) {
        return Err(ConfigError::invalid(
            "cold_wait",
            "at most 60 s: a request should not wait longer than that for a cache",
        ));
    }
    for (field, value) in [
        ("fresh_ttl", p.fresh_ttl),
        ("grace", p.grace),
        ("stale_if_error", p.stale_if_error),
        ("lease_ttl", p.lease_ttl),
        ("error_backoff", p.error_backoff),
        ("keep", p.keep),
        ("min_fresh", p.min_fresh),
        ("max_fresh", p.max_fresh),
    ] {
        if !value.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(ConfigError::invalid(
                field,
                format!("{value:?} is not a whole number of milliseconds"),
            ));
        }
    }
    Ok(())
}

/// What is stored and keyed: the cold miss's retry, the statuses, the body's bound,
/// the query parameters.
fn check_storing(p: &Policy) -> Result<(), ConfigError> {
    if let ColdMiss::Reject { retry_after } = p.cold_miss {
        ConfigError::nonzero("cold_miss", retry_after)?;
    }
    if p.statuses.is_empty() {
        return Err(ConfigError::invalid(
            "cacheable_statuses",
            "must name at least one status",
        ));
    }
    if let Some(bad) = p.statuses.iter().find(|s| {
        s.is_informational()
            || **s == StatusCode::PARTIAL_CONTENT
            || **s == StatusCode::NOT_MODIFIED
    }) {
        return Err(ConfigError::invalid(
            "cacheable_statuses",
            format!("{bad} cannot be served from a cache"),
        ));
    }
    if p.max_body == 0 {
        return Err(ConfigError::Zero { field: "max_body" });
    }
    if p.max_body > defaults::MAX_BODY_LIMIT {
        return Err(ConfigError::invalid(
            "max_body",
            format!("at most {} bytes", defaults::MAX_BODY_LIMIT),
        ));
    }
    if let KeyQuery::Only(names) = &p.key_query
        && names.iter().any(String::is_empty)
    {
        return Err(ConfigError::invalid("key_query", "empty parameter name"));
    }
    if let KeyQuery::Drop(patterns) = &p.key_query {
        for pattern in patterns {
            let name = pattern.strip_suffix('*').unwrap_or(pattern);
            if name.is_empty() {
                return Err(ConfigError::invalid(
                    "drop_query",
                    "an empty name or a bare `*` (to leave the whole query out, use ignore_query)",
                ));
            }
            if name.contains(['*', '&', '=', ';', '#', '%', ' ']) {
                return Err(ConfigError::invalid(
                    "drop_query",
                    "a name as sent, or a prefix ending in `*`: no `*` inside it, no `&`, \
                     `=`, `;`, `#`, `%` or space",
                ));
            }
        }
    }
    Ok(())
}

/// Freshness spread and early refresh within their ranges.
fn check_early(p: &Policy) -> Result<(), ConfigError> {
    if !p.fresh_jitter.is_zero() && p.fresh_jitter >= p.fresh_ttl {
        return Err(ConfigError::invalid(
            "fresh_jitter",
            format!(
                "{:?} must be less than the fresh TTL ({:?})",
                p.fresh_jitter, p.fresh_ttl
            ),
        ));
    }
    if let Some(fraction) = p.early.fraction
        && !(fraction > 0.0 && fraction < 1.0)
    {
        return Err(ConfigError::invalid(
            "eager_refresh",
            format!("{fraction} must be between 0 and 1 (exclusive)"),
        ));
    }
    if let Some(beta) = p.early.beta
        && !(beta > 0.0 && beta <= 100.0)
    {
        return Err(ConfigError::invalid(
            "xfetch",
            format!("{beta} must be above 0 and at most 100"),
        ));
    }
    Ok(())
}

/// An adaptive lease TTL's factor, floor and ceiling.
fn check_adaptive(p: &Policy) -> Result<(), ConfigError> {
    if let Some(adaptive) = p.adaptive {
        let why = if !(1.0..=100.0).contains(&adaptive.factor) {
            Some(format!(
                "the factor {} must be between 1 and 100",
                adaptive.factor
            ))
        } else if adaptive.floor > adaptive.ceiling {
            Some(format!(
                "the floor {:?} is above the ceiling {:?}",
                adaptive.floor, adaptive.ceiling
            ))
        } else if adaptive.ceiling > DAY {
            Some("the ceiling is at most 24 hours".to_owned())
        } else if p.watchdog.is_none() && adaptive.floor < p.refresh_timeout {
            Some(format!(
                "the floor {:?} is below the refresh timeout ({:?}): a refresh would \
                 outlive its lease",
                adaptive.floor, p.refresh_timeout
            ))
        } else if [adaptive.floor, adaptive.ceiling]
            .iter()
            .any(|d| !d.subsec_nanos().is_multiple_of(1_000_000))
        {
            Some("the floor and the ceiling are whole milliseconds".to_owned())
        } else {
            None
        };
        if let Some(why) = why {
            return Err(ConfigError::invalid("adaptive_lease_ttl", why));
        }
    }
    Ok(())
}

/// Tags, the floor and ceiling of what the origin may ask, hit-for-pass.
fn check_origin_bounds(p: &Policy) -> Result<(), ConfigError> {
    if p.tags.iter().any(|t| t.trim().is_empty()) {
        return Err(ConfigError::invalid("tags", "an empty tag"));
    }
    if p.min_fresh > p.max_fresh {
        return Err(ConfigError::invalid(
            "min_fresh",
            format!(
                "{:?} is longer than max_fresh ({:?})",
                p.min_fresh, p.max_fresh
            ),
        ));
    }
    if p.max_fresh.is_zero() {
        return Err(ConfigError::Zero { field: "max_fresh" });
    }
    if p.hit_for_pass > Duration::from_secs(3600) {
        return Err(ConfigError::invalid("hit_for_pass", "at most 1 hour"));
    }
    Ok(())
}

fn check_route(route: &str) -> Result<(), ConfigError> {
    let ok = !route.is_empty()
        && route.len() <= 32
        && route
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
    if ok {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            "route",
            format!("`{route}` must be 1 to 32 characters of a-z, 0-9, _ and -"),
        ))
    }
}

fn parse_headers<I, H>(field: &'static str, headers: I) -> Result<Vec<HeaderName>, ConfigError>
where
    I: IntoIterator<Item = H>,
    H: AsRef<str>,
{
    let mut out: Vec<HeaderName> = Vec::new();
    for header in headers {
        let header = header.as_ref();
        let name = HeaderName::from_bytes(header.as_bytes())
            .map_err(|_| ConfigError::invalid(field, format!("`{header}` is not a header name")))?;
        // The cache answers ranges from the whole representation: a fill never asks for
        // a part, and no entry is one range's.
        if name == http::header::RANGE || name == http::header::IF_RANGE {
            return Err(ConfigError::invalid(
                field,
                format!("`{header}` is answered by the cache, never keyed nor forwarded on a fill"),
            ));
        }
        if !out.contains(&name) {
            out.push(name);
        }
    }
    out.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    Ok(out)
}

/// When a route refreshes entries early.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct Early {
    /// From this fraction of the fresh time on.
    pub(crate) fraction: Option<f64>,
    /// XFetch's β.
    pub(crate) beta: Option<f64>,
}

impl Early {
    pub(crate) fn is_off(&self) -> bool {
        self.fraction.is_none() && self.beta.is_none()
    }
}

/// How the lease TTL adapts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Adaptive {
    pub(crate) factor: f64,
    pub(crate) floor: Duration,
    pub(crate) ceiling: Duration,
}

/// Request headers known to poison caches when they are not part of the key: frameworks
/// build links, redirects and routing decisions from them, so a response shaped by one
/// client's value would be served to everyone. A fill never forwards them unless the
/// route keys on them (or has learned that its responses vary on them). From published
/// cache-poisoning research: the forwarded-host and -scheme family, method and URL
/// overrides.
pub const POISONING_HEADERS: &[&str] = &[
    "forwarded",
    "x-forwarded-host",
    "x-forwarded-scheme",
    "x-forwarded-proto",
    "x-forwarded-port",
    "x-forwarded-prefix",
    "x-forwarded-server",
    "x-forwarded-ssl",
    "x-host",
    "x-original-host",
    "x-original-url",
    "x-rewrite-url",
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

#[cfg(test)]
mod tests {
    use super::*;

    /// The credentials a route allows are keyed, once each and in order with the other
    /// keyed headers, unless it shares one answer across them.
    #[test]
    fn allowed_credentials_are_keyed_unless_shared() {
        let keyed = |p: Policy| -> Vec<String> {
            p.key_headers
                .iter()
                .map(|h| h.as_str().to_owned())
                .collect()
        };
        let p = Policy::builder("me")
            .allow_authorization(true)
            .allow_cookies(true)
            .key_headers(["x-tenant", "cookie"])
            .build()
            .unwrap();
        assert_eq!(keyed(p), ["authorization", "cookie", "x-tenant"]);
        let p = Policy::builder("me").allow_cookies(true).build().unwrap();
        assert_eq!(keyed(p), ["cookie"]);
        let p = Policy::builder("prices")
            .allow_authorization(true)
            .share_across_credentials(true)
            .build()
            .unwrap();
        assert!(keyed(p).is_empty());
        assert!(keyed(Policy::builder("open").build().unwrap()).is_empty());
    }

    #[test]
    fn defaults_build() {
        let p = Policy::builder("items").build().unwrap();
        assert_eq!(p.kept_for(), defaults::FRESH_TTL + defaults::STALE_IF_ERROR);
        assert!(p.check_against(Duration::from_millis(100)).is_ok());
    }

    #[test]
    fn bad_settings_are_refused_naming_the_field() {
        let b = || Policy::builder("items");
        let ms = Duration::from_millis;
        let cases: Vec<(PolicyBuilder, &str)> = vec![
            (Policy::builder("Items"), "route"),
            // The lease the user set, shorter than the refresh timeout's default.
            (b().lease_ttl(ms(200)), "lease_ttl"),
            (Policy::builder(""), "route"),
            (b().fresh_ttl(Duration::ZERO), "fresh_ttl"),
            (b().lease_ttl(Duration::ZERO), "lease_ttl"),
            (b().refresh_timeout(Duration::ZERO), "refresh_timeout"),
            (
                b().lease_ttl(ms(1000)).refresh_timeout(ms(1001)),
                "refresh_timeout",
            ),
            (
                b().lease_ttl(ms(1000))
                    .refresh_timeout(ms(500))
                    .error_backoff(ms(2000)),
                "error_backoff",
            ),
            (b().grace(Duration::from_secs(2 * 86400)), "grace"),
            (b().watchdog(ms(1000)), "watchdog"),
            (
                b().refresh_timeout(ms(20_000)).watchdog(ms(10_000)),
                "refresh_timeout",
            ),
            (b().soft_timeout(Duration::ZERO), "soft_timeout"),
            (b().soft_timeout(Duration::from_secs(5)), "soft_timeout"),
            (b().cold_wait(Duration::from_secs(61)), "cold_wait"),
            (b().fresh_ttl(Duration::from_micros(1500)), "fresh_ttl"),
            (
                b().cold_miss(ColdMiss::Reject {
                    retry_after: Duration::ZERO,
                }),
                "cold_miss",
            ),
            (b().cacheable_statuses([]), "cacheable_statuses"),
            (
                b().cacheable_statuses([StatusCode::PARTIAL_CONTENT]),
                "cacheable_statuses",
            ),
            (b().max_body(0), "max_body"),
            (b().max_body(defaults::MAX_BODY_LIMIT + 1), "max_body"),
            (b().key_headers(["bad header"]), "key_headers"),
            (b().forward_headers(["x\n"]), "forward_headers"),
            (b().key_headers(["Range"]), "key_headers"),
            (b().forward_headers(["if-range"]), "forward_headers"),
            (b().key_query([""]), "key_query"),
            (b().drop_query(["*"]), "drop_query"),
            (b().drop_query([""]), "drop_query"),
            (b().drop_query(["utm_*_id"]), "drop_query"),
            (b().drop_query(["a=b"]), "drop_query"),
            (b().drop_query(["utm%5F*"]), "drop_query"),
            (b().drop_query(["a;b"]), "drop_query"),
            (b().fresh_jitter(defaults::FRESH_TTL), "fresh_jitter"),
            (b().hit_for_pass(Duration::from_secs(7200)), "hit_for_pass"),
            (b().keep(Duration::from_secs(2 * 86400)), "keep"),
            (b().eager_refresh(1.0), "eager_refresh"),
            (b().eager_refresh(0.0), "eager_refresh"),
            (b().eager_refresh(f64::NAN), "eager_refresh"),
            (b().xfetch(0.0), "xfetch"),
            (b().xfetch(f64::INFINITY), "xfetch"),
            (
                b().min_fresh(Duration::from_secs(10))
                    .max_fresh(Duration::from_secs(5)),
                "min_fresh",
            ),
            (b().max_fresh(Duration::ZERO), "max_fresh"),
            (b().tags(["a", " "]), "tags"),
            (
                b().adaptive_lease_ttl(0.5, Duration::from_secs(4), Duration::from_secs(8)),
                "adaptive_lease_ttl",
            ),
            (
                b().adaptive_lease_ttl(2.0, Duration::from_secs(9), Duration::from_secs(8)),
                "adaptive_lease_ttl",
            ),
            (
                b().adaptive_lease_ttl(2.0, Duration::from_secs(1), Duration::from_secs(8)),
                "adaptive_lease_ttl",
            ),
            (b().max_fresh(Duration::from_secs(2 * 86400)), "max_fresh"),
        ];
        for (builder, field) in cases {
            let error = builder.build().unwrap_err();
            assert_eq!(error.field(), field, "{error}");
            assert!(error.to_string().contains(field), "{error}");
        }
    }

    /// A check between two settings names the one the user set as the field, and the
    /// other in its message.
    #[test]
    fn a_check_that_relates_two_settings_names_both() {
        let b = || Policy::builder("items");
        let ms = Duration::from_millis;
        let cases: Vec<(PolicyBuilder, &str, &str)> = vec![
            (b().lease_ttl(ms(200)), "lease_ttl", "refresh_timeout"),
            (
                b().lease_ttl(ms(1000)).refresh_timeout(ms(1001)),
                "refresh_timeout",
                "lease_ttl",
            ),
            // The default error back-off (1 s) against a lease the user made shorter.
            (
                b().lease_ttl(ms(500)).refresh_timeout(ms(400)),
                "lease_ttl",
                "error_backoff",
            ),
            (
                b().lease_ttl(ms(1000))
                    .refresh_timeout(ms(500))
                    .error_backoff(ms(2000)),
                "error_backoff",
                "lease_ttl",
            ),
            (b().watchdog(ms(1000)), "watchdog", "lease_ttl"),
            (
                b().soft_timeout(Duration::from_secs(5)),
                "soft_timeout",
                "refresh_timeout",
            ),
            (
                b().min_fresh(Duration::from_secs(10))
                    .max_fresh(Duration::from_secs(5)),
                "min_fresh",
                "max_fresh",
            ),
        ];
        for (builder, field, other) in cases {
            let error = builder.build().unwrap_err();
            assert_eq!(error.field(), field, "{error}");
            assert!(error.to_string().contains(other), "{other}: {error}");
        }
    }

    #[test]
    fn a_watchdog_allows_refreshes_longer_than_the_lease() {
        let long = || Policy::builder("items").refresh_timeout(Duration::from_secs(20));
        assert_eq!(long().build().unwrap_err().field(), "refresh_timeout");
        assert!(long().watchdog(Duration::from_secs(30)).build().is_ok());
    }

    #[test]
    fn lease_ttls_are_checked_against_the_command_timeout() {
        let p = Policy::builder("items")
            .lease_ttl(Duration::from_millis(300))
            .refresh_timeout(Duration::from_millis(200))
            .error_backoff(Duration::from_millis(300))
            .build()
            .unwrap();
        let error = p.check_against(Duration::from_millis(100)).unwrap_err();
        assert_eq!(error.field(), "lease_ttl");
        assert!(p.check_against(Duration::from_millis(75)).is_ok());
        // Settings left at their defaults: the store's command timeout is to blame.
        let defaults = Policy::builder("items").build().unwrap();
        let error = defaults
            .check_against(Duration::from_millis(300))
            .unwrap_err();
        assert_eq!(error.field(), "command_timeout", "{error}");
        assert!(error.to_string().contains("error_backoff"), "{error}");
    }

    #[test]
    fn headers_are_normalized() {
        let p = Policy::builder("items")
            .key_headers(["X-Tenant", "accept-language", "x-tenant"])
            .build()
            .unwrap();
        let names: Vec<&str> = p.key_headers.iter().map(HeaderName::as_str).collect();
        assert_eq!(names, ["accept-language", "x-tenant"]);
    }
}
