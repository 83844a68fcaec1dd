//! Progress of the CLI's long work (hashing a model, downloading one, loading a model
//! across the cluster) on stderr: bars with a rate and the time left when stderr is a
//! terminal (indicatif), plain lines otherwise, so that logs and CI see where the work
//! stands without control characters.

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// How often plain output prints a line at most, besides every tenth of the work.
const PLAIN_EVERY: Duration = Duration::from_secs(5);

/// Whether progress is drawn as bars (stderr is a terminal).
pub fn is_terminal() -> bool {
    std::io::stderr().is_terminal()
}

/// The progress of one piece of work counted in bytes (hashing, downloading).
pub struct Bytes {
    /// What is being done, for plain lines ("hashing model.gguf").
    what: String,
    /// The bar, on a terminal (from the first figure on).
    bar: Option<ProgressBar>,
    /// Plain output: when the last line was printed and at which tenth.
    plain: Option<(Instant, u64)>,
}

impl Bytes {
    /// Progress of `what`, drawn on stderr from the first [`Bytes::set`] on.
    pub fn new(what: impl Into<String>) -> Bytes {
        Bytes { what: what.into(), bar: None, plain: None }
    }

    /// `done` bytes of `total` (when known).
    pub fn set(&mut self, done: u64, total: Option<u64>) {
        if self.bar.is_none() && is_terminal() {
            // Created at the first figure, so that the bar never shows "0 B/0 B".
            let bar = ProgressBar::with_draw_target(total, ProgressDrawTarget::stderr());
            bar.set_style(bytes_style());
            bar.set_message(self.what.clone());
            self.bar = Some(bar);
        }
        if let Some(bar) = &self.bar {
            if let Some(total) = total {
                if bar.length() != Some(total) {
                    bar.set_length(total);
                }
            }
            bar.set_position(done);
            return;
        }
        let tenth = total.filter(|t| *t > 0).map_or(0, |t| done.saturating_mul(10) / t);
        let due = match self.plain {
            None => true,
            Some((at, last)) => tenth > last || at.elapsed() >= PLAIN_EVERY,
        };
        if due {
            self.plain = Some((Instant::now(), tenth));
            eprintln!("[shoal] {}: {}", self.what, plain_bytes(done, total));
        }
    }

    /// The work is over: the bar stays with `message`; plain output prints it.
    pub fn finish(self, message: &str) {
        match self.bar {
            Some(bar) => bar.finish_with_message(format!("{}: {message}", self.what)),
            None => eprintln!("[shoal] {}: {message}", self.what),
        }
    }

    /// The work failed: the bar is cleared (the error says what happened).
    pub fn abandon(self) {
        if let Some(bar) = self.bar {
            bar.abandon();
        }
    }
}

/// "1.2 GiB of 4.0 GiB (30%)", or "1.2 GiB" without a total.
fn plain_bytes(done: u64, total: Option<u64>) -> String {
    use shoal_types::fmt_size;
    match total.filter(|t| *t > 0) {
        Some(t) => format!("{} of {} ({:.0}%)", fmt_size(done), fmt_size(t), done as f64 * 100.0 / t as f64),
        None => fmt_size(done),
    }
}

fn bytes_style() -> ProgressStyle {
    ProgressStyle::with_template(
        "{msg} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec}, {eta} left",
    )
    // The template is a constant that parses (the progress test draws it).
    .expect("a valid template")
    .progress_chars("=> ")
}

/// Several lines of progress at once, one per stage of a model being loaded: each
/// line's text is replaced as its state moves (measuring, fetching n/m chunks, loading,
/// running), with a bar where a count is known.
pub struct Lines {
    /// The bars, on a terminal.
    multi: Option<(MultiProgress, Vec<ProgressBar>)>,
    /// Plain output: the text last printed for each line.
    last: Vec<String>,
}

impl Lines {
    /// `n` lines of progress.
    pub fn new(n: usize) -> Lines {
        let multi = is_terminal().then(|| {
            let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
            let bars = (0..n)
                .map(|_| {
                    let bar = multi.add(ProgressBar::new(0));
                    bar.set_style(line_style(false));
                    bar.enable_steady_tick(Duration::from_millis(200));
                    bar
                })
                .collect();
            (multi, bars)
        });
        Lines { multi, last: vec![String::new(); n] }
    }

    /// Line `i` reads `text`, with `done` of `of` where a count is known.
    pub fn set(&mut self, i: usize, text: &str, count: Option<(u64, u64)>) {
        if let Some((_, bars)) = &self.multi {
            let Some(bar) = bars.get(i) else { return };
            bar.set_style(line_style(count.is_some()));
            if let Some((done, of)) = count {
                bar.set_length(of);
                bar.set_position(done);
            }
            bar.set_message(text.to_string());
            return;
        }
        // Plain: a line when the text changes (counts print every tenth).
        let shown = match count {
            Some((done, of)) if of > 0 => format!("{text} ({}%)", done * 10 / of * 10),
            _ => text.to_string(),
        };
        if let Some(last) = self.last.get_mut(i) {
            if *last != shown {
                eprintln!("[shoal] {shown}");
                *last = shown;
            }
        }
    }

    /// Every line is done: bars stay as they are.
    pub fn finish(self) {
        if let Some((_, bars)) = self.multi {
            for bar in bars {
                bar.finish();
            }
        }
    }
}

fn line_style(counted: bool) -> ProgressStyle {
    let template = if counted { "{spinner} {msg} [{bar:20}] {eta} left" } else { "{spinner} {msg} ({elapsed})" };
    // Constant templates that parse (the progress test draws both).
    ProgressStyle::with_template(template).expect("a valid template").progress_chars("=> ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_lines_say_how_much_of_what() {
        assert_eq!(plain_bytes(3 << 29, Some(4 << 30)), "1.5 GiB of 4.0 GiB (38%)");
        assert_eq!(plain_bytes(512, None), "512 B");
        assert_eq!(plain_bytes(0, Some(0)), "0 B");
    }

    #[test]
    fn the_styles_parse() {
        let _ = bytes_style();
        let _ = line_style(true);
        let _ = line_style(false);
    }
}
