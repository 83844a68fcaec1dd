//! Chat templates rendered as their authors wrote them: the model's Jinja template
//! (`tokenizer.chat_template`) through minijinja, set up like Hugging Face's renderer
//! (blocks trimmed, lines stripped before blocks, `break`/`continue`, Python's string
//! methods, `raise_exception`). llama.cpp's own renderer only recognises a fixed list
//! of formats by telltale substrings and writes its idea of them (Mistral Small 3's
//! turns came out with spaces its template does not have); this writes the model's.
//! `strftime_now` gives today's date in UTC, as the reference renderers give the
//! local one (templates print it: "Today Date: 04 Dec 2026"); the coordinator
//! renders a prompt once and every stage gets its tokens, so nodes never disagree.

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
    render_with(template, Value::from(messages), Value::from(()), bos, eos, vars)
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
    render_with(template, Value::from(Serde(messages)), Value::from(Serde(tools)), bos, eos, vars)
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
    bos: &str,
    eos: &str,
    vars: Vars<'_>,
) -> Result<String, String> {
    let mut env = environment();
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
    tmpl.render(ctx).map_err(|e| describe(&e))
}

/// The renderer set up as Hugging Face's, without a template.
fn environment<'s>() -> Environment<'s> {
    let mut env = Environment::new();
    // Hugging Face's settings (transformers' `_compile_jinja_template`).
    // Invariant: the default delimiters, which build.
    env.set_syntax(SyntaxConfig::builder().trim_blocks(true).lstrip_blocks(true).build().expect("default syntax"));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
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

/// Jinja's `indent` as Python's writes it (`width` spaces, or the text given, before
/// every line but the first, and the first too with `first`; blank lines too with
/// `blank`): minijinja's drops a trailing newline, which Python's keeps, and Command
/// R+'s template writes the `{` of each earlier call as `'{\n'|indent(4, first=true)`,
/// its line break then lost from what the model reads.
fn indent(
    text: String,
    width: Option<Value>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: minijinja::value::Kwargs,
) -> Result<String, Error> {
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
        let Some(close) = rest[open..].find("%}") else { break };
        let tag = &rest[open + 2..open + close];
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
            None => out.push_str(&rest[open..open + close + 2]),
        }
        rest = &rest[open + close + 2..];
    }
    out.push_str(rest);
    out
}

/// Hugging Face's `tojson`: Python's `json.dumps(x, ensure_ascii=False)`, keys in
/// their order, `", "` and `": "` between items (or `indent` spaces per level, with
/// `","`), and no HTML escaping (minijinja's own escapes `<` and `'`, which would
/// change a tool's description as the model reads it).
fn tojson(v: Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    // Accepted as Python accepts them; the output is the same either way.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&v).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    python_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// `v` as Python's `json.dumps` writes it (see [`tojson`]).
fn python_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
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
                python_json(item, indent, depth + 1, out);
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
                python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
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
