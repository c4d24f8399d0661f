//! A fill's stream: the origin's body, read once by the fill and followed by every
//! caller that waits for it.
//!
//! The fill appends each frame as it arrives ([`Writer::push`]); every reader
//! ([`Reader`]) holds only its place, and takes the frames from there at its own pace,
//! the same `Bytes` for all (never a copy per reader). A reader that joins mid-fill
//! gets the frames so far, then the rest.
//!
//! # What a stream holds
//!
//! While its answer may be stored, a stream holds the whole body (at most the route's
//! `max_body`, which the fill then stores): the fill never waits for a reader, and a
//! slow client holds back neither the fill nor the others (when the fill stores it, its
//! frames are swapped for slices of the stored body: [`Stream::settle`]).
//!
//! Once its answer will not be stored (it says so at its head, or grew past
//! `max_body`), the stream is **bounded** ([`Writer::bound`]) and holds a window:
//!
//! * frames that every reader has read are let go, once the stream holds more than
//!   [`WINDOW`] (below that, its start is kept for the callers that join late);
//! * the fill reads the origin's next frame only while the stream holds less than
//!   [`WINDOW`] beyond its slowest reader ([`Writer::room`]): the readers read in step
//!   with the origin, and the slowest paces the fill;
//! * a reader that held the fill back and did not move for a whole `lag` (the route's
//!   refresh timeout, what the origin is given between two frames) is dropped from it:
//!   its body fails ([`BodyError::FillCut`]), and the others go on (a slow reader that
//!   moves paces them);
//! * a caller of the fill that has not made its reader yet (counted by the flight, see
//!   [`Writer::awaited_by`]) keeps the start held; one that comes after the start was
//!   let go gets no reader ([`Stream::join`] is `None`) and asks the origin itself;
//! * when no caller reads it or waits to for [`DESERTED_AFTER`], the fill stops
//!   ([`Writer::deserted`]) and lets go of the origin's body (closing its connection).
//!
//! So a fill that will not be stored holds at most [`WINDOW`] and a frame, and one that
//! may be, at most `max_body` and then the window.
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

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::sync::Notify;

use super::fill_memory::{FillMemory, OVER_WINDOW};

/// What a bounded stream holds beyond its slowest reader, and how much of its start it
/// keeps for the callers that join late: 1 MiB. Enough for a reader to take frames while
/// the next come (a socket on a fast link holds a few hundred KiB), and small enough
/// that a crowd of fills, each paced by its own slow client, holds little: 16 of them,
/// 16 MiB.
pub(crate) const WINDOW: u64 = 1024 * 1024;

/// How long a bounded stream goes on with no reader, and no caller of its fill waiting
/// to read it, before its fill stops reading the origin: half a second, so that the
/// origin's connection is closed within a second of the last client leaving.
pub(crate) const DESERTED_AFTER: Duration = Duration::from_millis(500);

/// How often a writer that waits looks again at what it waits for (a caller of the fill
/// that gave up before making its reader is counted by the flight, not the stream).
const LOOK_AGAIN: Duration = Duration::from_millis(100);

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
    /// Told when a reader of a bounded stream moved on or went away, while its writer
    /// waits for room.
    freed: Notify,
}

#[derive(Debug, Default)]
struct State {
    /// The frames held, and where each starts in the body.
    frames: VecDeque<Bytes>,
    starts: VecDeque<u64>,
    /// Where the first frame held starts: what comes before was let go (bounded).
    base: u64,
    len: u64,
    end: Option<End>,
    /// The readers waiting for more.
    waiting: Vec<Waker>,
    /// Each reader's place, by slot (`None`: a free slot).
    places: Vec<Option<Place>>,
    /// Set once the stream holds only a window: what it holds beyond its slowest reader.
    window: Option<u64>,
    /// The callers of the fill that have not made their reader yet (see
    /// [`Writer::awaited_by`]).
    awaited: Option<Arc<AtomicUsize>>,
    /// Those callers waited too long: the start may be let go without them.
    start_released: bool,
    /// The writer waits for a reader to move on.
    writer_waits: bool,
    /// Since when nobody reads it, nor waits to (see [`Writer::deserted`]).
    alone_since: Option<tokio::time::Instant>,
    /// The memory of fills it takes what it holds from, and how much it took.
    memory: Option<Arc<FillMemory>>,
    charged: u64,
    /// It could not take the bytes of a frame: it keeps a small window, and shares no
    /// more.
    over_memory: bool,
}

/// A reader's place.
#[derive(Debug, Clone, Copy)]
struct Place {
    at: u64,
    /// It moved since its writer began to wait for room.
    moved: bool,
    /// Dropped from the stream: it held the fill back too long.
    dropped: bool,
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
    slot: usize,
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

/// Whether the writer of a bounded stream may read on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Room {
    /// It may read the next frame.
    Go,
    /// No caller reads it, nor waits to, for [`DESERTED_AFTER`]: stop.
    Deserted,
}

/// What a writer that waits finds, at one look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Look {
    Go,
    /// Held back by readers (or callers yet to read) at the stream's floor.
    Held,
    /// No room, and nobody reads, nor waits to.
    Alone,
}

impl State {
    /// How many callers of the fill have yet to make their reader (none once released).
    fn awaited(&self) -> usize {
        match &self.awaited {
            Some(count) if !self.start_released => count.load(Ordering::Acquire),
            _ => 0,
        }
    }

    fn readers(&self) -> impl Iterator<Item = &Place> {
        self.places.iter().flatten().filter(|place| !place.dropped)
    }

    /// Where the slowest reader is: what may not be let go. The start while a caller has
    /// yet to make its reader; nothing beyond what is held when nobody reads.
    fn floor(&self) -> u64 {
        if self.awaited() > 0 {
            return self.base;
        }
        self.readers()
            .map(|place| place.at)
            .min()
            .unwrap_or(self.base)
    }

    /// Lets go of the frames every reader has read, in a bounded stream that holds more
    /// than its window (or let go of its start already: nobody can join from it).
    fn trim(&mut self) {
        self.let_go();
        self.account();
    }

    fn let_go(&mut self) {
        let Some(window) = self.window else {
            return;
        };
        let floor = self.floor();
        while let (Some(frame), Some(start)) = (self.frames.front(), self.starts.front()) {
            let held = self.len - self.base;
            if start + frame.len() as u64 > floor || (self.base == 0 && held <= window) {
                break;
            }
            self.base = start + frame.len() as u64;
            self.frames.pop_front();
            self.starts.pop_front();
        }
    }

    /// Takes from the memory of fills what it holds beyond what it took, or gives back
    /// what it let go of. What it cannot take bounds it to a small window (see
    /// `fill_memory`).
    fn account(&mut self) {
        let Some(memory) = &self.memory else {
            return;
        };
        let held = self.len - self.base;
        if held < self.charged {
            memory.give(self.charged - held);
            self.charged = held;
        } else if held > self.charged && !self.over_memory {
            if memory.take(held - self.charged) {
                self.charged = held;
            } else {
                self.over_memory = true;
                self.window = Some(self.window.map_or(OVER_WINDOW, |w| w.min(OVER_WINDOW)));
                self.let_go();
            }
        }
    }

    /// Whether a bounded stream's writer may read on.
    fn look(&self) -> Look {
        let Some(window) = self.window else {
            return Look::Go;
        };
        if self.len.saturating_sub(self.floor()) < window {
            Look::Go
        } else if self.awaited() == 0 && self.readers().next().is_none() {
            Look::Alone
        } else {
            Look::Held
        }
    }

    /// Starts a wait for room: every reader's moves are counted from now.
    fn wait_from_here(&mut self) {
        for place in self.places.iter_mut().flatten() {
            place.moved = false;
        }
    }

    /// Drops the readers that hold the stream back and did not move since the wait
    /// began; a start held for callers that have yet to make their reader is let go.
    /// How many were dropped.
    fn drop_stuck(&mut self) -> usize {
        if self.awaited() > 0 {
            self.start_released = true;
        }
        let (len, window) = (self.len, self.window.unwrap_or(0));
        let mut dropped = 0;
        for place in self.places.iter_mut().flatten() {
            if !place.dropped && !place.moved && place.at.saturating_add(window) <= len {
                place.dropped = true;
                dropped += 1;
            }
        }
        self.trim();
        dropped
    }

    /// The frame that holds `at` (held: at or past the base, before the end).
    fn frame_at(&self, at: u64) -> (&Bytes, u64) {
        let index = self.starts.partition_point(|start| *start <= at) - 1;
        (&self.frames[index], self.starts[index])
    }
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
        // one push, one pop or one assignment.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A reader of the whole body, from its start (cut at once if its start was let go:
    /// see [`join`](Self::join)).
    pub(crate) fn reader(self: &Arc<Self>) -> Reader {
        self.range(0, u64::MAX)
    }

    /// A reader of the whole body for a caller that joins the fill: `None` once the
    /// stream let go of its start (it keeps a window, and moved past it): the caller
    /// asks the origin itself.
    pub(crate) fn join(self: &Arc<Self>) -> Option<Reader> {
        // (Looked at and taken under one lock: a reader that moves on meanwhile cannot
        // let the start go between the two.)
        let mut state = self.lock();
        if state.base > 0 {
            return None;
        }
        Some(self.place(&mut state, 0, u64::MAX))
    }

    /// A reader of the bytes from `start` up to `end` (exclusive).
    pub(crate) fn range(self: &Arc<Self>, start: u64, end: u64) -> Reader {
        let mut state = self.lock();
        self.place(&mut state, start, end)
    }

    /// A reader from `start` to `end`, its place taken in `state`.
    fn place(self: &Arc<Self>, state: &mut State, start: u64, end: u64) -> Reader {
        let place = Some(Place {
            at: start,
            moved: true,
            dropped: false,
        });
        let slot = match state.places.iter().position(Option::is_none) {
            Some(slot) => {
                state.places[slot] = place;
                slot
            }
            None => {
                state.places.push(place);
                state.places.len() - 1
            }
        };
        Reader {
            stream: self.clone(),
            slot,
            at: start,
            until: end,
            done: false,
        }
    }

    /// The bytes from `start` up to `end` (which came already): a slice of one frame,
    /// or a copy of the frames they span. Only of a stream that holds its start (one
    /// whose answer may be stored): empty where the bytes were let go.
    pub(crate) fn slice(&self, start: u64, end: u64) -> Bytes {
        let state = self.lock();
        let end = end.min(state.len);
        if start >= end || start < state.base {
            return Bytes::new();
        }
        let first = state.starts.partition_point(|s| *s <= start) - 1;
        let (frame, frame_start) = (&state.frames[first], state.starts[first]);
        if end <= frame_start + frame.len() as u64 {
            return frame.slice((start - frame_start) as usize..(end - frame_start) as usize);
        }
        let mut out = BytesMut::with_capacity((end - start) as usize);
        let frames = state.frames.range(first..).zip(state.starts.range(first..));
        for (frame, frame_start) in frames {
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

    /// Whether it let go of its start: nobody can join it from there.
    pub(crate) fn let_go_of_start(&self) -> bool {
        self.lock().base > 0
    }

    /// Whether it could not take its bytes from the memory of fills (see
    /// [`Writer::over_memory`]).
    pub(crate) fn over_memory(&self) -> bool {
        self.lock().over_memory
    }

    /// How many bytes it holds now.
    #[cfg(test)]
    fn held(&self) -> u64 {
        let state = self.lock();
        state.len - state.base
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
            state.starts.push_back(start);
            state.frames.push_back(data);
            state.trim();
            std::mem::take(&mut state.waiting)
        };
        waiting.into_iter().for_each(Waker::wake);
    }

    /// The callers of the fill that will read the stream and have not made their reader
    /// yet, as their flight counts them: a bounded stream keeps its start for them.
    pub(crate) fn awaited_by(&mut self, callers: Arc<AtomicUsize>) {
        self.stream.lock().awaited = Some(callers);
    }

    /// Takes what the stream holds from `memory` (see `fill_memory`).
    pub(crate) fn charged_to(&mut self, memory: Arc<FillMemory>) {
        let mut state = self.stream.lock();
        state.memory = Some(memory);
        state.account();
    }

    /// From now on the stream holds only a window (see the [module docs](self)): its
    /// answer will not be stored.
    pub(crate) fn bound(&mut self) {
        let mut state = self.stream.lock();
        if state.window.is_none() {
            state.window = Some(WINDOW);
            state.trim();
        }
    }

    /// Waits until a bounded stream has room for the next frame (at once, for one that
    /// is not bounded). The readers that hold it back and did not move for `lag` are
    /// dropped (`dropped` is told how many were), and so is a start kept for callers
    /// that have yet to make their reader; when nobody reads it, nor waits to, for
    /// [`DESERTED_AFTER`], [`Room::Deserted`].
    pub(crate) async fn room(&self, lag: Duration, mut dropped: impl FnMut(usize)) -> Room {
        let mut held_since = None;
        loop {
            let now = tokio::time::Instant::now();
            let (look, alone) = {
                let mut state = self.stream.lock();
                let look = state.look();
                state.writer_waits = look != Look::Go;
                (look, state.alone_for(now))
            };
            match look {
                Look::Go => return Room::Go,
                Look::Alone if alone >= DESERTED_AFTER => return Room::Deserted,
                Look::Alone => held_since = None,
                Look::Held => {
                    let since = *held_since.get_or_insert_with(|| {
                        self.stream.lock().wait_from_here();
                        now
                    });
                    if now - since >= lag {
                        let waiting = {
                            let mut state = self.stream.lock();
                            dropped(state.drop_stuck());
                            std::mem::take(&mut state.waiting)
                        };
                        waiting.into_iter().for_each(Waker::wake);
                        held_since = None;
                        continue;
                    }
                }
            }
            let _ = tokio::time::timeout(LOOK_AGAIN, self.stream.freed.notified()).await;
        }
    }

    /// Resolves once a bounded stream has had no reader, and no caller waiting to read
    /// it, for [`DESERTED_AFTER`]; never for one that is not bounded.
    pub(crate) async fn deserted(&self) {
        loop {
            let alone = {
                let mut state = self.stream.lock();
                if state.window.is_none() {
                    None
                } else {
                    let now = tokio::time::Instant::now();
                    Some(state.alone_for(now))
                }
            };
            match alone {
                None => std::future::pending::<()>().await,
                Some(alone) if alone >= DESERTED_AFTER => return,
                Some(_) => tokio::time::sleep(LOOK_AGAIN).await,
            }
        }
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

    /// The whole body so far, in one buffer of its own (a copy: see [`Stream::settle`]);
    /// `None` once the stream let go of its start (it keeps a window).
    pub(crate) fn gathered(&self) -> Option<Bytes> {
        let state = self.stream.lock();
        if state.base > 0 {
            return None;
        }
        let mut whole = BytesMut::with_capacity(state.len as usize);
        for frame in &state.frames {
            whole.extend_from_slice(frame);
        }
        Some(whole.freeze())
    }
}

impl Drop for State {
    fn drop(&mut self) {
        if let Some(memory) = &self.memory {
            memory.give(self.charged);
        }
    }
}

impl State {
    /// How long nobody has read the stream, nor waited to (zero while someone does).
    fn alone_for(&mut self, now: tokio::time::Instant) -> Duration {
        if self.awaited() > 0 || self.readers().next().is_some() {
            self.alone_since = None;
            return Duration::ZERO;
        }
        now - *self.alone_since.get_or_insert(now)
    }
}

impl Stream {
    /// Swaps the frames of a whole stream for `body`, the same bytes in one buffer (the
    /// body the fill stored): the stream then holds the object once, shared with the
    /// entry. Readers keep their places.
    pub(crate) fn settle(&self, body: &Bytes) {
        let mut state = self.lock();
        if state.end == Some(End::Whole) && state.base == 0 && state.len == body.len() as u64 {
            state.frames = VecDeque::from([body.clone()]);
            state.starts = VecDeque::from([0]);
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
        let dropped = state.places[self.slot].is_some_and(|place| place.dropped);
        // (Dropped for holding the fill back, or joined after its start was let go.)
        if dropped || self.at < state.base {
            self.done = true;
            return Poll::Ready(Next::Cut);
        }
        if self.at < state.len {
            let (frame, start) = state.frame_at(self.at);
            let from = (self.at - start) as usize;
            let to = (frame.len() as u64).min(self.until - start) as usize;
            let data = frame.slice(from..to);
            self.at += data.len() as u64;
            if let Some(place) = &mut state.places[self.slot] {
                place.at = self.at;
                place.moved = true;
            }
            let freed = state.window.is_some() && state.writer_waits;
            state.trim();
            drop(state);
            if freed {
                self.stream.freed.notify_one();
            }
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

impl Drop for Reader {
    fn drop(&mut self) {
        let freed = {
            let mut state = self.stream.lock();
            state.places[self.slot] = None;
            state.trim();
            state.window.is_some()
        };
        if freed {
            self.stream.freed.notify_one();
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

    /// A frame of `len` bytes of `byte`.
    fn frame(byte: u8, len: u64) -> Bytes {
        Bytes::from(vec![byte; len as usize])
    }

    const LAG: Duration = Duration::from_secs(4);

    /// A bounded stream keeps its start up to its window for callers that join late,
    /// then lets go of what every reader read, and holds at most the window (and a
    /// frame) beyond its slowest reader: its writer waits for room.
    #[tokio::test(start_paused = true)]
    async fn a_bounded_stream_holds_a_window_beyond_its_slowest_reader() {
        let mut writer = Stream::writer();
        let stream = writer.stream().clone();
        writer.bound();
        let quarter = WINDOW / 4;
        let mut fast = stream.join().expect("the start is held");
        let mut slow = stream.join().expect("the start is held");
        for n in 0..4 {
            assert_eq!(writer.room(LAG, |_| {}).await, Room::Go);
            writer.push(frame(n, quarter));
        }
        // Read by both, but kept: the stream holds no more than its window.
        for reader in [&mut fast, &mut slow] {
            assert!(matches!(next(reader).await, Next::Data(d) if d.len() as u64 == quarter));
        }
        assert_eq!(stream.held(), WINDOW);
        assert!(
            stream.join().is_some(),
            "a caller may still join from the start"
        );
        // Past the window: what both read is let go, and late callers find no start.
        writer.push(frame(4, quarter));
        assert_eq!(stream.held(), WINDOW);
        assert!(
            stream.join().is_none(),
            "a caller after the start was let go"
        );
        // The slow reader stays where it is: the window beyond it is full.
        for _ in 0..3 {
            assert!(matches!(next(&mut fast).await, Next::Data(_)));
        }
        let room = tokio::time::timeout(Duration::from_secs(1), writer.room(LAG, |_| {}));
        assert!(
            room.await.is_err(),
            "room while the slow reader holds a window"
        );
        // It reads a frame: room for one more.
        assert!(matches!(next(&mut slow).await, Next::Data(d) if d[0] == 1));
        assert_eq!(writer.room(LAG, |_| {}).await, Room::Go);
        assert_eq!(stream.held(), WINDOW - quarter);
    }

    /// A reader that holds the fill back for the whole lag is dropped: its body is cut,
    /// the others read on; a caller of the fill yet to make its reader keeps the start
    /// until then.
    #[tokio::test(start_paused = true)]
    async fn a_reader_that_holds_the_fill_back_for_the_lag_is_cut() {
        let mut writer = Stream::writer();
        let stream = writer.stream().clone();
        let awaited = Arc::new(AtomicUsize::new(1));
        writer.awaited_by(awaited.clone());
        writer.bound();
        let mut stuck = stream.join().unwrap();
        let mut reading = stream.join().unwrap();
        for n in 0..8 {
            writer.push(frame(n, WINDOW / 4));
            while let Next::Data(_) = next(&mut reading).await {
                if reading.at == stream.len() {
                    break;
                }
            }
        }
        // The awaited caller keeps the start: nothing was let go.
        assert_eq!(stream.held(), 2 * WINDOW);
        assert!(stream.join().is_some());
        awaited.store(0, Ordering::Release);
        let started = tokio::time::Instant::now();
        let mut dropped = 0;
        assert_eq!(writer.room(LAG, |n| dropped += n).await, Room::Go);
        assert_eq!(dropped, 1, "the stuck reader, not the one that reads");
        assert!(started.elapsed() >= LAG);
        assert!(matches!(next(&mut stuck).await, Next::Cut));
        assert_eq!(
            stream.held(),
            0,
            "what the reader that reads has read is let go"
        );
        writer.push(frame(9, 4));
        writer.finish();
        assert!(matches!(next(&mut reading).await, Next::Data(d) if d.len() == 4));
        assert!(matches!(next(&mut reading).await, Next::End));
    }

    /// Once nobody reads a bounded stream, nor waits to, its fill is told to stop within
    /// `DESERTED_AFTER`; a stream that may be stored never is.
    #[tokio::test(start_paused = true)]
    async fn a_bounded_stream_nobody_reads_is_deserted() {
        let mut writer = Stream::writer();
        let stream = writer.stream().clone();
        writer.push(frame(0, 10));
        let reader = stream.join().unwrap();
        let unbounded = tokio::time::timeout(Duration::from_secs(60), writer.deserted());
        drop(reader);
        assert!(
            unbounded.await.is_err(),
            "a stream that may be stored is read on"
        );
        writer.bound();
        let reader = stream.join().unwrap();
        let after = {
            let deserted = tokio::time::timeout(Duration::from_secs(10), writer.deserted());
            tokio::pin!(deserted);
            assert!(
                tokio::time::timeout(Duration::from_secs(2), &mut deserted)
                    .await
                    .is_err(),
                "deserted while read"
            );
            let left = tokio::time::Instant::now();
            drop(reader);
            assert!(deserted.await.is_ok());
            left.elapsed()
        };
        assert!(
            after >= DESERTED_AFTER && after < DESERTED_AFTER + LOOK_AGAIN * 2,
            "{after:?}"
        );
        // And a writer that waits for room with nobody reading.
        assert_eq!(writer.room(LAG, |_| {}).await, Room::Go);
        writer.push(frame(1, WINDOW));
        assert_eq!(writer.room(LAG, |_| {}).await, Room::Deserted);
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
        let whole = writer.gathered().unwrap();
        writer.finish();
        stream.settle(&whole);
        assert_eq!(stream.lock().frames.len(), 1);
        assert_eq!(read_all(reader).await, (b"def".to_vec(), true));
        assert_eq!(Stream::whole(whole).reader().left(), Some(6));
    }
}
