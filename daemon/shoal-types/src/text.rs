//! Text from token pieces: a streaming UTF-8 decoder and a matcher of stop sequences
//! on streamed text. Pure; the HTTP API and the CLI share them.

/// Turns a stream of byte pieces into text without splitting a UTF-8 character across
/// two outputs: a piece ending in the middle of a character holds those bytes back
/// until the rest arrives. Invalid bytes become U+FFFD.
#[derive(Default, Debug)]
pub struct Utf8Stream {
    /// Bytes of an incomplete character at the end of the input so far.
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Add bytes; return the text they complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // Invariant: from_utf8 said the first `valid` bytes are UTF-8.
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).expect("valid prefix"));
                    match e.error_len() {
                        // Incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// End of stream: whatever is held back, replaced if incomplete.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

/// Cuts streamed text at the first of a request's stop sequences (OpenAI's `stop`,
/// Ollama's `options.stop`), matched on text, not tokens: a stop sequence may span
/// several tokens, and a token may hold a stop sequence and more. Text that might be
/// the start of a stop sequence is held back until the next piece decides it, so
/// nothing of a stop sequence is ever shown.
#[derive(Debug, Default)]
pub struct StopText {
    /// The stop sequences (never empty strings).
    stops: Vec<String>,
    /// Text received but not yet released: a suffix that a stop sequence may start with.
    held: String,
    /// The stop sequence that ended the text, once one did.
    matched: Option<String>,
}

impl StopText {
    /// A matcher of `stops` (empty strings are ignored).
    pub fn new(stops: impl IntoIterator<Item = String>) -> StopText {
        StopText { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new(), matched: None }
    }

    /// Add `text`; returns the text that can be shown now, and whether a stop sequence
    /// was found (then the text is cut before it, and nothing after it is shown).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        let first = self.stops.iter().filter_map(|s| Some((self.held.find(s.as_str())?, s))).min_by_key(|(at, _)| *at);
        if let Some((at, stop)) = first {
            self.matched = Some(stop.clone());
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        let keep = self.stops.iter().map(|s| overlap(&self.held, s)).max().unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// The stop sequence that ended the text, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// The end of the stream: what was held back is shown after all.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// The length of the longest suffix of `text` (cut at a character boundary) that
/// `stop` starts with, shorter than `stop` itself.
fn overlap(text: &str, stop: &str) -> usize {
    let most = text.len().min(stop.len().saturating_sub(1));
    (1..=most)
        .rev()
        .find(|&k| text.is_char_boundary(text.len() - k) && stop.starts_with(&text[text.len() - k..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::StopText;
    use super::Utf8Stream;

    /// Feed `pieces` through a matcher of `stops`: the text shown, and whether it stopped.
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopText::new(stops.iter().map(|s| s.to_string()));
        let mut out = String::new();
        for p in pieces {
            let (text, stopped) = m.push(p);
            out += &text;
            if stopped {
                return (out, true);
            }
        }
        out += &m.finish();
        (out, false)
    }

    #[test]
    fn a_stop_sequence_across_pieces_is_cut_and_never_shown() {
        assert_eq!(run(&["\n\nUser:"], &["Hi", " there\n", "\nUs", "er: more"]), ("Hi there".into(), true));
        // Held-back text that turns out not to be a stop is shown after all, in order.
        assert_eq!(run(&["STOP"], &["a ST", "OP", "x"]), ("a ".into(), true));
        assert_eq!(run(&["STOP"], &["a ST", "ART"]), ("a START".into(), false));
        assert_eq!(run(&["STOP"], &["a ST"]), ("a ST".into(), false));
        // The earliest of several stops wins; an empty stop is ignored.
        assert_eq!(run(&["", "b", "ab"], &["xxab"]), ("xx".into(), true));
        let mut m = StopText::new(["b".to_string(), "ab".to_string()]);
        assert_eq!(m.push("xxab"), ("xx".to_string(), true));
        assert_eq!(m.matched(), Some("ab"), "the earliest match is the one reported");
        // No stops: everything passes as it comes.
        let mut m = StopText::new(Vec::new());
        assert_eq!(m.push("abc"), ("abc".into(), false));
    }

    #[test]
    fn held_text_is_never_cut_inside_a_character() {
        // "é" is two bytes; the stop "éx" starts with it.
        assert_eq!(run(&["éx"], &["caf", "é", "!"]), ("café!".into(), false));
        assert_eq!(run(&["éx"], &["café", "x"]), ("caf".into(), true));
        let mut m = StopText::new(["🐟!".to_string()]);
        assert_eq!(m.push("a🐟"), ("a".into(), false));
        assert_eq!(m.push("?"), ("🐟?".into(), false));
    }

    #[test]
    fn split_characters_are_held_back() {
        let text = "héllo → 🐟 fish";
        let bytes = text.as_bytes();
        // Every way of cutting the bytes in two gives the same text, never a U+FFFD.
        for cut in 0..=bytes.len() {
            let mut s = Utf8Stream::default();
            let mut out = s.push(&bytes[..cut]);
            assert!(!out.contains('\u{FFFD}'));
            out += &s.push(&bytes[cut..]);
            out += &s.finish();
            assert_eq!(out, text);
        }
        // One byte at a time.
        let mut s = Utf8Stream::default();
        let out: String = bytes.iter().map(|b| s.push(&[*b])).collect();
        assert_eq!(out, text);
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut s = Utf8Stream::default();
        assert_eq!(s.push(b"a\xffb"), "a\u{FFFD}b");
        assert_eq!(s.push(b"\xf0\x9f"), "");
        assert_eq!(s.finish(), "\u{FFFD}");
    }
}
