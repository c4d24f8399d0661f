//! The answer to a request for a byte range (see `http::range`): cut from the whole
//! body the layer holds, an entry's or an answer shared by a fill, after the request
//! was answered as a request for the whole.
//!
//! An answer streamed from the origin is left as the origin made it: a pass-through
//! carries the caller's `Range` to the origin, which answers it; the one caller whose
//! fill found the answer too large to buffer gets it whole (its fill asked for the whole
//! representation), as a server may (RFC 9110 §14.2).

use http::header::{CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_RANGE, CONTENT_TYPE, ETAG};
use http::{HeaderValue, Response, StatusCode};
use http_body::Body;

use super::body::ResponseBody;
use crate::http::range::{Part, Ranged, content_range, unsatisfied_range};
use crate::http::response::declared_length;

/// Headers that digest the whole content (RFC 9530 `Content-Digest`, RFC 1864
/// `Content-MD5`): a part of it, or none of it, is not what they digest.
const WHOLE_CONTENT_DIGESTS: [&str; 2] = ["content-digest", "content-md5"];

/// The answer to `ranged` made of the answer to the whole: its part (`206`), `416`, or
/// the answer itself. A fill's body as it streams is cut when its length is declared:
/// the range is sent as its bytes arrive.
pub(crate) fn cut<B: Body>(
    response: Response<ResponseBody<B>>,
    ranged: &Ranged,
) -> Response<ResponseBody<B>> {
    let len = match response.body().whole() {
        Some(whole) => whole.len() as u64,
        None if response.body().parts_len().is_some() => response.body().parts_len().unwrap_or(0),
        None if response.body().is_shared() => match declared_length(response.headers()) {
            Some(len) => len,
            None => return response,
        },
        None => return response,
    };
    let part = ranged.part(response.status(), response.headers(), len);
    let body = match part {
        Part::Whole => return response,
        Part::Bytes { first, last, .. } => match response.body().range(first, last + 1) {
            Some(body) => body,
            None => return response,
        },
        Part::Unsatisfiable { .. } => ResponseBody::empty(),
    };
    let (mut parts, _) = response.into_parts();
    match part {
        Part::Bytes { first, last, len } => {
            parts.status = StatusCode::PARTIAL_CONTENT;
            parts
                .headers
                .insert(CONTENT_RANGE, content_range(first, last, len));
            parts
                .headers
                .insert(CONTENT_LENGTH, HeaderValue::from(last - first + 1));
            // Digests of the whole content, not of this part (RFC 9530 §2).
            for name in WHOLE_CONTENT_DIGESTS {
                parts.headers.remove(name);
            }
        }
        Part::Unsatisfiable { len } => {
            parts.status = StatusCode::RANGE_NOT_SATISFIABLE;
            parts.headers.insert(CONTENT_RANGE, unsatisfied_range(len));
            parts.headers.insert(CONTENT_LENGTH, HeaderValue::from(0));
            // The body it described is not sent, nor what described it.
            for name in WHOLE_CONTENT_DIGESTS {
                parts.headers.remove(name);
            }
            for name in [CONTENT_TYPE, CONTENT_ENCODING, ETAG] {
                parts.headers.remove(name);
            }
        }
        Part::Whole => {}
    }
    Response::from_parts(parts, body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http::HeaderMap;
    use http_body_util::{BodyExt, Empty};

    type Answer = Response<ResponseBody<Empty<Bytes>>>;

    fn whole(status: StatusCode, body: &'static str) -> Answer {
        let mut response = Response::new(ResponseBody::full(Bytes::from_static(body.as_bytes())));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(CONTENT_LENGTH, HeaderValue::from(body.len()));
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        response
    }

    fn ranged(range: &'static str) -> Ranged {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::RANGE, HeaderValue::from_static(range));
        Ranged::of(&headers).unwrap()
    }

    async fn text(response: Answer) -> String {
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn a_held_200_is_cut() {
        let part = cut(
            whole(StatusCode::OK, "0123456789abcdef"),
            &ranged("bytes=-5"),
        );
        assert_eq!(part.status(), StatusCode::PARTIAL_CONTENT);
        assert_eq!(part.headers()[CONTENT_RANGE], "bytes 11-15/16");
        assert_eq!(part.headers()[CONTENT_LENGTH], "5");
        assert_eq!(text(part).await, "bcdef");

        let none = cut(whole(StatusCode::OK, "0123"), &ranged("bytes=4-"));
        assert_eq!(none.status(), StatusCode::RANGE_NOT_SATISFIABLE);
        assert_eq!(none.headers()[CONTENT_RANGE], "bytes */4");
        assert_eq!(none.headers()[CONTENT_LENGTH], "0");
        assert!(!none.headers().contains_key(CONTENT_TYPE));
        assert_eq!(text(none).await, "");
    }

    /// A part, or none, does not keep the whole content's digests; a 416 neither
    /// keeps the validator nor the coding of a body it does not send.
    #[tokio::test]
    async fn a_part_drops_the_whole_contents_digests() {
        let described = || {
            let mut answer = whole(StatusCode::OK, "0123456789");
            let headers = answer.headers_mut();
            for (name, value) in [
                ("content-digest", "sha-256=:abc=:"),
                ("content-md5", "Q2hlY2sgSW50ZWdyaXR5IQ=="),
                ("repr-digest", "sha-256=:abc=:"),
                ("etag", "\"v1\""),
                ("content-encoding", "identity"),
            ] {
                headers.insert(name, HeaderValue::from_static(value));
            }
            answer
        };
        let part = cut(described(), &ranged("bytes=2-4"));
        assert_eq!(part.status(), StatusCode::PARTIAL_CONTENT);
        for gone in ["content-digest", "content-md5"] {
            assert!(!part.headers().contains_key(gone), "{gone}");
        }
        for kept in ["repr-digest", "etag", "content-encoding"] {
            assert!(part.headers().contains_key(kept), "{kept}");
        }
        let none = cut(described(), &ranged("bytes=20-"));
        assert_eq!(none.status(), StatusCode::RANGE_NOT_SATISFIABLE);
        for gone in ["content-digest", "content-md5", "etag", "content-encoding"] {
            assert!(!none.headers().contains_key(gone), "{gone}");
        }
    }

    #[tokio::test]
    async fn other_answers_are_left_whole() {
        let not_found = cut(whole(StatusCode::NOT_FOUND, "gone"), &ranged("bytes=0-1"));
        assert_eq!(not_found.status(), StatusCode::NOT_FOUND);
        assert_eq!(text(not_found).await, "gone");
        let several = cut(whole(StatusCode::OK, "0123"), &ranged("bytes=0-0,2-2"));
        assert_eq!(several.status(), StatusCode::OK);
        assert_eq!(text(several).await, "0123");
        let streamed: Answer = Response::new(ResponseBody::stream(Empty::new()));
        let streamed = cut(streamed, &ranged("bytes=0-0"));
        assert_eq!(streamed.status(), StatusCode::OK);
    }
}
