//! The headers of an entry as L1 keeps them: its values, and its layout (the names, in
//! order), shared by every entry with the same names.
//!
//! Why: a header map costs 104 bytes a name besides its values (a slot holds the name,
//! the value, a hash and links), and 4 more for its index. An entry of six headers
//! spent a kilobyte on that, more than on anything else, and entries of one route nearly
//! always carry the same names. Kept apart, the names and the map's slots are paid once
//! per layout; an entry keeps its values (40 bytes each, slices of one buffer) and a
//! pointer to its layout.
//!
//! An answer is still a clone of a map, the cheapest way `http` has to make one (no name
//! is hashed again): the layout's, with each value written in its place.
//!
//! At most [`MAX_LAYOUTS`] layouts are kept for sharing, each of at most
//! [`MAX_SHARED_NAMES`] values: at most about 11 KB each, 11 MB for the process in the
//! worst case, a few kilobytes for a service whose routes answer with a few lists of
//! names. When the table is full, the layouts no entry holds any more are let go; an
//! entry whose layout cannot be kept for sharing (too long, or the table full of layouts
//! in use) keeps one of its own, weighed in full.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use http::{HeaderMap, HeaderName, HeaderValue};

/// The most layouts kept for sharing: far more than a service's routes have (each
/// distinct list of response header names is one).
pub(crate) const MAX_LAYOUTS: usize = 1024;

/// The most values a layout kept for sharing has: more than answers carry, fewer than
/// a per-page list of `Link` values makes.
pub(crate) const MAX_SHARED_NAMES: usize = 64;

/// How many values come first and are the same in every entry (the placeholders of the
/// three headers an answer sets itself: see `Stored::aged`): they stay in the layout.
pub(crate) const FIXED: usize = 3;

/// An entry's headers: its layout and its values, in the layout's order.
#[derive(Debug)]
pub(crate) struct Headers {
    /// Every name of the entry, in order, with placeholder values.
    layout: Arc<HeaderMap>,
    /// The entry's values, in the layout's order, but for the first [`FIXED`].
    values: Box<[HeaderValue]>,
    /// Whether the layout is kept for sharing (then no entry pays for it).
    interned: bool,
}

/// The layouts kept for sharing, by their names in order.
fn layouts() -> &'static Mutex<HashMap<Box<[HeaderName]>, Arc<HeaderMap>>> {
    static LAYOUTS: OnceLock<Mutex<HashMap<Box<[HeaderName]>, Arc<HeaderMap>>>> = OnceLock::new();
    LAYOUTS.get_or_init(Mutex::default)
}

impl Headers {
    /// Keeps `map`, whose first [`FIXED`] values are the same for every entry: they
    /// stay in the layout.
    pub(crate) fn new(map: &HeaderMap) -> Self {
        let fixed = FIXED;
        let values = map.iter().skip(fixed).map(|(_, v)| v.clone()).collect();
        let own = || {
            let mut layout = map.clone();
            for (_, value) in layout.iter_mut().skip(fixed) {
                *value = HeaderValue::from_static("");
            }
            Arc::new(layout)
        };
        if map.len() > MAX_SHARED_NAMES {
            return Self {
                layout: own(),
                values,
                interned: false,
            };
        }
        let names: Box<[HeaderName]> = map.iter().map(|(name, _)| name.clone()).collect();
        let mut layouts = layouts().lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(layout) = layouts.get(&names) {
            return Self {
                layout: layout.clone(),
                values,
                interned: true,
            };
        }
        if layouts.len() >= MAX_LAYOUTS {
            // Those no entry holds any more (only the table does).
            layouts.retain(|_, layout| Arc::strong_count(layout) > 1);
        }
        let layout = own();
        let interned = layouts.len() < MAX_LAYOUTS;
        if interned {
            layouts.insert(names, layout.clone());
        }
        Self {
            layout,
            values,
            interned,
        }
    }

    /// The headers as a map: the layout's, with the entry's values.
    pub(crate) fn to_map(&self) -> HeaderMap {
        let mut map = HeaderMap::clone(&self.layout);
        for ((_, slot), value) in map.iter_mut().skip(FIXED).zip(self.values.iter()) {
            *slot = value.clone();
        }
        map
    }

    /// [`Headers::to_map`], with `first`, `second` and `third` in place of the
    /// layout's first three values (a hit's answer: one pass, and none over the values
    /// when the entry has none of its own).
    pub(crate) fn to_map_with(
        &self,
        first: HeaderValue,
        second: HeaderValue,
        third: HeaderValue,
    ) -> HeaderMap {
        let mut map = HeaderMap::clone(&self.layout);
        let mut slots = map.iter_mut();
        if let (Some((first_name, a)), Some((second_name, b)), Some((third_name, c))) =
            (slots.next(), slots.next(), slots.next())
        {
            debug_assert!(
                *first_name == http::header::AGE
                    && *second_name == crate::http::X_CACHE_NAME
                    && *third_name == crate::http::CACHE_STATUS_NAME,
                "a layout begins with the three headers an answer sets"
            );
            *a = first;
            *b = second;
            *c = third;
        }
        if !self.values.is_empty() {
            for ((_, slot), value) in slots.zip(self.values.iter()) {
                *slot = value.clone();
            }
        }
        map
    }

    /// The layout: every name, in order (the values are placeholders).
    pub(crate) fn layout(&self) -> &HeaderMap {
        &self.layout
    }

    /// The entry's values, after the layout's fixed ones, in order.
    pub(crate) fn values(&self) -> &[HeaderValue] {
        &self.values
    }

    /// Whether the layout is kept for sharing: then an entry does not pay for it (the
    /// table's bound does: see the module docs).
    pub(crate) fn shares_its_layout(&self) -> bool {
        self.interned
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header::{AGE, CONTENT_TYPE, LINK};

    fn map(values: [&'static str; 4]) -> HeaderMap {
        let mut map = HeaderMap::new();
        map.insert(AGE, HeaderValue::from_static("0"));
        map.insert(crate::http::X_CACHE_NAME, HeaderValue::from_static("hit"));
        map.insert(
            crate::http::CACHE_STATUS_NAME,
            HeaderValue::from_static("hit"),
        );
        map.insert(CONTENT_TYPE, HeaderValue::from_static(values[0]));
        map.append(LINK, HeaderValue::from_static(values[1]));
        map.append(LINK, HeaderValue::from_static(values[2]));
        map.insert("x-served-by", HeaderValue::from_static(values[3]));
        map
    }

    /// Every value comes back in its place, a name's several values in their order; two
    /// entries with the same names share one layout, and keep their own values.
    #[test]
    fn entries_with_the_same_names_share_a_layout_and_keep_their_values() {
        let a = map(["text/plain", "</a>", "</b>", "one"]);
        let b = map(["text/html", "</c>", "</d>", "two"]);
        let (ha, hb) = (Headers::new(&a), Headers::new(&b));
        assert_eq!(ha.to_map(), a);
        assert_eq!(hb.to_map(), b);
        assert!(Arc::ptr_eq(&ha.layout, &hb.layout));
        assert!(ha.shares_its_layout());
        assert_eq!(ha.values().len(), 4);

        let answer = hb.to_map_with(
            HeaderValue::from_static("42"),
            HeaderValue::from_static("one"),
            HeaderValue::from_static("two"),
        );
        assert_eq!(answer[AGE], "42");
        assert_eq!(answer["x-cache"], "one");
        assert_eq!(answer["cache-status"], "two");
        assert_eq!(answer[CONTENT_TYPE], "text/html");
        let links: Vec<_> = answer.get_all(LINK).iter().collect();
        assert_eq!(links, ["</c>", "</d>"]);
        assert_eq!(answer["x-served-by"], "two");
        assert_eq!(answer.len(), 7);

        // Other names, another layout.
        let mut c = map(["text/plain", "</a>", "</b>", "one"]);
        c.insert("x-other", HeaderValue::from_static("x"));
        let hc = Headers::new(&c);
        assert!(!Arc::ptr_eq(&ha.layout, &hc.layout));
        assert_eq!(hc.to_map(), c);

        // Too many values to keep for sharing: a layout of its own, weighed in full.
        let mut long = map(["text/plain", "</a>", "</b>", "one"]);
        for n in 0..MAX_SHARED_NAMES {
            long.append(LINK, HeaderValue::from_str(&format!("</{n}>")).unwrap());
        }
        let (h1, h2) = (Headers::new(&long), Headers::new(&long));
        assert!(!h1.shares_its_layout());
        assert!(!Arc::ptr_eq(&h1.layout, &h2.layout));
        assert_eq!(h2.to_map(), long);
    }
}
