//! Chat templates rendered as their authors wrote them: the model's Jinja template
//! (`tokenizer.chat_template`) through minijinja, set up like Hugging Face's renderer
//! (blocks trimmed, lines stripped before blocks, `break`/`continue`, Python's string
//! methods, `raise_exception`). llama.cpp's own renderer only recognises a fixed list
//! of formats by telltale substrings and writes its idea of them (Mistral Small 3's
//! turns came out with spaces its template does not have); this writes the model's.
//! `strftime_now` gives today's date in UTC, as the reference renderers give the
//! local one (templates print it: "Today Date: 04 Dec 2026"); the coordinator
//! renders a prompt once and every stage gets its tokens, so nodes never disagree.
//!
//! A template comes from a model file, which comes from anywhere (`/api/pull`, an
//! `hf://` name, the page's upload): it is untrusted code. Each render has a budget
//! ([`Budget`]): minijinja's fuel (one unit per instruction and per 64 bytes of data
//! the template makes, so it bounds time and memory both), an output cap, and a
//! shallow recursion limit; a template past any of them is refused with a
//! [`OVER_BUDGET`] error, the model itself still loads. The custom filters charge
//! what they build before they build it.

#[doc(hidden)]
pub mod fuzz;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{context, Environment, Error, ErrorKind, Value};

/// One turn of a conversation.
#[derive(Clone, Copy, Debug)]
pub struct Turn<'a> {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: &'a str,
    /// The turn's text.
    pub content: &'a str,
}

/// Variables a template reads besides the conversation (Hugging Face's keyword
/// arguments to `apply_chat_template`); each is undefined unless given, as Hugging Face
/// leaves it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Vars<'a> {
    /// `enable_thinking` (Qwen 3's, SmolLM3's, DeepSeek V3.1's …).
    pub enable_thinking: Option<bool>,
    /// `reasoning_effort` (gpt-oss's: `low`, `medium`, `high`).
    pub reasoning_effort: Option<&'a str>,
}

/// Render `turns` with the Jinja `template`, ready for the assistant's answer
/// (`add_generation_prompt`), `bos` and `eos` being the model's BOS and EOS texts.
/// The error says what the template could not do.
pub fn render(template: &str, turns: &[Turn<'_>], bos: &str, eos: &str) -> Result<String, String> {
    render_as(template, turns, bos, eos, Vars::default())
}

/// [`render`] with the template's variables `vars` set.
pub fn render_as(template: &str, turns: &[Turn<'_>], bos: &str, eos: &str, vars: Vars<'_>) -> Result<String, String> {
    let messages: Vec<Value> = turns.iter().map(|t| context! { role => t.role, content => t.content }).collect();
    let input: usize = turns.iter().map(|t| t.role.len() + t.content.len() + 32).sum();
    render_with(template, Value::from(messages), Value::from(()), (bos, eos), vars, Budget::for_input(input))
}

/// [`render`] for messages in OpenAI's shape (an assistant's `tool_calls`, a tool's
/// `tool_call_id` and `name`) with `tools` (`[{"type": "function", "function": {…}}]`)
/// offered: what templates with a tool syntax of their own render.
pub fn render_json(
    template: &str,
    messages: &serde_json::Value,
    tools: &serde_json::Value,
    bos: &str,
    eos: &str,
) -> Result<String, String> {
    render_json_as(template, messages, tools, bos, eos, Vars::default())
}

/// [`render_json`] with the template's variables `vars` set.
pub fn render_json_as(
    template: &str,
    messages: &serde_json::Value,
    tools: &serde_json::Value,
    bos: &str,
    eos: &str,
    vars: Vars<'_>,
) -> Result<String, String> {
    let input = json_bytes(messages) + json_bytes(tools);
    let (messages, tools) = (Value::from(Serde(messages)), Value::from(Serde(tools)));
    render_with(template, messages, tools, (bos, eos), vars, Budget::for_input(input))
}

/// The bytes of `v` written as JSON (what a template can read of it, roughly).
fn json_bytes(v: &serde_json::Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut n = Count(0);
    // Writing a JSON value to a counter cannot fail.
    let _ = serde_json::to_writer(&mut n, v);
    n.0
}

/// [`render_json`] with `budget` in place of the one the input implies (for tests and
/// the fuzzer: a small budget reaches its limits sooner).
pub fn render_json_within(
    template: &str,
    messages: &serde_json::Value,
    tools: &serde_json::Value,
    budget: Budget,
) -> Result<String, String> {
    let (messages, tools) = (Value::from(Serde(messages)), Value::from(Serde(tools)));
    render_with(template, messages, tools, ("<s>", "</s>"), Vars::default(), budget)
}

/// What each render may use: a template past it fails with an error that starts with
/// [`OVER_BUDGET`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// minijinja fuel: one per instruction, one per 64 bytes of data made.
    pub fuel: u64,
    /// Bytes the render may write.
    pub output: usize,
}

/// How every refusal for a template's budget begins, so callers (and tests) can tell
/// it from a template that failed on its own (`raise_exception`, a missing variable).
pub const OVER_BUDGET: &str = "the model's chat template is over its budget";

/// Fuel every render gets: 300,000 instructions, or about 19 MB of data. The real
/// templates of the suite's named-template tests spend at most 600 on their
/// conversations; a render that spends it all (two empty nested loops) is refused after
/// about 10 ms in a release build on the 2-core development machine (45 ms in debug).
pub const BASE_FUEL: u64 = 300_000;

/// Output every render may write besides [`OUTPUT_PER_INPUT_BYTE`] per byte of the
/// conversation: room for a long fixed system prompt.
pub const BASE_OUTPUT: usize = 64 * 1024;

/// Output per byte of the conversation (messages and tools) a render may write: a
/// template writes each message once, with its markup; tools written as JSON twice at
/// most.
pub const OUTPUT_PER_INPUT_BYTE: usize = 4;

/// Macro calls nested deeper than this fail (minijinja allows 500, whose frames can
/// overflow a 2 MiB worker thread's stack in a debug build; templates nest a few).
pub const MAX_DEPTH: usize = 64;

impl Budget {
    /// The budget for a conversation of `input_bytes` (its texts and tools): fuel for
    /// the fixed work and 4 passes over the input's data, output for
    /// [`OUTPUT_PER_INPUT_BYTE`] per byte.
    pub fn for_input(input_bytes: usize) -> Self {
        Budget {
            fuel: BASE_FUEL + (input_bytes as u64 / 16),
            output: BASE_OUTPUT.saturating_add(input_bytes.saturating_mul(OUTPUT_PER_INPUT_BYTE)),
        }
    }
}

/// Whether `template` parses as Jinja in this renderer (what it then renders is up to
/// the conversation); the error says where it does not.
pub fn check(template: &str) -> Result<(), String> {
    let template = generation_blocks_as_ifs(template);
    environment().add_template("chat", &template).map_err(|e| describe(&e))
}

fn render_with(
    template: &str,
    messages: Value,
    tools: Value,
    (bos, eos): (&str, &str),
    vars: Vars<'_>,
    budget: Budget,
) -> Result<String, String> {
    let mut env = environment();
    env.set_fuel(Some(budget.fuel));
    env.set_recursion_limit(MAX_DEPTH);
    let template = generation_blocks_as_ifs(template);
    env.add_template("chat", &template).map_err(|e| describe(&e))?;
    let ctx = context! {
        messages => messages,
        add_generation_prompt => true,
        bos_token => bos,
        eos_token => eos,
        // None when a request has none, as Hugging Face passes them.
        tools => tools,
        documents => Value::from(()),
    };
    // Given variables only: templates test `is defined` (gpt-oss's effort defaults to
    // medium, Qwen 3 thinks unless `enable_thinking` is false).
    let mut given = std::collections::BTreeMap::new();
    if let Some(t) = vars.enable_thinking {
        given.insert("enable_thinking", Value::from(t));
    }
    if let Some(e) = vars.reasoning_effort {
        given.insert("reasoning_effort", Value::from(e));
    }
    let ctx = context! { ..Value::from(given), ..ctx };
    // Invariant: the template was added above under this name.
    let tmpl = env.get_template("chat").expect("template added above");
    let mut out = Capped { bytes: Vec::new(), cap: budget.output, over: false };
    // The captured state borrows the template: only whether it rendered is kept.
    let rendered = tmpl.render_captured_to(ctx, &mut out).map(drop);
    match rendered {
        Ok(_) => Ok(String::from_utf8(out.bytes).map_err(|_| "the chat template wrote invalid UTF-8".to_string())?),
        Err(_) if out.over => Err(format!(
            "{OVER_BUDGET}: it writes more than {} KiB for this conversation (4 bytes per byte of it, and 64 KiB)",
            budget.output / 1024
        )),
        Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(format!(
            "{OVER_BUDGET}: it needs more than {} steps (or {} MB of data) for this conversation",
            budget.fuel,
            budget.fuel * 64 / 1_000_000
        )),
        Err(e) => Err(describe(&e)),
    }
}

/// The render's output, refused past `cap` bytes (`over` then says why the render
/// failed: minijinja reports a write error of its own).
struct Capped {
    bytes: Vec<u8>,
    cap: usize,
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + b.len() > self.cap {
            self.over = true;
            return Err(std::io::Error::other("over the output cap"));
        }
        self.bytes.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The renderer set up as Hugging Face's, without a template.
fn environment<'s>() -> Environment<'s> {
    let mut env = Environment::new();
    // Hugging Face's settings (transformers' `_compile_jinja_template`).
    // Invariant: the default delimiters, which build.
    env.set_syntax(SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build().expect("default syntax"));
    env.set_unknown_method_callback(python_method);
    env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", |format: String| -> Result<Value, Error> {
        let now = jiff::Timestamp::now();
        // jiff refuses a format it cannot write, where Python would print it as is.
        jiff::fmt::strtime::format(format.as_bytes(), now)
            .map(Value::from)
            .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("strftime_now({format:?}): {e}")))
    });
    // Python's sense: `none is iterable` is false (minijinja iterates none as empty),
    // which templates test before `tools | length`.
    env.add_test("iterable", |v: Value| v.try_iter().is_ok() && !v.is_none() && !v.is_undefined());
    env.add_filter("tojson", tojson);
    env.add_filter("indent", indent);
    env
}

/// Python's string and dict methods (minijinja-contrib's, which charge fuel for what
/// they build), except a `str.format` with a width or precision of 5 digits or more:
/// it would build its padding before anything is charged.
fn python_method(state: &mut minijinja::State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if method == "format" && value.as_str().is_some_and(wide_format) {
        return Err(Error::new(ErrorKind::InvalidOperation, "str.format with a width or precision over 9999"));
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Whether a `str.format` string has a replacement field with a number of 5 digits or
/// more in it (its width or precision).
fn wide_format(s: &str) -> bool {
    s.split('{').skip(1).any(|field| {
        let spec = field.split('}').next().unwrap_or_default();
        spec.split(|c: char| !c.is_ascii_digit()).any(|digits| digits.len() >= 5)
    })
}

/// Charges `state` for `bytes` about to be built (one fuel per 64 bytes, as minijinja
/// charges the data a template makes), before building them.
fn charge(state: &minijinja::State, bytes: usize) -> Result<(), Error> {
    state.consume_fuel(bytes as u64 / 64 + 1)
}

/// Jinja's `indent` as Python's writes it (`width` spaces, or the text given, before
/// every line but the first, and the first too with `first`; blank lines too with
/// `blank`): minijinja's drops a trailing newline, which Python's keeps, and Command
/// R+'s template writes the `{` of each earlier call as `'{\n'|indent(4, first=true)`,
/// its line break then lost from what the model reads.
fn indent(
    state: &minijinja::State,
    text: String,
    positional: minijinja::value::Rest<Value>,
    kwargs: minijinja::value::Kwargs,
) -> Result<String, Error> {
    // `width`, `first`, `blank` by position: six arguments with the state are more than
    // a filter function takes.
    let (width, first, blank): (Option<Value>, Option<bool>, Option<bool>) = minijinja::value::from_args(&positional)?;
    let width = match width {
        Some(w) => Some(w),
        None => kwargs.get::<Option<Value>>("width")?,
    };
    let first = match first {
        Some(f) => f,
        None => kwargs.get::<Option<bool>>("first")?.unwrap_or(false),
    };
    let blank = match blank {
        Some(b) => b,
        None => kwargs.get::<Option<bool>>("blank")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let by = match width {
        None => " ".repeat(4),
        Some(w) => match w.as_str() {
            Some(s) => s.to_string(),
            None => {
                let n = usize::try_from(w.clone())?;
                // A template's width, not a request's: bounded all the same.
                if n > 1024 {
                    return Err(Error::new(ErrorKind::InvalidOperation, format!("indent({n}): too wide")));
                }
                " ".repeat(n)
            }
        },
    };
    // What it writes, paid for before it is built.
    charge(state, text.len().saturating_add(by.len().saturating_mul(text.matches('\n').count() + 1)))?;
    // Python's `splitlines` of the text with a newline added: its lines, a trailing
    // newline leaving an empty last one.
    let mut lines = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l));
    let mut out = if first { by.clone() } else { String::new() };
    out.push_str(lines.next().unwrap_or_default());
    for line in lines {
        out.push('\n');
        if blank || !line.is_empty() {
            out.push_str(&by);
        }
        out.push_str(line);
    }
    Ok(out)
}

/// Hugging Face's `{% generation %}` … `{% endgeneration %}` (its renderer's
/// AssistantTracker marks the assistant's text with them; they print nothing of their
/// own) as `{% if true %}` … `{% endif %}`, whitespace control kept, which minijinja
/// knows.
fn generation_blocks_as_ifs(template: &str) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(open) = rest.find("{%") {
        // The tag's end after its opening (in `{%}` the two overlap: no tag).
        let Some(len) = rest[open + 2..].find("%}") else { break };
        let end = open + 2 + len + 2;
        let tag = &rest[open + 2..open + 2 + len];
        let keyword = tag.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let (lead, trail) = (tag.starts_with(['-', '+']), tag.ends_with(['-', '+']));
        out.push_str(&rest[..open]);
        let replaced = match keyword {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replaced {
            Some(k) => {
                out.push_str("{%");
                if lead {
                    out.push_str(&tag[..1]);
                }
                out.push(' ');
                out.push_str(k);
                out.push(' ');
                if trail {
                    out.push_str(&tag[tag.len() - 1..]);
                }
                out.push_str("%}");
            }
            None => out.push_str(&rest[open..end]),
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// Hugging Face's `tojson`: Python's `json.dumps(x, ensure_ascii=False)`, keys in
/// their order, `", "` and `": "` between items (or `indent` spaces per level, with
/// `","`), and no HTML escaping (minijinja's own escapes `<` and `'`, which would
/// change a tool's description as the model reads it).
fn tojson(state: &minijinja::State, v: Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // A template's indent, not a request's: bounded all the same.
    if indent.is_some_and(|n| n > 64) {
        return Err(Error::new(ErrorKind::InvalidOperation, "tojson: indent over 64"));
    }
    // Accepted as Python accepts them; the output is the same either way.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&v).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    // Written in pieces, each paid for as it grows, so that an indented deep value
    // cannot build gigabytes of spaces before the engine charges the result.
    let mut out = String::new();
    let mut paid = 0;
    python_json(&json, indent, 0, &mut out, &mut |out: &str| {
        if out.len() - paid >= 4096 {
            charge(state, out.len() - paid)?;
            paid = out.len();
        }
        Ok(())
    })?;
    Ok(Value::from_safe_string(out))
}

/// `v` as Python's `json.dumps` writes it (see [`tojson`]).
fn python_json(
    v: &serde_json::Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
    pay: &mut dyn FnMut(&str) -> Result<(), Error>,
) -> Result<(), Error> {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                python_json(item, indent, depth + 1, out, pay)?;
                pay(out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&J::String(k.clone()).to_string());
                out.push_str(": ");
                python_json(item, indent, depth + 1, out, pay)?;
                pay(out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
    Ok(())
}

/// The error and its cause, on one line.
fn describe(e: &Error) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str =
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}\
        {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    /// The review's template (F4): two nested loops of 100,000 writing the messages.
    /// Unbounded it rendered for minutes and grew the node past 2 GB.
    const NESTED: &str =
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ messages }}{% endfor %}{% endfor %}";

    fn over_budget(r: Result<String, String>) -> String {
        let e = r.expect_err("the template is over its budget");
        assert!(e.starts_with(OVER_BUDGET), "{e}");
        e
    }

    #[test]
    fn a_template_that_would_run_for_ever_is_refused() {
        let turns = [Turn { role: "user", content: "Hi" }];
        let e = over_budget(render(NESTED, &turns, "", ""));
        assert!(e.contains("steps") || e.contains("KiB"), "{e}");
        // Loops that write nothing spend fuel per step all the same.
        let quiet = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        assert!(over_budget(render(quiet, &turns, "", "")).contains("steps"));
    }

    #[test]
    fn data_a_template_makes_is_paid_for_before_it_is_made() {
        let turns = [Turn { role: "user", content: "Hi" }];
        // Doubling a string 40 times would make a terabyte.
        let doubling = "{% set ns = namespace(s='abcdefgh') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}";
        over_budget(render(doubling, &turns, "", ""));
        // So would repeating one, indenting a long text deep, or writing JSON indented
        // a thousand spaces per level.
        over_budget(render("{{ 'x' * 1000000000 }}", &turns, "", ""));
        let wide = "{% set ns = namespace(s='a\n') %}{% for i in range(14) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{% for i in range(100) %}{{ ns.s | indent(1000) | length }}{% endfor %}";
        over_budget(render(wide, &turns, "", ""));
        assert!(render("{{ messages | tojson(indent=100000) }}", &turns, "", "").is_err());
        assert!(render("{{ '{:>999999999}'.format(1) }}", &turns, "", "").is_err());
        // Macros calling themselves stop at MAX_DEPTH, with an error, not a crash.
        let deep = "{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}";
        assert!(render(deep, &turns, "", "").is_err());
    }

    #[test]
    fn output_past_four_times_the_conversation_is_refused() {
        let long = "x".repeat(20_000);
        let turns = [Turn { role: "user", content: &long }];
        // Three copies fit (4 bytes per byte of conversation, and 64 KiB) …
        let thrice = "{% for i in range(3) %}{{ messages[0].content }}{% endfor %}";
        assert_eq!(render(thrice, &turns, "", "").unwrap().len(), 60_000);
        // … eight do not.
        let eight = "{% for i in range(8) %}{{ messages[0].content }}{% endfor %}";
        assert!(over_budget(render(eight, &turns, "", "")).contains("KiB"));
    }

    #[test]
    fn a_long_conversation_renders_within_its_budget() {
        // 4,000 turns of 500 bytes (2 MB: past any context Shoal serves) through a real
        // template with filters: the budget grows with the conversation.
        let text = "word ".repeat(100);
        let turns: Vec<Turn> =
            (0..4000).map(|i| Turn { role: if i % 2 == 0 { "user" } else { "assistant" }, content: &text }).collect();
        let out = render(CHATML, &turns, "", "").unwrap();
        assert!(out.len() > 4000 * 499, "{}", out.len());
        let tools =
            serde_json::json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
        let messages: Vec<serde_json::Value> =
            turns.iter().map(|t| serde_json::json!({"role": t.role, "content": t.content})).collect();
        let with_tools = "{{ tools | tojson(indent=4) }}{% for m in messages %}{{ m.role }}: {{ m.content | trim | indent(2) }}\n{% endfor %}";
        assert!(render_json(with_tools, &serde_json::json!(messages), &tools, "", "").is_ok());
    }

    #[test]
    fn renders_a_conversation() {
        let turns = [Turn { role: "system", content: "Be brief." }, Turn { role: "user", content: " Hi " }];
        let out = render(CHATML, &turns, "<s>", "</s>").unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    /// A request's variables reach the template; absent ones stay undefined, so a
    /// template's own default holds (Qwen 3 thinks, gpt-oss's effort is medium).
    #[test]
    fn variables_reach_the_template_only_when_given() {
        let t = "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}\
                 {% if reasoning_effort is not defined %}{% set reasoning_effort = 'medium' %}{% endif %}\
                 Reasoning: {{ reasoning_effort }}";
        let turns = [Turn { role: "user", content: "Hi" }];
        assert_eq!(render(t, &turns, "", "").unwrap(), "Reasoning: medium");
        let vars = Vars { enable_thinking: Some(false), reasoning_effort: Some("high") };
        assert_eq!(render_as(t, &turns, "", "", vars).unwrap(), "<think></think>Reasoning: high");
        let messages = serde_json::json!([{"role": "user", "content": "Hi"}]);
        let on = Vars { enable_thinking: Some(true), ..Vars::default() };
        assert_eq!(render_json_as(t, &messages, &serde_json::Value::Null, "", "", on).unwrap(), "Reasoning: medium");
    }

    #[test]
    fn python_string_methods_and_hugging_faces_settings() {
        // `.strip()` and `.startswith()` (pycompat); a block's newline trimmed.
        let t = "{% for m in messages %}{% if m.content.startswith('x') %}\n{{ m.content.strip() }}|{% endif %}\n{% endfor %}";
        let turns = [Turn { role: "user", content: "x1 " }, Turn { role: "user", content: "y" }];
        assert_eq!(render(t, &turns, "", "").unwrap(), "x1|");
        // `break` in a loop (loop controls), `bos_token`, no tools.
        let t =
            "{{ bos_token }}{% for m in messages %}{{ m.content }}{% break %}{% endfor %}{% if tools %}T{% endif %}";
        assert_eq!(render(t, &turns, "<s>", "").unwrap(), "<s>x1 ");
    }

    #[test]
    fn hugging_faces_generation_blocks_render_their_content() {
        let t =
            "{% for m in messages %}{%- generation -%}\n[{{ m.content }}]\n{%- endgeneration -%}\n{% endfor %}|{{ 1 }}";
        let turns = [Turn { role: "assistant", content: "a" }, Turn { role: "assistant", content: "b" }];
        assert_eq!(render(t, &turns, "", "").unwrap(), "[a][b]|1");
        assert_eq!(generation_blocks_as_ifs("x{% generation %}y{%+ endgeneration +%}"), "x{% if true %}y{%+ endif +%}");
        // The fuzzer's find: an opening and closing that overlap are no tag (this
        // panicked on a byte range), and Jinja then says what is wrong.
        assert_eq!(generation_blocks_as_ifs("a{%}b{%-%}"), "a{%}b{%-%}");
        assert!(render("{%}", &[], "", "").is_err());
    }

    /// As Python's Jinja writes them (its output in the comments' stead).
    #[test]
    fn indent_writes_as_python_does() {
        let out = |t: &str| render(t, &[], "", "").unwrap();
        // Command R+'s call: the brace's line break kept.
        assert_eq!(out("{{ '{\\n'|indent(4, first=true) }}|"), "    {\n|");
        assert_eq!(out("{{ 'a\\n\\nb\\n'|indent }}|"), "a\n\n    b\n|");
        assert_eq!(out("{{ 'a\\n\\nb'|indent(2, blank=true) }}|"), "a\n  \n  b|");
        assert_eq!(out("{{ 'a\\nb'|indent(width='> ', first=true) }}"), "> a\n> b");
        assert_eq!(out("{{ ''|indent(first=true) }}|"), "    |");
        assert!(render("{{ 'a'|indent(-1) }}", &[], "", "").is_err());
    }

    #[test]
    fn tojson_writes_as_python_does() {
        let t = "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}";
        let tools = serde_json::json!([{"name": "f", "description": "the user's <city>", "n": [1, 2.5], "e": {}}]);
        let out = render_json(t, &serde_json::json!([]), &tools, "", "").unwrap();
        assert_eq!(
            out,
            "[{\"name\": \"f\", \"description\": \"the user's <city>\", \"n\": [1, 2.5], \"e\": {}}]|{\n  \
             \"name\": \"f\",\n  \"description\": \"the user's <city>\",\n  \"n\": [\n    1,\n    2.5\n  ],\n  \
             \"e\": {}\n}"
        );
    }

    #[test]
    fn a_template_that_raises_or_does_not_parse_says_why() {
        let e = render("{{ raise_exception('Only user and assistant roles') }}", &[], "", "").unwrap_err();
        assert!(e.contains("Only user and assistant roles"), "{e}");
        let e = render("{% for m in messages %}", &[], "", "").unwrap_err();
        assert!(e.contains("unexpected end of input") || e.contains("syntax error"), "{e}");
        // `check` parses without rendering: a template that raises parses.
        let e = check("{% for m in messages %}").unwrap_err();
        assert!(e.contains("unexpected end of input") || e.contains("syntax error"), "{e}");
        check("{{ raise_exception('no') }}{% generation %}{{ x }}{% endgeneration %}").unwrap();
    }
}
