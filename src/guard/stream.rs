//! A fill's stream: the origin's body, read once by the fill and followed by every
//! caller that waits for it.
//!
//! The fill appends each frame as it arrives ([`Writer::push`]); every reader
//! ([`Reader`]) holds only its place, and takes the frames from there at its own pace,
//! the same `Bytes` for all (never a copy per reader). A reader that joins mid-fill
//! gets the frames so far, then the rest. The fill never waits for a reader: a slow
//! client holds back neither the fill nor the others, and what the stream holds is the
//! object once (when the fill stores it, its frames are swapped for slices of the
//! stored body: [`Writer::settle`]).
//!
//! How the body ended is part of the stream: a reader that reaches the end of a body
//! that failed or was cut gets an error ([`BodyError::FillCut`]), never a clean end, so
//! that its client sees the answer cut (HTTP/1.1: the connection closes before the
//! declared length or the last chunk; HTTP/2: the stream is reset), as the fill's own
//! caller does. A writer dropped without an ending (its task panicked, or was
//! cancelled) cuts the stream: unlike pingora-cache's `TempObject`, whose readers take a
//! writer that went away for the end of the body.
//!
//! [`BodyError::FillCut`]: super::BodyError::FillCut

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};

/// How a stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// The whole body.
    Whole,
    /// The origin's body failed, was cut, or the fill went away: every reader's body
    /// fails at the end of what came.
    Cut,
}

/// The body of one fill, as far as it came.
#[derive(Debug, Default)]
pub(crate) struct Stream {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The frames so far, and where each starts in the body.
    frames: Vec<Bytes>,
    starts: Vec<u64>,
    len: u64,
    end: Option<End>,
    /// The readers waiting for more.
    waiting: Vec<Waker>,
}

/// The fill's end of a stream: the one that appends to it, and ends it once.
#[derive(Debug)]
pub(crate) struct Writer {
    stream: Arc<Stream>,
    ended: bool,
}

/// A reader's place in a stream: the bytes from `at` to `until` (the end of the body,
/// or of a range).
#[derive(Debug)]
pub(crate) struct Reader {
    stream: Arc<Stream>,
    at: u64,
    until: u64,
    /// The end was read (an error is given once).
    done: bool,
}

/// What a reader gets next.
pub(crate) enum Next {
    Data(Bytes),
    End,
    Cut,
}

impl Stream {
    /// A stream to write, and its writer.
    pub(crate) fn writer() -> Writer {
        Writer {
            stream: Arc::new(Self::default()),
            ended: false,
        }
    }

    /// A stream that is whole already: `body`.
    pub(crate) fn whole(body: Bytes) -> Arc<Self> {
        let mut writer = Self::writer();
        writer.push(body);
        let stream = writer.stream.clone();
        writer.finish();
        stream
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A reader or writer that panicked left no half-made change: every change is
        // one push or one assignment.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A reader of the whole body, from its start.
    pub(crate) fn reader(self: &Arc<Self>) -> Reader {
        self.range(0, u64::MAX)
    }

    /// A reader of the bytes from `start` up to `end` (exclusive).
    pub(crate) fn range(self: &Arc<Self>, start: u64, end: u64) -> Reader {
        Reader {
            stream: self.clone(),
            at: start,
            until: end,
            done: false,
        }
    }

    /// The bytes from `start` up to `end` (which came already): a slice of one frame,
    /// or a copy of the frames they span.
    pub(crate) fn slice(&self, start: u64, end: u64) -> Bytes {
        let state = self.lock();
        let end = end.min(state.len);
        if start >= end {
            return Bytes::new();
        }
        let first = state.starts.partition_point(|s| *s <= start) - 1;
        let frame_start = state.starts[first];
        let frame = &state.frames[first];
        if end <= frame_start + frame.len() as u64 {
            return frame.slice((start - frame_start) as usize..(end - frame_start) as usize);
        }
        let mut out = BytesMut::with_capacity((end - start) as usize);
        for (frame, frame_start) in state.frames[first..].iter().zip(&state.starts[first..]) {
            if *frame_start >= end {
                break;
            }
            let from = start.saturating_sub(*frame_start) as usize;
            let to = ((end - frame_start) as usize).min(frame.len());
            out.extend_from_slice(&frame[from..to]);
        }
        out.freeze()
    }

    /// How many bytes came so far.
    pub(crate) fn len(&self) -> u64 {
        self.lock().len
    }
}

impl Writer {
    /// The stream written.
    pub(crate) fn stream(&self) -> &Arc<Stream> {
        &self.stream
    }

    /// Appends a frame of the body, and wakes the readers waiting for it.
    pub(crate) fn push(&mut self, data: Bytes) {
        if data.is_empty() {
            return;
        }
        let waiting = {
            let mut state = self.stream.lock();
            let start = state.len;
            state.len += data.len() as u64;
            state.starts.push(start);
            state.frames.push(data);
            std::mem::take(&mut state.waiting)
        };
        waiting.into_iter().for_each(Waker::wake);
    }

    /// The body is whole.
    pub(crate) fn finish(mut self) {
        self.end(End::Whole);
    }

    /// The body failed, or was cut: every reader's body fails where the stream stops.
    pub(crate) fn cut(mut self) {
        self.end(End::Cut);
    }

    fn end(&mut self, end: End) {
        self.ended = true;
        let waiting = {
            let mut state = self.stream.lock();
            state.end = Some(end);
            std::mem::take(&mut state.waiting)
        };
        waiting.into_iter().for_each(Waker::wake);
    }

    /// The whole body so far, in one buffer of its own (a copy: see [`Self::settle`]).
    pub(crate) fn gathered(&self) -> Bytes {
        let state = self.stream.lock();
        let mut whole = BytesMut::with_capacity(state.len as usize);
        for frame in &state.frames {
            whole.extend_from_slice(frame);
        }
        whole.freeze()
    }
}

impl Stream {
    /// Swaps the frames of a whole stream for `body`, the same bytes in one buffer (the
    /// body the fill stored): the stream then holds the object once, shared with the
    /// entry. Readers keep their places.
    pub(crate) fn settle(&self, body: &Bytes) {
        let mut state = self.lock();
        if state.end == Some(End::Whole) && state.len == body.len() as u64 {
            state.frames = vec![body.clone()];
            state.starts = vec![0];
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        if !self.ended {
            self.end(End::Cut);
        }
    }
}

impl Reader {
    /// The stream it reads.
    pub(crate) fn stream(&self) -> &Arc<Stream> {
        &self.stream
    }

    /// The next bytes from this reader's place, the end, or the cut; `Pending` (woken
    /// when more came) when the fill has not read that far yet.
    pub(crate) fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Next> {
        if self.done {
            return Poll::Ready(Next::End);
        }
        let mut state = self.stream.lock();
        if self.at >= self.until {
            self.done = true;
            return Poll::Ready(Next::End);
        }
        if self.at < state.len {
            // The frame that holds `at`: the last that starts at or before it.
            let index = state.starts.partition_point(|start| *start <= self.at) - 1;
            let (frame, start) = (&state.frames[index], state.starts[index]);
            let from = (self.at - start) as usize;
            let to = (frame.len() as u64).min(self.until - start) as usize;
            let data = frame.slice(from..to);
            self.at += data.len() as u64;
            return Poll::Ready(Next::Data(data));
        }
        match state.end {
            // (A range past the end of a whole body ends where the body does.)
            Some(End::Whole) => {
                self.done = true;
                Poll::Ready(Next::End)
            }
            Some(End::Cut) => {
                self.done = true;
                Poll::Ready(Next::Cut)
            }
            None => {
                if !state.waiting.iter().any(|w| w.will_wake(cx.waker())) {
                    state.waiting.push(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }

    /// Whether nothing more will come from this reader.
    pub(crate) fn is_end(&self) -> bool {
        if self.done || self.at >= self.until {
            return true;
        }
        let state = self.stream.lock();
        self.at >= state.len && state.end == Some(End::Whole)
    }

    /// How many bytes are left, when known: the end of the range, or of a body that
    /// is whole.
    pub(crate) fn left(&self) -> Option<u64> {
        let state = self.stream.lock();
        match state.end {
            Some(End::Whole) => Some(state.len.min(self.until).saturating_sub(self.at)),
            _ if self.until != u64::MAX => Some(self.until.saturating_sub(self.at)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::poll_fn;

    use super::*;

    async fn next(reader: &mut Reader) -> Next {
        poll_fn(|cx| reader.poll_next(cx)).await
    }

    /// Everything a reader gets, and whether it ended clean.
    async fn read_all(mut reader: Reader) -> (Vec<u8>, bool) {
        let mut body = Vec::new();
        loop {
            match next(&mut reader).await {
                Next::Data(data) => body.extend_from_slice(&data),
                Next::End => return (body, true),
                Next::Cut => return (body, false),
            }
        }
    }

    #[tokio::test]
    async fn readers_that_join_late_get_every_byte_once_shared() {
        let mut writer = Stream::writer();
        let stream = writer.stream().clone();
        let early = tokio::spawn(read_all(stream.reader()));
        writer.push(Bytes::from_static(b"hello "));
        tokio::task::yield_now().await;
        let late = tokio::spawn(read_all(stream.reader()));
        writer.push(Bytes::from_static(b"world"));
        let ranged = tokio::spawn(read_all(stream.range(3, 8)));
        writer.finish();
        assert_eq!(early.await.unwrap(), (b"hello world".to_vec(), true));
        assert_eq!(late.await.unwrap(), (b"hello world".to_vec(), true));
        assert_eq!(ranged.await.unwrap(), (b"lo wo".to_vec(), true));
        assert_eq!(stream.slice(3, 8), "lo wo");
        assert_eq!(stream.slice(6, 9), "wor");
        assert_eq!(stream.slice(0, 100), "hello world");
        assert_eq!(stream.slice(11, 12), "");
        // After the end too.
        assert_eq!(
            read_all(stream.reader()).await,
            (b"hello world".to_vec(), true)
        );
    }

    #[tokio::test]
    async fn a_cut_or_a_writer_gone_fails_every_reader_after_what_came() {
        for cut in [true, false] {
            let mut writer = Stream::writer();
            let stream = writer.stream().clone();
            let reader = tokio::spawn(read_all(stream.reader()));
            writer.push(Bytes::from_static(b"part"));
            if cut {
                writer.cut();
            } else {
                // As when the fill's task panics or is aborted.
                drop(writer);
            }
            assert_eq!(reader.await.unwrap(), (b"part".to_vec(), false));
            assert_eq!(read_all(stream.reader()).await, (b"part".to_vec(), false));
        }
    }

    #[tokio::test]
    async fn a_settled_stream_holds_the_stored_body_and_readers_keep_their_places() {
        let mut writer = Stream::writer();
        let stream = writer.stream().clone();
        writer.push(Bytes::from_static(b"abc"));
        writer.push(Bytes::from_static(b"def"));
        let mut reader = stream.reader();
        assert!(matches!(next(&mut reader).await, Next::Data(d) if d == "abc"));
        let whole = writer.gathered();
        writer.finish();
        stream.settle(&whole);
        assert_eq!(stream.lock().frames.len(), 1);
        assert_eq!(read_all(reader).await, (b"def".to_vec(), true));
        assert_eq!(Stream::whole(whole).reader().left(), Some(6));
    }
}
