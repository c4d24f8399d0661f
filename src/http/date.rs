//! HTTP dates (RFC 9110 §5.6.7), read robustly as its recipients are encouraged to be:
//! the three formats, with their names (of days, months, and `GMT`) in any case, and a
//! day name that does not match the date ignored (it says nothing the date does not).
//! Anything else is not a date: no other zone, no other punctuation or spacing.

use std::time::SystemTime;

use http::HeaderValue;

const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

const MONTHS: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

/// The time an HTTP-date field value names; `None` when it is not one.
pub(crate) fn parse(value: &HeaderValue) -> Option<SystemTime> {
    let text = value.to_str().ok()?;
    httpdate::parse_http_date(text)
        .ok()
        .or_else(|| robustly(text.trim()))
}

/// What a day name or a month name stands for, in the case the formats spell it.
enum Name {
    Day { long: bool },
    Other(&'static str),
}

fn name(word: &str) -> Option<Name> {
    if word.eq_ignore_ascii_case("gmt") {
        return Some(Name::Other("GMT"));
    }
    if let Some(month) = MONTHS.iter().find(|m| m.eq_ignore_ascii_case(word)) {
        return Some(Name::Other(month));
    }
    DAYS.iter().find_map(|day| {
        if day.eq_ignore_ascii_case(word) {
            Some(Name::Day { long: true })
        } else if day[..3].eq_ignore_ascii_case(word) {
            Some(Name::Day { long: false })
        } else {
            None
        }
    })
}

/// [`parse`] of a value the strict reading refused: each name in the formats' case;
/// then, of the seven day names, the one that makes it a date.
fn robustly(text: &str) -> Option<SystemTime> {
    if !text.is_ascii() {
        return None;
    }
    let mut spelled = String::with_capacity(text.len());
    let mut day = None;
    let mut rest = text;
    while !rest.is_empty() {
        let letters = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        if letters == 0 {
            spelled.push_str(&rest[..1]);
            rest = &rest[1..];
            continue;
        }
        match name(&rest[..letters])? {
            Name::Other(canonical) => spelled.push_str(canonical),
            Name::Day { long } => {
                day = Some((spelled.len(), long));
                // A placeholder of its length, replaced below.
                spelled.push_str(&rest[..letters]);
            }
        }
        rest = &rest[letters..];
    }
    let Some((at, long)) = day else {
        return httpdate::parse_http_date(&spelled).ok();
    };
    let end = at
        + spelled[at..]
            .bytes()
            .take_while(u8::is_ascii_alphabetic)
            .count();
    DAYS.iter().find_map(|day| {
        let day = if long { day } else { &day[..3] };
        let candidate = format!("{}{day}{}", &spelled[..at], &spelled[end..]);
        httpdate::parse_http_date(&candidate).ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn date(text: &str) -> Option<SystemTime> {
        parse(&HeaderValue::from_str(text).unwrap())
    }

    #[test]
    fn the_three_formats_in_any_case_and_with_any_day_name() {
        let expected = date("Thu, 18 Aug 2050 02:01:18 GMT").unwrap();
        for text in [
            "THU, 18 Aug 2050 02:01:18 GMT",
            "Thu, 18 AUG 2050 02:01:18 GMT",
            "Thu, 18 Aug 2050 02:01:18 gMT",
            "Mon, 18 Aug 2050 02:01:18 GMT",
            "Thursday, 18-Aug-50 02:01:18 GMT",
            "monday, 18-aug-50 02:01:18 gmt",
            "Thu Aug 18 02:01:18 2050",
            "sun AUG 18 02:01:18 2050",
        ] {
            assert_eq!(date(text), Some(expected), "{text}");
        }
        // asctime's day of the month, padded with a space, under the wrong day name.
        assert!(date("Thu Aug  8 02:01:18 2050").is_some());
    }

    #[test]
    fn what_is_not_a_date_stays_none() {
        for text in [
            "0",
            "",
            "Thu, 18 Aug 2050 02:01:18 UTC",
            "Thu, 18 Aug 2050 02:01:18 AEST",
            "Thu, 18 Aug 50 02:01:18 GMT",
            "Thu 18 Aug 2050 02:01:18 GMT",
            "Thu, 18  Aug  2050 02:01:18 GMT",
            "Thu, 18-Aug-2050 02:01:18 GMT",
            "Thu, 18 Aug 2050 02.01.18 GMT",
            "Thu, 18 Aug 2050 2:01:18 GMT",
            "Thu, 31 Feb 2050 02:01:18 GMT",
            "Someday, 18 Aug 2050 02:01:18 GMT",
        ] {
            assert_eq!(date(text), None, "{text}");
        }
    }
}
