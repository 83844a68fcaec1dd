//! A reasoning model's thinking kept apart from its answer. The syntax is read off the
//! chat template ([`ThinkingSyntax::of`], as [`crate::ToolSyntax::of`] reads the tool
//! syntax): `<think>…</think>` (Qwen 3, QwQ, DeepSeek R1, SmolLM3 …), Command R7B's
//! `<|START_THINKING|>…<|END_THINKING|>`, Magistral's `[THINK]…[/THINK]`, or gpt-oss's
//! harmony channels (`analysis` is thinking, `final` the answer, a `commentary` message
//! to `functions.NAME` a tool call). [`Splitter`] cuts the answer's text as it streams,
//! never releasing a part of a marker it may still complete. Pure.

/// How a model's template writes its thinking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ThinkingSyntax {
    /// It has none: the answer is all content.
    None,
    /// Thinking between an opening and a closing tag at the start of the answer.
    Tags {
        /// The opening tag (`<think>`).
        open: &'static str,
        /// The closing tag (`</think>`).
        close: &'static str,
    },
    /// OpenAI's harmony format (gpt-oss): messages `<|channel|>NAME<|message|>…<|end|>`,
    /// `analysis` for thinking, `final` for the answer, and tool calls in `commentary`
    /// messages addressed `to=functions.NAME`.
    Harmony,
}

/// `<think>` tags.
const THINK: [&str; 2] = ["<think>", "</think>"];
/// Command R7B's thinking markers.
const COHERE: [&str; 2] = ["<|START_THINKING|>", "<|END_THINKING|>"];
/// Mistral's reasoning models' (Magistral's, Ministral 3 Reasoning's) markers.
const MISTRAL: [&str; 2] = ["[THINK]", "[/THINK]"];

/// Harmony's markers, as the answer shows them (see [`ThinkingSyntax::markers`]).
pub(crate) mod harmony {
    /// Opens a message's header.
    pub const START: &str = "<|start|>";
    /// Names the channel in a header.
    pub const CHANNEL: &str = "<|channel|>";
    /// Ends the header, starts the body.
    pub const MESSAGE: &str = "<|message|>";
    /// Ends a message.
    pub const END: &str = "<|end|>";
    /// Ends the answer (end of generation).
    pub const RETURN: &str = "<|return|>";
    /// Ends a tool call (end of generation).
    pub const CALL: &str = "<|call|>";
    /// Says the arguments' format (`<|constrain|>json`).
    pub const CONSTRAIN: &str = "<|constrain|>";
    /// How a header addresses a function.
    pub const TO_FUNCTIONS: &str = "to=functions.";
}

impl ThinkingSyntax {
    /// The syntax of a Jinja chat template: harmony's when it writes `<|channel|>` and
    /// `<|message|>` messages; `<think>` tags when it writes `</think>`; Command R7B's
    /// when it writes `<|END_THINKING|>`; Mistral's when it writes `[/THINK]`; none
    /// otherwise.
    pub fn of(template: &str) -> ThinkingSyntax {
        if template.contains(harmony::CHANNEL) && template.contains(harmony::MESSAGE) {
            return ThinkingSyntax::Harmony;
        }
        [THINK, COHERE, MISTRAL]
            .into_iter()
            .find(|[_, close]| template.contains(close))
            .map_or(ThinkingSyntax::None, |[open, close]| ThinkingSyntax::Tags { open, close })
    }

    /// The markers the answer must show as their text to be split (those that are
    /// control tokens render as nothing: [`shown_markers`] finds them).
    pub(crate) fn markers(self) -> &'static [&'static str] {
        match self {
            ThinkingSyntax::None => &[],
            ThinkingSyntax::Tags { open, .. } => match [THINK, COHERE, MISTRAL].iter().position(|[o, _]| *o == open) {
                Some(0) => &THINK,
                Some(1) => &COHERE,
                Some(_) => &MISTRAL,
                None => &[],
            },
            ThinkingSyntax::Harmony => &[
                harmony::START,
                harmony::CHANNEL,
                harmony::MESSAGE,
                harmony::END,
                harmony::CONSTRAIN,
                harmony::RETURN,
                harmony::CALL,
            ],
        }
    }
}

/// The tokens of `text`'s vocabulary that are one of `markers` and render as nothing
/// (control tokens), with the marker's text: a generation shows them as that text, so
/// that the answer can be read (llama.cpp's server keeps such "preserved tokens" too).
pub(crate) fn shown_markers(text: &dyn crate::TextModel, markers: &[&str]) -> Vec<(shoal_types::TokenId, Vec<u8>)> {
    // What tokenizing adds to any text (the BOS, where the model wants one).
    let added = text.tokenize("", true);
    markers
        .iter()
        .filter_map(|m| {
            let tokens = text.tokenize(m, true);
            match tokens.strip_prefix(added.as_slice()) {
                Some(&[t]) if text.piece(t).is_empty() => Some((t, m.as_bytes().to_vec())),
                _ => None,
            }
        })
        .collect()
}

/// A part of the answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    /// The model's thinking.
    Thinking(String),
    /// The answer itself (in harmony, a tool call's message as written, for the reader).
    Content(String),
}

/// What one push released.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Released {
    /// The parts, in order.
    pub parts: Vec<Part>,
    /// Whether the answer's first content is among them after markup the splitter took
    /// out (a tag, a header): the tokens before it were not the content's.
    pub content_began: bool,
}

/// Where a [`Splitter`] is in the answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Before anything but white space: thinking may open.
    Start,
    /// Inside the thinking (`fresh`: nothing of it out yet, so white space is dropped).
    Thinking { fresh: bool },
    /// After the closing tag: white space before the answer is dropped.
    Closed,
    /// The answer.
    Answer,
    /// Harmony: a message's header, up to `<|message|>`.
    Header,
    /// Harmony: a message's body, in the part it goes to.
    Body(Channel),
}

/// Where a harmony message's body goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Channel {
    /// `analysis`: thinking.
    Thinking,
    /// `final`, or commentary for the user: the answer.
    Content,
    /// A call (`to=functions.NAME`): written out whole, for the tool reader.
    Call,
}

/// Cuts an answer's text into thinking and content as it streams.
#[derive(Debug)]
pub(crate) struct Splitter {
    syntax: ThinkingSyntax,
    state: State,
    /// Text not released yet (a possible marker, white space that may be dropped).
    held: String,
    /// Whether markup was taken out before any content.
    swallowed: bool,
    /// Whether content went out.
    content_out: bool,
}

impl Splitter {
    /// A splitter for an answer in `syntax` that starts inside the thinking when
    /// `starts_open` (the prompt opened it: DeepSeek R1's and QwQ's templates end with
    /// `<think>\n`). None for a syntax without thinking.
    pub fn new(syntax: ThinkingSyntax, starts_open: bool) -> Option<Splitter> {
        let state = match syntax {
            ThinkingSyntax::None => return None,
            ThinkingSyntax::Tags { .. } if starts_open => State::Thinking { fresh: true },
            ThinkingSyntax::Tags { .. } => State::Start,
            ThinkingSyntax::Harmony => State::Header,
        };
        Some(Splitter { syntax, state, held: String::new(), swallowed: starts_open, content_out: false })
    }

    /// Whether a prompt whose end renders as `tail` leaves the answer inside the
    /// thinking: it ends with the opening tag (white space aside).
    pub fn opens(syntax: ThinkingSyntax, tail: &str) -> bool {
        match syntax {
            ThinkingSyntax::Tags { open, .. } => tail.trim_end().ends_with(open),
            ThinkingSyntax::None | ThinkingSyntax::Harmony => false,
        }
    }

    /// The parts that `text`, the answer's next text, releases.
    pub fn push(&mut self, text: &str) -> Released {
        self.held.push_str(text);
        let mut out = Released::default();
        self.run(&mut out, false);
        out
    }

    /// The parts of whatever is held at the end of the answer.
    pub fn finish(&mut self) -> Released {
        let mut out = Released::default();
        self.run(&mut out, true);
        out
    }

    fn emit(&mut self, out: &mut Released, part: Part) {
        match part {
            Part::Thinking(t) if t.is_empty() => {}
            Part::Content(c) if c.is_empty() => {}
            Part::Thinking(t) => match out.parts.last_mut() {
                Some(Part::Thinking(prev)) => prev.push_str(&t),
                _ => out.parts.push(Part::Thinking(t)),
            },
            Part::Content(c) => {
                if !self.content_out {
                    self.content_out = true;
                    out.content_began = self.swallowed;
                }
                match out.parts.last_mut() {
                    Some(Part::Content(prev)) => prev.push_str(&c),
                    _ => out.parts.push(Part::Content(c)),
                }
            }
        }
    }

    /// Release what can be released (all of it when `end`).
    fn run(&mut self, out: &mut Released, end: bool) {
        loop {
            match self.state {
                State::Start => {
                    let ThinkingSyntax::Tags { open, .. } = self.syntax else { return };
                    let rest = self.held.trim_start();
                    if let Some(after) = rest.strip_prefix(open) {
                        self.held = after.to_string();
                        self.swallowed = true;
                        self.state = State::Thinking { fresh: true };
                    } else if !end && open.starts_with(rest) {
                        // Nothing but white space and maybe the tag's start: wait.
                        return;
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Thinking { fresh } => {
                    let ThinkingSyntax::Tags { close, .. } = self.syntax else { return };
                    if fresh {
                        self.held = self.held.trim_start().to_string();
                        if self.held.is_empty() {
                            return;
                        }
                        self.state = State::Thinking { fresh: false };
                    }
                    if let Some(at) = self.held.find(close) {
                        let thought = self.held[..at].trim_end().to_string();
                        self.held.drain(..at + close.len());
                        self.emit(out, Part::Thinking(thought));
                        self.swallowed = true;
                        self.state = State::Closed;
                        continue;
                    }
                    if end {
                        let thought = std::mem::take(&mut self.held).trim_end().to_string();
                        self.emit(out, Part::Thinking(thought));
                        return;
                    }
                    // Hold back a possible start of the closing tag and the white
                    // space before it (the thinking's last white space is dropped).
                    let keep = partial_suffix(&self.held, &[close]);
                    let cut = self.held[..self.held.len() - keep].trim_end().len();
                    let thought: String = self.held.drain(..cut).collect();
                    self.emit(out, Part::Thinking(thought));
                    return;
                }
                State::Closed => {
                    let rest = self.held.trim_start();
                    if rest.is_empty() {
                        self.held.clear();
                        return;
                    }
                    self.held = rest.to_string();
                    self.state = State::Answer;
                }
                State::Answer => {
                    let all = std::mem::take(&mut self.held);
                    self.emit(out, Part::Content(all));
                    return;
                }
                State::Header => {
                    let Some(at) = self.held.find(harmony::MESSAGE) else {
                        // Text no header starts so (a grammar's JSON answer, words
                        // without channels) is the answer, streamed as it comes: a
                        // header starts with a marker, a recipient or the role.
                        let rest = self.held.trim_start();
                        let header_like =
                            ["<|", "to=", "assistant"].iter().any(|m| rest.starts_with(m) || m.starts_with(rest));
                        if !header_like {
                            self.state = State::Answer;
                            continue;
                        }
                        if end {
                            // Text that never became a message: the answer as it came.
                            let all = std::mem::take(&mut self.held);
                            self.emit(out, Part::Content(all));
                        }
                        return;
                    };
                    let header = self.held[..at].to_string();
                    let channel = channel_of(&header);
                    if channel == Channel::Call {
                        // The call's header goes to the reader with its body (less the
                        // start of the assistant's message, which every message has).
                        let whole: String = self.held.drain(..at + harmony::MESSAGE.len()).collect();
                        let header = whole.strip_prefix(harmony::START).unwrap_or(&whole);
                        let header = header.strip_prefix("assistant").unwrap_or(header);
                        self.emit(out, Part::Content(header.to_string()));
                    } else {
                        self.held.drain(..at + harmony::MESSAGE.len());
                        self.swallowed = true;
                    }
                    self.state = State::Body(channel);
                }
                State::Body(channel) => {
                    const ENDS: [&str; 4] = [harmony::END, harmony::START, harmony::RETURN, harmony::CALL];
                    let ended = ENDS.iter().filter_map(|m| Some((self.held.find(m)?, m.len()))).min();
                    let (body, rest_from) = match ended {
                        Some((at, len)) => (self.held[..at].to_string(), Some(at + len)),
                        None if end => (std::mem::take(&mut self.held), None),
                        None => {
                            let keep = partial_suffix(&self.held, &ENDS);
                            let body: String = self.held.drain(..self.held.len() - keep).collect();
                            (body, None)
                        }
                    };
                    let part = match channel {
                        Channel::Thinking => Part::Thinking(body),
                        Channel::Content | Channel::Call => Part::Content(body),
                    };
                    self.emit(out, part);
                    let Some(from) = rest_from else { return };
                    if channel == Channel::Call {
                        self.emit(out, Part::Content(harmony::CALL.to_string()));
                    }
                    self.held.drain(..from);
                    self.state = State::Header;
                }
            }
        }
    }
}

/// The channel a harmony header (`<|channel|>analysis`, `assistant<|channel|>final`,
/// `<|channel|>commentary to=functions.f <|constrain|>json`, ` to=functions.f<|channel|>commentary json`)
/// sends its body to.
fn channel_of(header: &str) -> Channel {
    if header.contains(harmony::TO_FUNCTIONS) {
        return Channel::Call;
    }
    let name = header
        .split_once(harmony::CHANNEL)
        .map(|(_, c)| c.trim_start().split(|c: char| c.is_whitespace() || c == '<').next().unwrap_or_default());
    match name {
        Some("analysis") => Channel::Thinking,
        _ => Channel::Content,
    }
}

/// The length of the longest end of `text` that is a proper start of one of `markers`
/// (markers are ASCII, so the cut falls between characters).
fn partial_suffix(text: &str, markers: &[&str]) -> usize {
    markers.iter().flat_map(|m| (1..m.len()).filter(|&k| text.ends_with(&m[..k]))).max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TAGS: ThinkingSyntax = ThinkingSyntax::Tags { open: "<think>", close: "</think>" };

    /// The parts of `pieces` pushed one by one, adjacent parts of a kind joined.
    fn split(syntax: ThinkingSyntax, open: bool, pieces: &[&str]) -> (String, String) {
        let mut s = Splitter::new(syntax, open).unwrap();
        let (mut thinking, mut content) = (String::new(), String::new());
        let mut take = |r: Released| {
            for p in r.parts {
                match p {
                    Part::Thinking(t) => thinking += &t,
                    Part::Content(c) => content += &c,
                }
            }
        };
        for p in pieces {
            take(s.push(p));
        }
        take(s.finish());
        (thinking, content)
    }

    #[test]
    fn the_syntax_is_read_off_the_template() {
        assert_eq!(ThinkingSyntax::of("{{ '<|im_start|>assistant\\n' }}"), ThinkingSyntax::None);
        assert_eq!(ThinkingSyntax::of("{{ '<think>\\n\\n</think>\\n\\n' }}"), TAGS);
        assert!(matches!(
            ThinkingSyntax::of("<|START_THINKING|>{{ x }}<|END_THINKING|>"),
            ThinkingSyntax::Tags { open: "<|START_THINKING|>", .. }
        ));
        assert_eq!(ThinkingSyntax::of("<|start|>assistant<|channel|>final<|message|>"), ThinkingSyntax::Harmony);
        let mistral = ThinkingSyntax::of("[THINK]{{ m.thinking }}[/THINK]");
        assert_eq!(mistral, ThinkingSyntax::Tags { open: "[THINK]", close: "[/THINK]" });
        assert_eq!(mistral.markers(), ["[THINK]", "[/THINK]"]);
        assert_eq!(TAGS.markers(), ["<think>", "</think>"]);
    }

    #[test]
    fn tags_split_whatever_the_pieces() {
        let whole = "<think>\nLet me see.\n</think>\n\nHello.";
        // Every way to cut the text in two gives the same parts.
        for i in 0..=whole.len() {
            let (a, b) = whole.split_at(i);
            assert_eq!(split(TAGS, false, &[a, b]), ("Let me see.".into(), "Hello.".into()), "cut at {i}");
        }
        let chars: Vec<String> = whole.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(split(TAGS, false, &pieces), ("Let me see.".into(), "Hello.".into()));
        // Opened by the prompt.
        assert_eq!(split(TAGS, true, &["Hmm", ".</th", "ink>Hi"]), ("Hmm.".into(), "Hi".into()));
        // No thinking: all of it, white space too, is the answer.
        assert_eq!(split(TAGS, false, &[" Hi <think>"]), (String::new(), " Hi <think>".into()));
        assert_eq!(split(TAGS, false, &[" <thi", "s"]), (String::new(), " <this".into()));
        // Cut inside the thinking: all of it is thinking (a held tag start too).
        assert_eq!(split(TAGS, false, &["<think>So", " </thi"]), ("So </thi".into(), String::new()));
    }

    /// No piece releases a part of a closing tag as thinking or content.
    #[test]
    fn a_partial_tag_is_held_back() {
        let mut s = Splitter::new(TAGS, true).unwrap();
        assert_eq!(s.push("Hmm </").parts, vec![Part::Thinking("Hmm".into())]);
        let r = s.push("think>\n");
        assert!(r.parts.is_empty());
        let r = s.push("Yes");
        assert_eq!(r.parts, vec![Part::Content("Yes".into())]);
        assert!(r.content_began);
    }

    #[test]
    fn harmony_channels_split() {
        let h = ThinkingSyntax::Harmony;
        let whole =
            "<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final<|message|>Hello!";
        for i in 0..=whole.len() {
            let (a, b) = whole.split_at(i);
            assert_eq!(split(h, false, &[a, b]), ("The user greets.".into(), "Hello!".into()), "cut at {i}");
        }
        assert_eq!(split(h, false, &["<|channel|>final<|message|>Hi<|return|>"]), (String::new(), "Hi".into()));
        // A call is written out for the reader, its end marked.
        let call = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 1}";
        assert_eq!(
            split(h, false, &["<|channel|>analysis<|message|>Call f.<|end|><|start|>assistant", call]),
            ("Call f.".into(), call.to_string())
        );
        // Text that is not harmony's: the answer as it came.
        assert_eq!(split(h, false, &["Hello"]), (String::new(), "Hello".into()));
        // And as it comes (a JSON answer held to a grammar has no header): nothing is
        // held back for a header that never starts.
        let mut s = Splitter::new(h, false).unwrap();
        let r = s.push("{\"a\": ");
        assert!(matches!(&r.parts[..], [Part::Content(c)] if c == "{\"a\": "), "{:?}", r.parts);
        // A recipient before the channel still reads as a header.
        let call = " to=functions.f<|channel|>commentary json<|message|>{}";
        assert_eq!(
            split(h, false, &[" to", "=functions.f<|channel|>commentary json<|message|>{}"]),
            (String::new(), call.into())
        );
    }
}
