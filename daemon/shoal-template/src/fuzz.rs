//! The `template` fuzz target's input as a template (daemon/fuzz), shared with the
//! stable replay of its kept inputs (`tests/fuzz_regressions.rs`).

/// The template the fuzz input `data` stands for: after a first byte whose low bit is
/// 0, the rest as text; after one whose low bit is 1, the rest as choices through a
/// small grammar of nested loops, recursive macros, string doubling and repetition,
/// `tojson` and `indent` with large widths and `str.format` padding.
pub fn template_of(data: &[u8]) -> Option<String> {
    let (&mode, rest) = data.split_first()?;
    Some(if mode & 1 == 0 {
        String::from_utf8_lossy(rest).into_owned()
    } else {
        let mut out = String::from("{% set ns = namespace(s='ab') %}");
        grammar(&mut Choices(rest), 0, &mut out, &mut 0);
        out
    })
}

/// What the target renders the template with: two messages and one tool.
pub fn conversation() -> (serde_json::Value, serde_json::Value) {
    (
        serde_json::json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]),
        serde_json::json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    )
}

/// The input read as choices.
struct Choices<'a>(&'a [u8]);

impl Choices<'_> {
    fn byte(&mut self) -> u8 {
        let Some((b, rest)) = self.0.split_first() else { return 0 };
        self.0 = rest;
        *b
    }
    fn number(&mut self) -> u32 {
        // Small most of the time, sometimes huge.
        match self.byte() % 4 {
            0 => u32::from(self.byte()),
            1 => u32::from(u16::from_le_bytes([self.byte(), self.byte()])),
            2 => u32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()]),
            _ => self.byte() as u32 % 8,
        }
    }
}

fn grammar(c: &mut Choices<'_>, depth: u32, out: &mut String, names: &mut u32) {
    let items = 1 + c.byte() % 3;
    for _ in 0..items {
        if c.0.is_empty() {
            return;
        }
        let deeper = depth < 5;
        match c.byte() % 14 {
            0 => out.push_str("x "),
            1 => out.push_str("{{ messages }}"),
            2 if deeper => {
                *names += 1;
                let n = c.number();
                out.push_str(&format!("{{% for i{names} in range({n}) %}}"));
                grammar(c, depth + 1, out, names);
                out.push_str("{% endfor %}");
            }
            3 if deeper => {
                *names += 1;
                let m = format!("m{names}");
                let d = c.number();
                out.push_str(&format!("{{% macro {m}(n) %}}{{% if n > 0 %}}"));
                grammar(c, depth + 1, out, names);
                out.push_str(&format!(
                    "{{{{ {m}(n - 1) }}}}{{{{ {m}(n - 1) }}}}{{% endif %}}{{% endmacro %}}{{{{ {m}({d}) }}}}"
                ));
            }
            4 => out.push_str(&format!("{{{{ messages | tojson(indent={}) }}}}", c.number())),
            5 => out.push_str(&format!("{{{{ (messages | tojson) | indent({}) }}}}", c.number())),
            6 => out.push_str("{% set ns.s = ns.s ~ ns.s %}"),
            7 => out.push_str(&format!("{{{{ ns.s * {} }}}}", c.number())),
            8 => out.push_str("{{ ns.s | length }}{{ tools | tojson }}"),
            9 if deeper => {
                out.push_str("{% if ns.s | length > 100 %}");
                grammar(c, depth + 1, out, names);
                out.push_str("{% else %}");
                grammar(c, depth + 1, out, names);
                out.push_str("{% endif %}");
            }
            10 => out.push_str("{% set ns.s = ns.s.replace('a', 'aa').upper() %}{{ ns.s.split('A') | join('-') }}"),
            11 => out.push_str(&format!("{{{{ '{{:>{}}}'.format(1) }}}}", c.number())),
            12 => out.push_str("{% for m in messages %}{{ m.role }}: {{ m.content | trim }}{% endfor %}"),
            _ => {
                // A few bytes as they are: syntax errors and odd tokens too.
                let n = (c.byte() % 8) as usize;
                let (raw, rest) = c.0.split_at(n.min(c.0.len()));
                out.push_str(&String::from_utf8_lossy(raw));
                c.0 = rest;
            }
        }
    }
}
