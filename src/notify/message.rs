//! What a notice says, on the wire: a fill's ending, a key filled or invalidated, a
//! URL's learned `Vary`, a purge. Garbage is `None`, never a panic.

use std::time::Duration;

use super::purge_records::Purge;
use crate::keys::LocalKey;
use crate::lease::FencingToken;

/// How a fill's lease ended without a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// The answer may not be stored: pass the key through for a while.
    Pass,
    /// The origin failed: leave it alone for a while.
    Error,
    /// Nothing to say (the write was refused, the fill was abandoned): look again.
    Gone,
}

/// What instances tell each other, on the key space's broadcast channel, but for fill
/// notices, which go on the entry key's interest channel (see `interest`). On the wire:
///
/// * `f {entry key} {local key}`: an entry was written (sent by the write script, on
///   the key's interest channel); the entry key is its Redis key, the local key its key
///   in L1 (see `keys::LocalKey`);
/// * `i {token} {entry key} {local key}`: a response was invalidated, with its
///   tombstone's token (sent by the invalidation script);
/// * `e {pass|error|gone} {ms} {entry key}`: a fill's lease ended without a write, and
///   what to make of the key for the next `ms`;
/// * `u {route} {response} {name,name,...}`: a URL learned the headers its responses vary
///   on (`response`: its local key, in hex); versions that learned per route sent
///   `v {route} {name,name,...}`, read here without a URL, and ignored (a tag of its
///   own, so that such versions ignore these in turn);
/// * `p {h|s} {µs} {tag id} {tag id}...`: tags were purged, hard or soft, at that time
///   of the server's clock (sent by the purge script).
///
/// The local key comes last, after a space no entry key holds, so that a fleet in the
/// middle of an upgrade keeps hearing itself: versions from before local keys sent
/// `f {entry key}` and `i {token} {entry key}`, read here with no local key (the
/// hearer then does what it can without one), and read the entry key of these notices
/// up to the end of its response's part, where the local key does not reach.
///
/// Every notice is heard on whichever channel it comes. In a fleet in the middle of the
/// upgrade to interest channels, versions from before publish fill notices on the
/// broadcast channel, and this version hears them there; but versions from before wait
/// for fills on the broadcast channel alone, and do not hear the fill notices of this
/// version. That costs time, not correctness: a waiter of an older version that is not
/// woken reads Redis when its cold wait ends (`cold_wait`), and a refresh it held off
/// waits out its hold-off (the lease's time left) while the entry is served stale.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Notice<'a> {
    Filled(&'a str, Option<LocalKey>),
    Invalidated(&'a str, FencingToken, Option<LocalKey>),
    Ended(&'a str, Ending, Duration),
    Learned(&'a str, Option<u128>, Vec<&'a str>),
    Purged(Purge, u64, Vec<&'a str>),
}

/// The entry key and the local key that end `f` and `i` notices; `None` for a local
/// key that is there but not one.
fn key_and_local(rest: &str) -> Option<(&str, Option<LocalKey>)> {
    match rest.split_once(' ') {
        None => Some((rest, None)),
        Some((key, local)) => Some((key, Some(local.parse().ok()?))),
    }
}

/// Writes the optional local key that ends `f` and `i` notices.
struct AndLocal(Option<LocalKey>);

impl std::fmt::Display for AndLocal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(local) => write!(f, " {local}"),
            None => Ok(()),
        }
    }
}

impl std::fmt::Display for Notice<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Filled(key, local) => write!(f, "f {key}{}", AndLocal(*local)),
            Self::Invalidated(key, token, local) => {
                write!(f, "i {token} {key}{}", AndLocal(*local))
            }
            Self::Ended(key, ending, lasting) => {
                let how = match ending {
                    Ending::Pass => "pass",
                    Ending::Error => "error",
                    Ending::Gone => "gone",
                };
                write!(f, "e {how} {} {key}", lasting.as_millis())
            }
            Self::Learned(route, Some(response), names) => {
                write!(f, "u {route} {response:032x} {}", names.join(","))
            }
            Self::Learned(route, None, names) => write!(f, "v {route} {}", names.join(",")),
            Self::Purged(how, at, ids) => {
                let how = match how {
                    Purge::Hard => "h",
                    Purge::Soft => "s",
                };
                write!(f, "p {how} {at} {}", ids.join(" "))
            }
        }
    }
}

impl<'a> Notice<'a> {
    /// What kind of notice it is, as the metric of notices heard labels it.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Self::Filled(..) => "filled",
            Self::Invalidated(..) => "invalidated",
            Self::Ended(..) => "ended",
            Self::Learned(..) => "learned",
            Self::Purged(..) => "purged",
        }
    }

    /// Reads a notice; `None` for anything else.
    pub(crate) fn parse(payload: &'a [u8]) -> Option<Self> {
        let text = std::str::from_utf8(payload).ok()?;
        let (kind, rest) = text.split_once(' ')?;
        match kind {
            "f" => {
                let (key, local) = key_and_local(rest)?;
                Some(Self::Filled(key, local))
            }
            "i" => {
                let (token, rest) = rest.split_once(' ')?;
                let token = FencingToken::new(token.parse().ok()?);
                let (key, local) = key_and_local(rest)?;
                Some(Self::Invalidated(key, token, local))
            }
            "e" => {
                let (how, rest) = rest.split_once(' ')?;
                let (ms, key) = rest.split_once(' ')?;
                let ending = match how {
                    "pass" => Ending::Pass,
                    "error" => Ending::Error,
                    "gone" => Ending::Gone,
                    _ => return None,
                };
                Some(Self::Ended(
                    key,
                    ending,
                    Duration::from_millis(ms.parse().ok()?),
                ))
            }
            "p" => {
                let (how, rest) = rest.split_once(' ')?;
                let how = match how {
                    "h" => Purge::Hard,
                    "s" => Purge::Soft,
                    _ => return None,
                };
                let (at, ids) = rest.split_once(' ')?;
                Some(Self::Purged(
                    how,
                    at.parse().ok()?,
                    ids.split(' ').filter(|id| !id.is_empty()).collect(),
                ))
            }
            "u" => {
                let (route, rest) = rest.split_once(' ')?;
                let (response, names) = rest.split_once(' ')?;
                Some(Self::Learned(
                    route,
                    Some(u128::from_str_radix(response, 16).ok()?),
                    names.split(',').filter(|n| !n.is_empty()).collect(),
                ))
            }
            "v" => {
                let (route, names) = rest.split_once(' ')?;
                Some(Self::Learned(
                    route,
                    None,
                    names.split(',').filter(|n| !n.is_empty()).collect(),
                ))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_round_trip_and_garbage_is_none() {
        let token = FencingToken::new(42);
        let local = LocalKey {
            response: 7,
            variant: 9,
        };
        let notices = [
            Notice::Filled("sg:k:entry", Some(local)),
            Notice::Filled("sg:k:entry", None),
            Notice::Invalidated("sg:k:entry", token, Some(local)),
            Notice::Invalidated("sg:k:entry", token, None),
            Notice::Ended("sg:k:entry", Ending::Pass, Duration::from_millis(1500)),
            Notice::Ended("sg:k:entry", Ending::Error, Duration::from_millis(400)),
            Notice::Ended("sg:k:entry", Ending::Gone, Duration::ZERO),
            Notice::Learned("items", Some(7), vec!["accept-language", "x-tenant"]),
            Notice::Learned("items", None, vec!["accept-language"]),
            Notice::Purged(Purge::Hard, 1_700_000_000_000_000, vec!["tag_ab", "tag_cd"]),
            Notice::Purged(Purge::Soft, 1, vec!["tag_ab"]),
        ];
        for notice in notices {
            let wire = notice.to_string();
            assert_eq!(Notice::parse(wire.as_bytes()), Some(notice), "{wire}");
        }
        // What versions from before local keys send is read, without one.
        assert_eq!(
            Notice::parse(b"f sg:e:s:{items:req_ab}:fill:entry"),
            Some(Notice::Filled("sg:e:s:{items:req_ab}:fill:entry", None))
        );
        assert_eq!(
            Notice::parse(b"i 42 sg:e:s:{items:req_ab}:fill:entry"),
            Some(Notice::Invalidated(
                "sg:e:s:{items:req_ab}:fill:entry",
                token,
                None
            ))
        );
        // And they read the entry key of ours up to its response's part: the local key
        // after it does not change what they find there.
        let ours = Notice::Invalidated("sg:e:s:{items:req_ab}:fill:entry", token, Some(local));
        let wire = ours.to_string();
        let (_, old_key) = wire["i ".len()..].split_once(' ').unwrap();
        assert!(
            old_key.starts_with("sg:e:s:{items:req_ab}:fill:"),
            "{old_key}"
        );
        for garbage in [
            "",
            "f",
            "f key not-a-local-key",
            "f key 0000000000000000000000000000000700000000000000090",
            "i 42 key 00000000000000000000000000000007000000000000000g",
            "i 42 key 0000000000000000000000000000000700000000000000é",
            "i x key",
            "e maybe 5 key",
            "e pass x key",
            "z key",
            "\u{0}",
        ] {
            assert_eq!(Notice::parse(garbage.as_bytes()), None, "{garbage}");
        }
    }
}
