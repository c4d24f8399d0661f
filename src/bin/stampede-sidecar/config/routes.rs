//! The routes section: the policy of requests that match no route, each route's (its
//! own fields over the top level's, the flags laid over those), each route's prefix and
//! name checked, and the fields that would do nothing refused.

use stampede_guard::Policy;

use super::defaults;
use super::file::{File, RouteFile, Unrouted};
use super::place::{Place, SettingError};
use super::policy::PolicyFields;
use crate::args::Args;

/// One route: requests whose path starts with `prefix` get `policy`.
#[derive(Debug)]
pub(crate) struct Route {
    pub(crate) prefix: String,
    pub(crate) policy: Policy,
}

/// Every policy of the settings.
pub(super) struct Policies {
    /// The policy of requests that match no route, or `None` to pass them through.
    pub(super) default: Option<Policy>,
    /// By prefix, longest first.
    pub(super) routes: Vec<Route>,
}

/// The policies of `file`, with the flags laid over its top level.
pub(super) fn policies(
    args: &Args,
    file: &File,
    top: &Place<'_>,
) -> Result<Policies, SettingError> {
    if file.default == Some(Unrouted::Pass) && file.routes.is_empty() {
        return Err(top.error("default", "\"pass\" with no routes would cache nothing"));
    }
    // The top level's policy fields, with the flags laid over them: the policy of
    // unrouted requests, and what each route starts from.
    let base = PolicyFields::flags(args)?.or(&PolicyFields::read(&file.policy_text(), top)?);
    let default = match file.default.unwrap_or(Unrouted::Cache) {
        Unrouted::Cache => Some(base.build(top, defaults::ROUTE)?),
        Unrouted::Pass => None,
    };
    // The top level's one-way fields: whether a policy takes each (the default's, a
    // route's that does not set its own), and whether one that takes it reads it.
    let mut top_level = [Taken::default(); ONE_WAY.len()];
    if default.is_some() {
        for (taken, (_, way)) in top_level.iter_mut().zip(ONE_WAY) {
            taken.note(base.follows() == way);
        }
    }
    let mut routes: Vec<Route> = Vec::with_capacity(file.routes.len());
    for (i, route) in file.routes.iter().enumerate() {
        let place = Place {
            file: top.file,
            route: Some(format!("\"{}\" (routes[{i}])", route.name)),
        };
        check(route, &file.routes[..i], &routes, default.is_some(), &place)?;
        let own = PolicyFields::read(&route.policy_text(), &place)?;
        let set = ONE_WAY.map(|(field, _)| own.is_set(field));
        let merged = own.or(&base);
        let policy = merged.build(&place, &route.name)?;
        for ((taken, (field, way)), set) in top_level.iter_mut().zip(ONE_WAY).zip(set) {
            match set {
                true if merged.follows() != way => {
                    return Err(place.error(field, unread(field, way, Said::Route)));
                }
                true => {}
                false => taken.note(merged.follows() == way),
            }
        }
        routes.push(Route {
            prefix: route.prefix.clone(),
            policy,
        });
    }
    for (taken, (field, way)) in top_level.iter().zip(ONE_WAY) {
        if base.is_set(field) && taken.by_some && !taken.read {
            // `--fresh` is the only one of them that is a flag too.
            let (place, said) = match (field, args.fresh) {
                ("fresh", Some(_)) => (Place::top(None), Said::Flag),
                _ => (top.clone(), Said::TopLevel),
            };
            return Err(place.error(field, unread(field, way, said)));
        }
    }
    // Longest prefix first: the first that matches is the longest.
    routes.sort_by_key(|r| std::cmp::Reverse(r.prefix.len()));
    Ok(Policies { default, routes })
}

/// Refuses a route whose prefix is not a path or another's, or whose name is another's
/// (`before` the routes above it in the file, `built` those already built).
fn check(
    route: &RouteFile,
    before: &[RouteFile],
    built: &[Route],
    default: bool,
    place: &Place<'_>,
) -> Result<(), SettingError> {
    if !route.prefix.starts_with('/') {
        return Err(place.error("prefix", format!("`{}` must start with /", route.prefix)));
    }
    if let Some(other) = built.iter().find(|r| r.prefix == route.prefix) {
        return Err(place.error(
            "prefix",
            format!(
                "`{}` is route \"{}\"'s prefix too",
                route.prefix,
                other.policy.route()
            ),
        ));
    }
    if let Some(first) = before.iter().position(|r| r.name == route.name) {
        return Err(place.error(
            "name",
            format!(
                "\"{}\" is routes[{first}]'s name too: each route needs a name of its own \
                 (it labels its metrics and its keys)",
                route.name
            ),
        ));
    }
    if route.name == defaults::ROUTE && default {
        return Err(place.error(
            "name",
            "\"default\" is the name of requests that match no route",
        ));
    }
    Ok(())
}

/// The policy fields that only one of the two ways of setting an entry's lifetimes reads,
/// and which one (whether it follows the origin): `fresh` is read by a policy of its own
/// only, `min_fresh` and `max_fresh` by one that follows the origin only. Set where no
/// policy reads them they would do nothing, silently, so they are refused.
const ONE_WAY: [(&str, bool); 3] = [("fresh", false), ("min_fresh", true), ("max_fresh", true)];

/// Of a top-level one-way field: whether some policy takes it, and whether one that takes
/// it reads it. Taken by some and read by none, it does nothing.
#[derive(Clone, Copy, Default)]
struct Taken {
    by_some: bool,
    read: bool,
}

impl Taken {
    fn note(&mut self, read: bool) {
        self.by_some = true;
        self.read |= read;
    }
}

/// Where a one-way field that does nothing was set.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Said {
    Flag,
    TopLevel,
    Route,
}

/// Why one-way `field`, read only by a policy that follows the origin or only by one that
/// does not (`read_when_following`), does nothing where it was set.
fn unread(field: &str, read_when_following: bool, said: Said) -> String {
    let route = said == Said::Route;
    match (read_when_following, said) {
        (false, Said::Flag) => "--fresh does nothing while the sidecar follows the origin \
                                (--follow-origin true, the default): the origin's \
                                Cache-Control, Expires and Age say how long entries are \
                                fresh. Add --follow-origin false for entries fresh that \
                                long whatever the origin says, or leave --fresh out"
            .to_owned(),
        (false, _) => format!(
            "does nothing while {} the origin (follow_origin, true by default): the \
             origin's Cache-Control, Expires and Age say how long entries are fresh. Set \
             follow_origin = false{} for entries fresh that long whatever the origin \
             says, or leave it out (min_fresh and max_fresh bound what the origin says)",
            if route {
                "the route follows"
            } else {
                "every policy that takes it follows"
            },
            if route { " on the route" } else { "" },
        ),
        (true, _) => format!(
            "does nothing while {} the origin (follow_origin = false): `{field}` bounds \
             the lifetimes the origin gives, and `fresh` sets a policy's own. Leave it out, \
             or set follow_origin = true{}",
            if route {
                "the route does not follow"
            } else {
                "no policy that takes it follows"
            },
            if route { " on the route" } else { "" },
        ),
    }
}
