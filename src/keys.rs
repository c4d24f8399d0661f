//! Every Redis key the crate writes is built here.
//!
//! A key has the shape
//!
//! ```text
//! {prefix}:{env}:{service}:{{scope}}:{operation}:{kind}
//! sg:prod:quote-api:{tenant_3f9a…:quote:quote_91fa…}:recalculate:lease
//! ```
//!
//! * `prefix`, `env` and `service` come from the [`KeySpace`];
//! * the scope is a list of [`Scope`] parts: constant labels (`quote`) and identifiers
//!   (`tenant`, a quote id) that are replaced by a keyed hash, so that no raw identifier,
//!   and no personal data inside one, ever reaches Redis or its `MONITOR` output;
//! * the scope is wrapped in braces, a Redis Cluster hash tag: the lease key and its fence
//!   counter (and the cache entry they guard) land in one slot, which is what lets
//!   one Lua script touch all of them;
//! * the operation names what the lease protects (`recalculate`, `fill`).
//!
//! The hash is HMAC-SHA256 keyed by a secret of the key space, truncated to 128 bits and
//! written in hex. Without the secret an observer of Redis cannot test guesses of an
//! identifier against a key; with the same secret every instance of a service derives the
//! same key for the same identifier, which is what makes a lease shared by the fleet.
//!
//! Keys are bounded: every part has a maximum length and a key longer than
//! [`MAX_KEY_LEN`] is refused.

use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use siphasher::sip128::SipHasher13;

use crate::error::ConfigError;

/// The longest key the crate builds, in bytes.
pub const MAX_KEY_LEN: usize = 256;

/// The shortest secret a key space accepts, in bytes.
pub const MIN_SECRET_LEN: usize = 16;

/// How many scope parts a key may have.
pub const MAX_SCOPE_PARTS: usize = 8;

/// Bytes of the HMAC kept in a key (128 bits, 32 hex digits).
const HASH_BYTES: usize = 16;

/// The namespace of every key: prefix, environment, service, and the secret that keys the
/// hash of identifiers.
///
/// Cheap to clone; every instance of one service must be built with the same values, or
/// they will not share leases.
///
/// ```
/// use stampede_guard::keys::{KeySpace, Scope};
///
/// let keys = KeySpace::builder()
///     .env("prod")
///     .service("quote-api")
///     .secret(b"a secret of at least sixteen bytes".to_vec())
///     .build()?;
/// let name = keys.lease(
///     &[Scope::id("tenant", "acme-corp"), Scope::label("quote"), Scope::id("quote", "q-123")],
///     "recalculate",
/// )?;
/// assert!(name.key().starts_with("sg:prod:quote-api:{tenant_"));
/// assert!(!name.key().contains("acme-corp"));
/// # Ok::<(), stampede_guard::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct KeySpace {
    inner: Arc<Inner>,
}

struct Inner {
    /// `{prefix}:{env}:{service}:`, the start of every key.
    head: String,
    prefix: String,
    env: String,
    service: String,
    mac: Hmac<Sha256>,
    /// The keys of the in-process hash ([`LocalKey`]), derived from the secret.
    local: [u64; 4],
}

impl fmt::Debug for KeySpace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The secret is left out on purpose.
        f.debug_struct("KeySpace")
            .field("prefix", &self.inner.prefix)
            .field("env", &self.inner.env)
            .field("service", &self.inner.service)
            .finish_non_exhaustive()
    }
}

impl KeySpace {
    /// Starts a key space. `env`, `service` and `secret` are required.
    pub fn builder() -> KeySpaceBuilder {
        KeySpaceBuilder::default()
    }

    /// The prefix of every key (default `sg`).
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The environment part (`prod`, `staging`).
    pub fn env(&self) -> &str {
        &self.inner.env
    }

    /// The service part; lease owner values start with it too.
    pub fn service(&self) -> &str {
        &self.inner.service
    }

    /// The hashers of the [`LocalKey`]s of a route, made once for the route.
    pub(crate) fn local_hashers(&self, route: &str) -> LocalHashers {
        let [a, b, c, d] = self.inner.local;
        let mut response = SipHasher13::new_with_keys(a, b);
        response.write(route.as_bytes());
        // A route name holds no 0 byte: the identity that follows cannot shift into it.
        response.write(&[0]);
        LocalHashers {
            response,
            variant: SipHasher13::new_with_keys(c, d),
        }
    }

    /// The least a Redis ACL user needs for a guard of this key space: its keys, its
    /// notice channel and the commands the crate sends, and nothing else. For
    /// `ACL SETUSER <name> on ><password> <rules>`:
    ///
    /// - keys `~{prefix}:{env}:{service}:*` and channels `&{prefix}:{env}:{service}:*`;
    /// - `PING`; `EVALSHA` and `SCRIPT LOAD` (the scripts, loaded again when a server
    ///   answers `NOSCRIPT`); `PUBLISH`, `SUBSCRIBE` and `UNSUBSCRIBE` (notices: the
    ///   key space's channel, and the interest channels named after it, subscribed
    ///   while the instance waits for a key);
    /// - what the scripts call, which Redis checks against the user too: `GET`, `SET`,
    ///   `DEL`, `HGET`, `HSET`, `HEXISTS`, `PEXPIRE`, `PTTL`, `TYPE`, `TIME`, and
    ///   `SADD` and `SMEMBERS` (the list of a response's variants);
    /// - on a Redis Cluster, `CLUSTER SLOTS` (which node holds which slot) and `ASKING`
    ///   (following a slot on the move); behind Sentinel, `ROLE` (is this the primary).
    ///   Harmless elsewhere.
    ///
    /// Set the user on every server: on a cluster, on every node, replicas included (ACL
    /// users are not replicated, and scripts are loaded on every node). The inspection
    /// tool needs `SCAN`, `HMGET` and `CLUSTER NODES` besides; it is meant to run with an
    /// operator's user. The guard's stampede, cold-miss, fencing and invalidation tests,
    /// a cluster's cache scripts, a reshard and a Sentinel failover run as exactly this
    /// user.
    ///
    /// ```
    /// # use stampede_guard::KeySpace;
    /// let keys = KeySpace::builder()
    ///     .env("prod")
    ///     .service("catalog")
    ///     .secret(b"at least sixteen bytes of secret".to_vec())
    ///     .build()
    ///     .unwrap();
    /// assert!(keys.acl_rules().starts_with("resetkeys ~sg:prod:catalog:* resetchannels &sg:prod:catalog:* -@all"));
    /// ```
    pub fn acl_rules(&self) -> String {
        let head = &self.inner.head;
        format!(
            "resetkeys ~{head}* resetchannels &{head}* -@all +ping +evalsha \
             +script|load +publish +subscribe +unsubscribe +get +set +del +hget +hset +hexists +pexpire \
             +pttl +type +strlen +getrange +time +hgetall +hdel +zadd +zrangebyscore +zrange +zrank +zrem +sadd \
             +smembers \
             +scard +sismember \
             +cluster|slots +asking +role"
        )
    }

    /// The keyed hash of an identifier of a kind, as it appears in keys: `{kind}_{hex}`.
    ///
    /// The kind is part of what is hashed, so the same value under two kinds (a tenant
    /// and a user both named `acme`) gives unrelated hashes. (For the tests of that: the
    /// keys themselves hash with `push_hash`.)
    #[cfg(test)]
    fn hash_id(&self, kind: &str, value: impl AsRef<[u8]>) -> Result<String, ConfigError> {
        check_label("scope", kind, 32, false)?;
        Ok(self.hash_unchecked(kind, value.as_ref()))
    }

    fn hash_unchecked(&self, kind: &str, value: &[u8]) -> String {
        let mut mac = self.inner.mac.clone();
        mac.update(kind.as_bytes());
        // A separator that cannot occur in a kind, so (kind, value) pairs cannot collide.
        mac.update(&[0x1f]);
        mac.update(value);
        let digest = mac.finalize().into_bytes();
        let mut out = String::with_capacity(kind.len() + 1 + HASH_BYTES * 2);
        out.push_str(kind);
        out.push('_');
        push_hex(&mut out, &digest[..HASH_BYTES]);
        out
    }

    /// Writes `{kind}_{hex}` onto `key`, without a String of its own.
    fn push_hash(&self, key: &mut String, kind: &str, value: &[u8]) {
        let mut mac = self.inner.mac.clone();
        mac.update(kind.as_bytes());
        mac.update(&[0x1f]);
        mac.update(value);
        let digest = mac.finalize().into_bytes();
        key.push_str(kind);
        key.push('_');
        push_hex(key, &digest[..HASH_BYTES]);
    }

    /// The keys of a lease on `scope` for `operation`: the lease itself and its fence
    /// counter, in one hash slot.
    ///
    /// Refused (naming `scope` or `operation`) when the scope is empty or too long, a
    /// label or the operation is not a short lowercase name, or the key would be longer
    /// than [`MAX_KEY_LEN`].
    pub fn lease(&self, scope: &[Scope<'_>], operation: &str) -> Result<LeaseName, ConfigError> {
        let base = self.base(scope, operation)?;
        Ok(LeaseName {
            lease: format!("{base}:lease"),
            fence: format!("{base}:fence"),
            operation: operation.to_owned().into(),
        })
    }

    /// The keys of one cached response: the entry, and the lease and fence counter that
    /// guard its refresh, all in one hash slot. `identity` is what tells the response's
    /// URL apart (host, path and keyed query); it is hashed.
    pub(crate) fn cache(&self, route: &str, identity: &[u8]) -> Result<CacheKeys, ConfigError> {
        let mut entry = self.base(&[Scope::label(route), Scope::id("req", identity)], "fill")?;
        let primary = entry.len();
        entry.push_str(":entry");
        Ok(CacheKeys {
            entry,
            primary,
            lease: std::sync::OnceLock::new(),
            local: LocalKey::default(),
            names: None,
        })
    }

    /// The keys of one variant of a cached response: a response that varies on request
    /// headers (those its route keys on, and those its `Vary` names), for the values in
    /// `variant` (hashed, as `identity` is).
    ///
    /// A variant has its own entry, lease and fence counter, in the same hash slot as
    /// the response's [`cache`](Self::cache) keys, and shares their invalidation: one
    /// invalidation of the response reaches every variant.
    pub(crate) fn cache_variant(
        &self,
        route: &str,
        identity: &[u8],
        variant: &[u8],
    ) -> Result<CacheKeys, ConfigError> {
        let mut entry = self.base(&[Scope::label(route), Scope::id("req", identity)], "fill")?;
        let primary = entry.len();
        entry.push(':');
        self.push_hash(&mut entry, "v", variant);
        entry.push_str(":entry");
        if entry.len() > MAX_KEY_LEN {
            return Err(ConfigError::invalid(
                "scope",
                format!(
                    "the key would be {} bytes long, at most {MAX_KEY_LEN}",
                    entry.len()
                ),
            ));
        }
        Ok(CacheKeys {
            entry,
            primary,
            lease: std::sync::OnceLock::new(),
            local: LocalKey::default(),
            names: None,
        })
    }

    /// The pub/sub channel on which instances of the service tell each other about
    /// fills and invalidations.
    pub(crate) fn channel(&self) -> String {
        format!("{}events", self.inner.head)
    }

    /// The hash of the service's tag purges: when each tag was last purged, under its
    /// keyed hash ([`tag_id`](Self::tag_id)).
    pub(crate) fn purges_key(&self) -> String {
        format!("{}{{purges}}:tags", self.inner.head)
    }

    /// The purges by time, to prune old ones and to read back those an instance missed;
    /// in the hash slot of
    /// [`purges_key`](Self::purges_key).
    pub(crate) fn purges_by_time_key(&self) -> String {
        format!("{}{{purges}}:times", self.inner.head)
    }

    /// The id of a cache tag (`Surrogate-Key`, `Cache-Tag`, or set in code): its keyed
    /// hash, as purges name it in Redis and on the channel.
    pub(crate) fn tag_id(&self, tag: &str) -> String {
        self.hash_unchecked("tag", tag.as_bytes())
    }

    /// `{head}{{scope}}:{operation}`, checked for length with room for the longest kind.
    fn base(&self, scope: &[Scope<'_>], operation: &str) -> Result<String, ConfigError> {
        if scope.is_empty() {
            return Err(ConfigError::invalid(
                "scope",
                "needs at least one part: it is the key's hash tag",
            ));
        }
        if scope.len() > MAX_SCOPE_PARTS {
            return Err(ConfigError::invalid(
                "scope",
                format!("has {} parts, at most {MAX_SCOPE_PARTS}", scope.len()),
            ));
        }
        check_label("operation", operation, 32, true)?;
        let mut key = String::with_capacity(MAX_KEY_LEN);
        key.push_str(&self.inner.head);
        key.push('{');
        for (i, part) in scope.iter().enumerate() {
            if i > 0 {
                key.push(':');
            }
            match part {
                Scope::Label(label) => {
                    check_label("scope", label, 32, true)?;
                    key.push_str(label);
                }
                Scope::Id { kind, value } => {
                    check_label("scope", kind, 32, false)?;
                    self.push_hash(&mut key, kind, value);
                }
            }
        }
        key.push_str("}:");
        key.push_str(operation);
        // The longest suffix a key of this base gets (`:lease`, `:fence`, `:entry`).
        const LONGEST_KIND: usize = ":entry".len();
        if key.len() + LONGEST_KIND > MAX_KEY_LEN {
            return Err(ConfigError::invalid(
                "scope",
                format!(
                    "the key would be {} bytes long, at most {MAX_KEY_LEN}",
                    key.len() + LONGEST_KIND
                ),
            ));
        }
        Ok(key)
    }
}

/// One part of a key's scope.
#[derive(Clone, Copy)]
pub enum Scope<'a> {
    /// A constant name, such as a resource type (`quote`). Written as it is, so it must
    /// never carry data: 1 to 32 characters of `a-z`, `0-9`, `_` and `-`.
    Label(&'a str),
    /// An identifier of a kind (`tenant`, `user`), replaced by its keyed hash.
    Id {
        /// What the identifier names: 1 to 32 characters of `a-z`, `0-9` and `-`.
        kind: &'a str,
        /// The identifier itself. Never written to Redis.
        value: &'a [u8],
    },
}

impl<'a> Scope<'a> {
    /// A constant label.
    pub fn label(label: &'a str) -> Self {
        Self::Label(label)
    }

    /// An identifier, hashed.
    pub fn id(kind: &'a str, value: &'a (impl AsRef<[u8]> + ?Sized)) -> Self {
        Self::Id {
            kind,
            value: value.as_ref(),
        }
    }
}

impl fmt::Debug for Scope<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Label(label) => f.debug_tuple("Label").field(label).finish(),
            // The identifier's value is not shown: it is what keys exist to hide.
            Self::Id { kind, .. } => f
                .debug_struct("Id")
                .field("kind", kind)
                .finish_non_exhaustive(),
        }
    }
}

/// The two keys of one lease: the lease key (holding the owner value, with the lease's
/// TTL) and its fence counter (holding the last fencing token issued). Both share a hash
/// tag.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LeaseName {
    lease: String,
    fence: String,
    operation: metrics::SharedString,
}

impl LeaseName {
    /// The lease key.
    pub fn key(&self) -> &str {
        &self.lease
    }

    /// The fence counter's key.
    pub fn fence_key(&self) -> &str {
        &self.fence
    }

    /// The operation the lease protects: the label of its metrics.
    pub fn operation(&self) -> &str {
        &self.operation
    }

    pub(crate) fn operation_label(&self) -> metrics::SharedString {
        self.operation.clone()
    }
}

/// The keys of one cached response (see [`GuardLayer::cache_keys`](crate::GuardLayer::cache_keys)).
///
/// Made only past L1 (an L1 hit needs no Redis key: it looks up its local key). Only
/// the entry key is built up front; the lease's keys are derived from it the first time
/// they are asked for.
#[derive(Clone, Debug)]
pub struct CacheKeys {
    entry: String,
    /// Where the response's own part of the key ends: `{…}:fill`, shared by all its
    /// variants.
    primary: usize,
    lease: std::sync::OnceLock<LeaseName>,
    /// The same response's key in L1 (set by the guard, which hashes what this was made
    /// of; see [`LocalKey`]).
    pub(crate) local: LocalKey,
    /// The names of the headers the response's URL was known to vary on when the keys
    /// were made, and whose values they were made with (see `guard::vary`); `None` while
    /// it is known to vary on none.
    pub(crate) names: Option<Arc<[http::HeaderName]>>,
}

impl PartialEq for CacheKeys {
    fn eq(&self, other: &Self) -> bool {
        self.entry == other.entry
    }
}

impl Eq for CacheKeys {}

impl CacheKeys {
    /// The entry's key.
    pub fn entry(&self) -> &str {
        &self.entry
    }

    /// The key of part `index` of the body of the entry written under token `generation`,
    /// when the body is kept in parts: in the entry's hash slot.
    pub(crate) fn part(&self, generation: u64, index: u32) -> String {
        format!("{}:p:{generation}:{index}", self.entry)
    }

    /// The key that remembers the last invalidation of the response (its token), longer
    /// than the tombstone at the entry key does. One for the response and all its
    /// variants.
    pub fn invalidated_key(&self) -> String {
        format!("{}:inval", self.primary())
    }

    /// Where the names of the headers the response varies on are kept (see
    /// `guard::vary`): one record for the response and all its variants, in their hash
    /// slot.
    pub fn vary_key(&self) -> String {
        format!("{}:vary", self.primary())
    }

    /// Where the response's variants are listed: a set of the variant part of each
    /// variant's entry key (`v_` and a keyed hash, never a raw header value), added to
    /// by each write of a variant and kept as long as the entries it lists, in their
    /// hash slot. An invalidation of the response deletes the entries it lists, counts
    /// them, and deletes it.
    pub fn variants_key(&self) -> String {
        format!("{}:vars", self.primary())
    }

    /// The variant's own part of the entry key (`v_` and its keyed hash), as
    /// [`variants_key`](Self::variants_key) lists it; `None` for the response's own
    /// entry.
    pub(crate) fn variant_part(&self) -> Option<&str> {
        if !self.is_variant() {
            return None;
        }
        let end = self.entry.len() - ":entry".len();
        Some(&self.entry[self.primary + 1..end])
    }

    /// The fence counter of the response (its invalidations issue from it); the lease's
    /// own fence counter unless these are the keys of a variant.
    pub fn primary_fence_key(&self) -> String {
        format!("{}:fence", self.primary())
    }

    /// The response's own part of the key, shared by all its variants (in Redis, where
    /// an invalidation's token is kept under it; in each process, invalidations are
    /// remembered by the response's local key).
    pub fn primary(&self) -> &str {
        &self.entry[..self.primary]
    }

    /// Whether these are the keys of one variant of a response
    /// (`KeySpace::cache_variant`).
    pub fn is_variant(&self) -> bool {
        self.entry.len() != self.primary + ":entry".len()
    }

    /// The refresh lease of the entry.
    pub fn lease(&self) -> &LeaseName {
        self.lease.get_or_init(|| {
            let base = self.entry.strip_suffix(":entry").unwrap_or(&self.entry);
            LeaseName {
                lease: format!("{base}:lease"),
                fence: format!("{base}:fence"),
                operation: metrics::SharedString::const_str("fill"),
            }
        })
    }
}

/// The two hashers of a route's [`LocalKey`]s, SipHash-1-3 keyed from the secret: one
/// with a 128-bit output for the response, already fed the route's name, one for its
/// variant. Made once per route, copied for each key (a copy of their state is cheaper
/// than keying them and writing the route again on every request).
#[derive(Clone, Copy)]
pub(crate) struct LocalHashers {
    pub(crate) response: SipHasher13,
    pub(crate) variant: SipHasher13,
}

/// Their state is derived from the secret: never shown.
impl fmt::Debug for LocalHashers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LocalHashers(..)")
    }
}

/// The key of a cached response in this process's L1: a keyed 128-bit hash of the
/// response's identity (route, host, path and keyed query), and a 64-bit one of the
/// values of the headers its URL varies on (its route's keyed headers and those it
/// learned; 0 for a request with none of them: the response's own entry).
///
/// An L1 hit computes this and nothing else: no HMAC, no key string. The hash is keyed
/// with keys derived from the key space's secret, so every instance computes the same
/// one (notices name entries by it too) and nobody without the secret can make two
/// identities collide; at 128 bits, chance cannot either.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct LocalKey {
    pub(crate) response: u128,
    pub(crate) variant: u64,
}

impl LocalKey {
    /// The key of the response itself (not one of its variants).
    pub(crate) fn of_response(response: u128) -> Self {
        Self {
            response,
            variant: 0,
        }
    }
}

impl fmt::Display for LocalKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}{:016x}", self.response, self.variant)
    }
}

impl std::str::FromStr for LocalKey {
    type Err = ();

    fn from_str(text: &str) -> Result<Self, ()> {
        if text.len() != 48 || !text.is_ascii() {
            return Err(());
        }
        Ok(Self {
            response: u128::from_str_radix(&text[..32], 16).map_err(|_| ())?,
            variant: u64::from_str_radix(&text[32..], 16).map_err(|_| ())?,
        })
    }
}

/// The keys of the local hashers, from the secret (through the HMAC it keys, so the
/// secret itself is not reused as a SipHash key). Their HMAC input cannot be one that
/// makes a Redis key's hash: those all hold a 0x1f separator (see `hash_unchecked`), this
/// label holds none, so the SipHash keys reveal nothing of any key's hash.
fn derive_local(mac: &Hmac<Sha256>) -> [u64; 4] {
    let mut mac = mac.clone();
    mac.update(b"stampede-guard local keys");
    let digest = mac.finalize().into_bytes();
    let word =
        |i: usize| u64::from_le_bytes(digest[i * 8..i * 8 + 8].try_into().expect("8 bytes of 32"));
    [word(0), word(1), word(2), word(3)]
}

/// Builds a [`KeySpace`].
#[derive(Default)]
#[must_use]
pub struct KeySpaceBuilder {
    prefix: Option<String>,
    env: Option<String>,
    service: Option<String>,
    secret: Option<Vec<u8>>,
}

impl fmt::Debug for KeySpaceBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeySpaceBuilder")
            .field("prefix", &self.prefix)
            .field("env", &self.env)
            .field("service", &self.service)
            .finish_non_exhaustive()
    }
}

impl KeySpaceBuilder {
    /// The first part of every key (default `sg`): 1 to 16 characters of `a-z`, `0-9`,
    /// `_` and `-`.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = Some(prefix.into());
        self
    }

    /// The environment (`prod`, `staging`): 1 to 16 characters of `a-z`, `0-9`, `_`, `-`.
    pub fn env(mut self, env: impl Into<String>) -> Self {
        self.env = Some(env.into());
        self
    }

    /// The service name: 1 to 48 characters of `a-z`, `0-9`, `_` and `-`.
    pub fn service(mut self, service: impl Into<String>) -> Self {
        self.service = Some(service.into());
        self
    }

    /// The secret that keys the hash of identifiers: at least [`MIN_SECRET_LEN`] bytes,
    /// the same on every instance of the service, and kept out of source control.
    pub fn secret(mut self, secret: impl Into<Vec<u8>>) -> Self {
        self.secret = Some(secret.into());
        self
    }

    /// Checks every field and builds the key space.
    pub fn build(self) -> Result<KeySpace, ConfigError> {
        let prefix = self.prefix.unwrap_or_else(|| "sg".to_owned());
        check_label("prefix", &prefix, 16, true)?;
        let env = self.env.ok_or(ConfigError::Missing { field: "env" })?;
        check_label("env", &env, 16, true)?;
        let service = self
            .service
            .ok_or(ConfigError::Missing { field: "service" })?;
        check_label("service", &service, 48, true)?;
        let secret = self
            .secret
            .ok_or(ConfigError::Missing { field: "secret" })?;
        if secret.len() < MIN_SECRET_LEN {
            return Err(ConfigError::invalid(
                "secret",
                format!(
                    "is {} bytes long, at least {MIN_SECRET_LEN} are needed",
                    secret.len()
                ),
            ));
        }
        let mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&secret)
            .map_err(|_| ConfigError::invalid("secret", "not usable as an HMAC key"))?;
        Ok(KeySpace {
            inner: Arc::new(Inner {
                head: format!("{prefix}:{env}:{service}:"),
                prefix,
                env,
                service,
                local: derive_local(&mac),
                mac,
            }),
        })
    }
}

/// The 128 bits of a tag id (`tag_` and 32 hex digits, see `KeySpace::tag_id`): how
/// purges keep it. `None` for anything else.
pub(crate) fn tag_key(id: &str) -> Option<u128> {
    let hex = id.strip_prefix("tag_")?;
    if hex.len() != HASH_BYTES * 2 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u128::from_str_radix(hex, 16).ok()
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    let mut buf = [0u8; HASH_BYTES * 2];
    let hex = &mut buf[..bytes.len() * 2];
    hex::encode_to_slice(bytes, hex).expect("the buffer fits the digest");
    out.push_str(std::str::from_utf8(hex).expect("hex is ASCII"));
}

/// Checks a name that is written into keys as it is.
fn check_label(
    field: &'static str,
    value: &str,
    max: usize,
    underscore: bool,
) -> Result<(), ConfigError> {
    if value.is_empty() || value.len() > max {
        return Err(ConfigError::invalid(
            field,
            format!("`{value}` must be 1 to {max} characters long"),
        ));
    }
    let ok = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
    if let Some(bad) = value
        .chars()
        .find(|&c| !(ok(c) || (underscore && c == '_')))
    {
        return Err(ConfigError::invalid(
            field,
            format!(
                "`{value}` contains {bad:?}; allowed are a-z, 0-9, -{}",
                if underscore { " and _" } else { "" }
            ),
        ));
    }
    Ok(())
}

/// The hasher of maps keyed by [`LocalKey`] (L1's moka cache, its front). The keys are
/// already uniform hashes: fold them into 64 bits rather than hash them again.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Spread;

impl BuildHasher for Spread {
    type Hasher = Folded;

    fn build_hasher(&self) -> Folded {
        Folded(0)
    }
}

/// Folds the words it is given (see [`Spread`]).
#[derive(Debug)]
pub(crate) struct Folded(u64);

impl Hasher for Folded {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Not used by `LocalKey` (it writes whole words), but correct if it is.
        for byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*byte);
        }
    }

    fn write_u64(&mut self, word: u64) {
        self.0 = self.0.rotate_left(29) ^ word;
    }

    fn write_u128(&mut self, word: u128) {
        self.write_u64(word as u64 ^ (word >> 64) as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space(secret: &[u8]) -> KeySpace {
        KeySpace::builder()
            .env("test")
            .service("quote-api")
            .secret(secret.to_vec())
            .build()
            .unwrap()
    }

    const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

    #[test]
    fn keys_have_the_documented_shape_and_share_a_hash_tag() {
        let keys = space(SECRET);
        let name = keys
            .lease(
                &[
                    Scope::id("tenant", "t-7"),
                    Scope::label("quote"),
                    Scope::id("quote", "q-1"),
                ],
                "recalculate",
            )
            .unwrap();
        let tag = |k: &str| {
            let open = k.find('{').unwrap();
            let close = k.find('}').unwrap();
            k[open..=close].to_owned()
        };
        assert!(name.key().starts_with("sg:test:quote-api:{tenant_"));
        assert!(name.key().ends_with("}:recalculate:lease"));
        assert!(name.fence_key().ends_with("}:recalculate:fence"));
        assert_eq!(tag(name.key()), tag(name.fence_key()));
        let tag_of_lease = tag(name.key());
        let parts: Vec<&str> = tag_of_lease
            .trim_matches(|c| c == '{' || c == '}')
            .split(':')
            .collect();
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[1], "quote");
        assert_eq!(parts[0].len(), "tenant_".len() + 32);
    }

    #[test]
    fn no_raw_identifier_reaches_a_key() {
        let keys = space(SECRET);
        let pii = "john.smith@example.com";
        let name = keys
            .lease(
                &[Scope::label("user"), Scope::id("email", pii)],
                "recalculate",
            )
            .unwrap();
        for key in [name.key(), name.fence_key()] {
            assert!(!key.contains(pii));
            assert!(!key.contains("john"));
            assert!(!key.contains("example"));
            assert!(key.is_ascii());
        }
    }

    #[test]
    fn the_hash_is_keyed_and_separates_kinds() {
        let a = space(SECRET);
        let b = space(b"another secret, sixteen bytes or more");
        assert_eq!(
            a.hash_id("tenant", "acme").unwrap(),
            a.hash_id("tenant", "acme").unwrap()
        );
        assert_ne!(
            a.hash_id("tenant", "acme").unwrap(),
            b.hash_id("tenant", "acme").unwrap()
        );
        let tenant = a.hash_id("tenant", "acme").unwrap();
        let user = a.hash_id("user", "acme").unwrap();
        assert_ne!(tenant["tenant_".len()..], user["user_".len()..]);
    }

    #[test]
    fn bad_parts_are_refused_naming_the_field() {
        let keys = space(SECRET);
        let cases: [(&[Scope<'_>], &str, &str); 6] = [
            (&[], "fill", "scope"),
            (&[Scope::label("Quote")], "fill", "scope"),
            (&[Scope::label("a:b")], "fill", "scope"),
            (&[Scope::label("{x}")], "fill", "scope"),
            (&[Scope::label("quote")], "", "operation"),
            (&[Scope::label("quote")], "re calc", "operation"),
        ];
        for (scope, op, field) in cases {
            let err = keys.lease(scope, op).unwrap_err();
            assert_eq!(err.field(), field, "{scope:?} {op:?}: {err}");
        }
        let many = [Scope::label("x"); MAX_SCOPE_PARTS + 1];
        assert_eq!(keys.lease(&many, "fill").unwrap_err().field(), "scope");
    }

    #[test]
    fn variants_share_the_hash_tag_and_the_invalidation_of_their_response() {
        let keys = space(b"a secret of sixteen bytes or more");
        let plain = keys.cache("items", b"/items/1").unwrap();
        let fr = keys.cache_variant("items", b"/items/1", b"fr").unwrap();
        let de = keys.cache_variant("items", b"/items/1", b"de").unwrap();
        assert!(!plain.is_variant() && fr.is_variant());
        assert_ne!(fr.entry(), de.entry());
        assert_ne!(fr.lease().key(), de.lease().key());
        let tag = |k: &str| k[k.find('{').unwrap()..=k.find('}').unwrap()].to_owned();
        for k in [
            fr.entry(),
            de.entry(),
            fr.lease().key(),
            fr.lease().fence_key(),
        ] {
            assert_eq!(tag(k), tag(plain.entry()));
        }
        assert_eq!(fr.invalidated_key(), plain.invalidated_key());
        assert_eq!(fr.variants_key(), plain.variants_key());
        assert_eq!(tag(&fr.variants_key()), tag(plain.entry()));
        assert_eq!(fr.primary(), plain.primary());
        assert!(!fr.entry().contains("fr"));
        // A variant is listed by its part of the key: the response's own entry is not.
        let part = fr.variant_part().unwrap();
        assert!(
            part.starts_with("v_") && part.len() == "v_".len() + 32,
            "{part}"
        );
        assert_eq!(fr.entry(), format!("{}:{part}:entry", fr.primary()));
        assert_eq!(plain.variant_part(), None);
    }

    #[test]
    fn keys_are_bounded() {
        let keys = KeySpace::builder()
            .prefix("p".repeat(16))
            .env("e".repeat(16))
            .service("s".repeat(48))
            .secret(SECRET.to_vec())
            .build()
            .unwrap();
        let long = "k".repeat(32);
        let scope: Vec<Scope<'_>> = (0..MAX_SCOPE_PARTS)
            .map(|_| Scope::id(&long, "v"))
            .collect();
        let err = keys.lease(&scope, &long).unwrap_err();
        assert_eq!(err.field(), "scope");
        // Whatever fits is under the bound.
        let name = keys.lease(&scope[..2], &long).unwrap();
        assert!(name.key().len() <= MAX_KEY_LEN);
    }

    #[test]
    fn the_builder_refuses_bad_fields() {
        let ok = || {
            KeySpace::builder()
                .env("prod")
                .service("api")
                .secret(SECRET.to_vec())
        };
        assert!(ok().build().is_ok());
        let field = |b: KeySpaceBuilder| b.build().unwrap_err().field();
        assert_eq!(
            field(KeySpace::builder().service("a").secret(SECRET.to_vec())),
            "env"
        );
        assert_eq!(
            field(KeySpace::builder().env("a").secret(SECRET.to_vec())),
            "service"
        );
        assert_eq!(field(KeySpace::builder().env("a").service("b")), "secret");
        assert_eq!(field(ok().secret(b"short".to_vec())), "secret");
        assert_eq!(field(ok().prefix("")), "prefix");
        assert_eq!(field(ok().env("Prod")), "env");
        assert_eq!(field(ok().service("a:b")), "service");
        assert_eq!(field(ok().service("x".repeat(49))), "service");
    }

    #[test]
    fn debug_output_hides_the_secret_and_identifiers() {
        let keys = space(SECRET);
        let shown = format!("{keys:?}");
        assert!(!shown.contains("0123456789abcdef"));
        let shown = format!("{:?}", Scope::id("tenant", "acme-secret-tenant"));
        assert!(!shown.contains("acme"));
    }
}
