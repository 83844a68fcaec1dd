//! One generation as every route sees it: tokens from the backend become text (never
//! split inside a UTF-8 character), cut at the request's stop sequences, a reasoning
//! model's thinking kept apart (`thinking`), and end with a finish reason and counts.
//! Routes only shape these events into their API's JSON.

use crate::backend::{Backend, Failure, TextModel};
use crate::thinking::{Part, Released, Splitter};
use shoal_pipeline::GenerateRequest;
use shoal_types::{SamplingParams, StopText, TokenId, TokenLogprobs, Utf8Stream};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// What a route asks for.
pub(crate) struct Job {
    /// The model as the client named it.
    pub model: String,
    /// Its vocabulary.
    pub text: Arc<dyn TextModel>,
    /// The prompt's tokens.
    pub prompt: Vec<TokenId>,
    /// Most tokens to make.
    pub max_tokens: u32,
    /// How to pick them.
    pub sampling: SamplingParams,
    /// Text that ends the answer (not shown).
    pub stop: Vec<String>,
    /// Go on past end-of-generation tokens until `max_tokens` (llama.cpp server's
    /// `ignore_eos`: benchmarks and load tests want a known length).
    pub ignore_eos: bool,
    /// Speculative decoding for this request: `Some(false)` off, `Some(true)` on,
    /// `None` as the node is set (`Backend::speculation`). Not in any API's
    /// specification: Shoal's own field.
    pub speculative: Option<bool>,
    /// Tokens shown as this text rather than their piece: a tool syntax's markers
    /// that are control tokens, which render as nothing
    /// ([`crate::tools::Toolbox::shown_markers`]), so the answer reads back.
    pub shown: Vec<(TokenId, Vec<u8>)>,
    /// Keep the model's thinking apart from its answer ([`Event::Thinking`]), where its
    /// template has thinking ([`TextModel::thinking`]); false leaves the text as it
    /// comes (llama.cpp's `reasoning_format: none`; a raw prompt).
    pub split_thinking: bool,
}

/// What a generation says, in order: text pieces, then one end or failure.
#[derive(Debug)]
pub(crate) enum Event {
    /// More of the answer, and the log-probabilities of the tokens it released (when
    /// the job's sampling asked for them; else empty). A token's entry comes with the
    /// first text after it: text held back (a partial UTF-8 character, a possible stop
    /// sequence) carries its tokens' entries along, and the tokens that completed a stop
    /// sequence come with the text before it; end-of-generation tokens have none.
    Text(String, Vec<Logprob>),
    /// More of the model's thinking (apart from the answer: see [`Job::split_thinking`]).
    /// Its tokens' log-probabilities are not listed.
    Thinking(String),
    /// The answer is complete.
    End(Outcome),
    /// It failed (before any text: the route answers with the failure's status).
    Failed(Failure),
}

/// One generated token's log-probability and the most likely tokens at its step.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Logprob {
    /// The token's bytes (maybe part of a UTF-8 character).
    pub bytes: Vec<u8>,
    /// Its natural-log probability.
    pub logprob: f32,
    /// The most likely tokens' bytes and theirs, most likely first.
    pub top: Vec<(Vec<u8>, f32)>,
}

impl Logprob {
    /// The entry of a token whose bytes are `piece` (the alternatives' from `text`).
    fn new(text: &dyn TextModel, piece: Vec<u8>, lp: TokenLogprobs) -> Logprob {
        Logprob {
            bytes: piece,
            logprob: lp.logprob,
            top: lp.top.into_iter().map(|(t, x)| (text.piece(t), x)).collect(),
        }
    }
}

/// The entries of the tokens that make up `span` (bytes) of an answer whose text is
/// `text_len` bytes long and whose tokens are `entries` (in order, each token's bytes as
/// it released them): all of them for the whole answer (a stop sequence's tokens
/// included, as a reply without tools lists them); else every token that overlaps the
/// span, so a token that straddles its edge (a marker and the reply's first
/// character in one token) is listed whole, with its own log-probability.
pub(crate) fn logprobs_within(entries: &[Logprob], text_len: usize, span: std::ops::Range<usize>) -> &[Logprob] {
    if span == (0..text_len) {
        return entries;
    }
    if span.is_empty() {
        return &[];
    }
    let (mut first, mut end, mut at) = (None, 0, 0);
    for (i, e) in entries.iter().enumerate() {
        let next = at + e.bytes.len();
        if next > span.start && at < span.end {
            first.get_or_insert(i);
            end = i + 1;
        }
        at = next;
    }
    match first {
        Some(first) => &entries[first..end],
        None => &[],
    }
}

/// How a generation ended.
#[derive(Clone, Debug)]
pub(crate) struct Outcome {
    /// Why it stopped.
    pub finish: Finish,
    /// The stop sequence that ended it, if one did.
    pub stop_sequence: Option<String>,
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Tokens generated (a stop sequence's included).
    pub completion_tokens: usize,
    /// The prompt's processing (request to first token).
    pub prefill: Duration,
    /// First token to last.
    pub decode: Duration,
    /// The whole request.
    pub total: Duration,
}

/// Why a generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Finish {
    /// An end-of-generation token or a stop sequence.
    Stop,
    /// `max_tokens` reached.
    Length,
}

impl Finish {
    /// As OpenAI and Ollama spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// Start `job` and wait for its first event; the rest arrive on the returned channel.
/// A failure before any text is the error (the route answers with its status).
/// Dropping the receiver (a client that went away) cancels the generation.
pub(crate) async fn start<B: Backend>(backend: Arc<B>, job: Job) -> Result<(Event, mpsc::Receiver<Event>), Failure> {
    // Out-of-range sampling parameters are the client's mistake: a 400 here, before
    // any node sees them (the coordinator would refuse them too, later and farther).
    job.sampling.validate().map_err(|e| Failure::bad(e.to_string()))?;
    // A few events of slack: the stream to the client drains it as fast as it can.
    let (tx, mut rx) = mpsc::channel(16);
    tokio::spawn(run(backend, job, tx));
    match rx.recv().await.ok_or_else(vanished)? {
        Event::Failed(f) => Err(f),
        first => Ok((first, rx)),
    }
}

/// The whole answer of a generation whose first event was `first`: its text, thinking,
/// tokens' log-probabilities (empty unless asked for) and how it ended.
pub(crate) async fn collect(first: Event, events: &mut mpsc::Receiver<Event>) -> Result<Whole, Failure> {
    let (mut text, mut thinking, mut logprobs) = (String::new(), String::new(), Vec::new());
    let mut event = first;
    loop {
        match event {
            Event::Text(t, lp) => {
                text += &t;
                logprobs.extend(lp);
            }
            Event::Thinking(t) => thinking += &t,
            Event::End(outcome) => return Ok(Whole { text, thinking, logprobs, outcome }),
            Event::Failed(f) => return Err(f),
        }
        event = events.recv().await.ok_or_else(vanished)?;
    }
}

/// A whole answer, as [`collect`] gathers it.
pub(crate) struct Whole {
    /// The answer's text (without the thinking, where it is kept apart).
    pub text: String,
    /// The model's thinking, where it is kept apart (else empty).
    pub thinking: String,
    /// The answer's tokens' log-probabilities (empty unless asked for).
    pub logprobs: Vec<Logprob>,
    /// How it ended.
    pub outcome: Outcome,
}

/// The generation's task ended without a last event (it cannot, unless it panicked).
fn vanished() -> Failure {
    Failure::new(crate::FailureKind::Internal, "the generation vanished")
}

async fn run<B: Backend>(backend: Arc<B>, job: Job, events: mpsc::Sender<Event>) {
    let t0 = Instant::now();
    let _in_flight = backend.metrics().started();
    let eog = if job.ignore_eos { Vec::new() } else { job.text.eog_tokens() };
    let request = GenerateRequest {
        prompt: job.prompt.clone(),
        max_new: job.max_tokens,
        stop: eog.clone(),
        sampling: serde_json::to_value(job.sampling).unwrap_or_default(),
        resume: Vec::new(),
        speculative: match job.speculative {
            Some(false) => None,
            Some(true) => Some(backend.speculation().unwrap_or_default()),
            None => backend.speculation(),
        }
        .map(|s| backend.fit_speculation(&job.model, s)),
        // The node that runs it tags it (for its resumptions).
        tag: None,
    };
    let (token_tx, mut tokens) = mpsc::unbounded_channel();
    let generation = backend.generate(&job.model, request, token_tx);
    tokio::pin!(generation);
    let mut utf8 = Utf8Stream::default();
    let mut stops = StopText::new(job.stop);
    // The thinking's markers that are control tokens are shown as their text, so the
    // answer can be split (and, when it is not, read).
    let syntax = job.text.thinking();
    let mut shown = job.shown;
    for (t, m) in crate::thinking::shown_markers(&*job.text, syntax.markers()) {
        if !shown.iter().any(|(s, _)| *s == t) {
            shown.push((t, m));
        }
    }
    let piece_of = |t: TokenId| match shown.iter().find(|(s, _)| *s == t) {
        Some((_, text)) => text.clone(),
        None => job.text.piece(t),
    };
    let mut splitter = if job.split_thinking {
        // The prompt's last tokens say whether it opened the thinking.
        let tail: Vec<u8> = job.prompt.iter().rev().take(16).rev().flat_map(|&t| piece_of(t)).collect();
        Splitter::new(syntax, Splitter::opens(syntax, &String::from_utf8_lossy(&tail)))
    } else {
        None
    };
    let mut made = 0usize;
    let mut last = None;
    let (mut first_at, mut last_at) = (None, t0);
    let mut result = None;
    let mut stopped_by_text = false;
    // Entries of tokens whose text is not out yet.
    let mut scored = Vec::new();
    loop {
        tokio::select! {
            r = &mut generation, if result.is_none() => result = Some(r),
            t = tokens.recv() => {
                // The channel closes when the generation is over and dropped its sender.
                let Some((t, lp)) = t else { break };
                backend.metrics().token();
                made += 1;
                last = Some(t);
                last_at = Instant::now();
                first_at.get_or_insert(last_at);
                if eog.contains(&t) {
                    continue;
                }
                let piece = piece_of(t);
                let (text, stop) = stops.push(&utf8.push(&piece));
                scored.extend(lp.map(|lp| Logprob::new(&*job.text, piece, lp)));
                if send(&events, released(splitter.as_mut(), text, false), &mut scored).await.is_err() {
                    // The client went away: returning drops (cancels) the generation.
                    return;
                }
                if stop {
                    stopped_by_text = true;
                    break;
                }
            }
        }
    }
    // A stop sequence ends the answer here; the generation is dropped (cancelled).
    let result = match result {
        Some(r) => r.map(drop),
        None if stopped_by_text => Ok(()),
        None => generation.await.map(drop),
    };
    drop(tokens);
    if let Err(f) = result {
        let _ = events.send(Event::Failed(f)).await;
        return;
    }
    if !stopped_by_text {
        let (text, _) = stops.push(&utf8.finish());
        let text = text + &stops.finish();
        let out = released(splitter.as_mut(), text, true);
        // The last tokens' entries come with the last text (or alone).
        if send(&events, out, &mut scored).await.is_err()
            || (!scored.is_empty() && events.send(Event::Text(String::new(), scored)).await.is_err())
        {
            return;
        }
    } else if let Some(s) = splitter.as_mut() {
        // A stop sequence ended it: what the splitter holds is released.
        if send(&events, s.finish(), &mut scored).await.is_err() {
            return;
        }
    }
    let ended_by_eog = last.is_some_and(|t| eog.contains(&t));
    let finish =
        if stopped_by_text || ended_by_eog || made < job.max_tokens as usize { Finish::Stop } else { Finish::Length };
    let first_at = first_at.unwrap_or(last_at);
    backend.metrics().finished(&job.model, job.prompt.len(), made, first_at - t0, last_at - first_at);
    let _ = events
        .send(Event::End(Outcome {
            finish,
            stop_sequence: stops.matched().map(str::to_string),
            prompt_tokens: job.prompt.len(),
            completion_tokens: made,
            prefill: first_at - t0,
            decode: last_at - first_at,
            total: t0.elapsed(),
        }))
        .await;
}

/// What `text`, the answer's next text (its last when `end`), releases: through
/// `splitter` where the thinking is kept apart, else all of it as content.
fn released(splitter: Option<&mut Splitter>, text: String, end: bool) -> Released {
    let Some(s) = splitter else {
        let parts = if text.is_empty() { Vec::new() } else { vec![Part::Content(text)] };
        return Released { parts, content_began: false };
    };
    let mut out = s.push(&text);
    if end {
        let last = s.finish();
        out.content_began |= last.content_began;
        out.parts.extend(last.parts);
    }
    out
}

/// Send `out`'s parts as events, content with the entries `scored` holds: a part of
/// thinking takes its tokens' entries away (they are not the answer's), and the
/// answer's first content after markup keeps only the last token's (the tokens
/// before it were the markup's). Err when the client went away.
async fn send(events: &mpsc::Sender<Event>, out: Released, scored: &mut Vec<Logprob>) -> Result<(), ()> {
    if out.content_began && scored.len() > 1 {
        scored.drain(..scored.len() - 1);
    }
    for part in out.parts {
        let event = match part {
            Part::Thinking(t) => {
                if !out.content_began {
                    scored.clear();
                }
                Event::Thinking(t)
            }
            Part::Content(c) => Event::Text(c, std::mem::take(scored)),
        };
        events.send(event).await.map_err(drop)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reply inside an answer lists its tokens: all for the whole answer, those that
    /// overlap a part of it (a token across its edge whole), none for an empty part.
    #[test]
    fn a_spans_tokens_are_those_that_overlap_it() {
        let e = |s: &str| Logprob { bytes: s.as_bytes().to_vec(), logprob: -1.0, top: Vec::new() };
        // "<R>Hi.</R>" then a stop sequence's token past the text.
        let entries = [e("<R>"), e("Hi"), e("."), e("</R>"), e("STOP")];
        let text_len = "<R>Hi.</R>".len();
        assert_eq!(logprobs_within(&entries, text_len, 0..text_len), &entries[..]);
        assert_eq!(logprobs_within(&entries, text_len, 3..6), &entries[1..3]);
        // Starting inside "Hi": the token is listed whole.
        assert_eq!(logprobs_within(&entries, text_len, 4..6), &entries[1..3]);
        assert!(logprobs_within(&entries, text_len, 6..6).is_empty());
    }
}
