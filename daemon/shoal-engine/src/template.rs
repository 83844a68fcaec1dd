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
use minijinja::{context, Environment, Error, ErrorKind, Value};

/// One turn of a conversation.
#[derive(Clone, Copy, Debug)]
pub struct Turn<'a> {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: &'a str,
    /// The turn's text.
    pub content: &'a str,
}

/// Render `turns` with the Jinja `template`, ready for the assistant's answer
/// (`add_generation_prompt`), `bos` and `eos` being the model's BOS and EOS texts.
/// The error says what the template could not do.
pub fn render(template: &str, turns: &[Turn<'_>], bos: &str, eos: &str) -> Result<String, String> {
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
    env.add_template("chat", template).map_err(|e| describe(&e))?;
    let messages: Vec<Value> = turns.iter().map(|t| context! { role => t.role, content => t.content }).collect();
    let ctx = context! {
        messages => messages,
        add_generation_prompt => true,
        bos_token => bos,
        eos_token => eos,
        // As Hugging Face passes them when a request has none.
        tools => Value::from(()),
        documents => Value::from(()),
    };
    // Invariant: the template was added above under this name.
    let tmpl = env.get_template("chat").expect("template added above");
    tmpl.render(ctx).map_err(|e| describe(&e))
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
    fn a_template_that_raises_or_does_not_parse_says_why() {
        let e = render("{{ raise_exception('Only user and assistant roles') }}", &[], "", "").unwrap_err();
        assert!(e.contains("Only user and assistant roles"), "{e}");
        let e = render("{% for m in messages %}", &[], "", "").unwrap_err();
        assert!(e.contains("unexpected end of input") || e.contains("syntax error"), "{e}");
    }
}
