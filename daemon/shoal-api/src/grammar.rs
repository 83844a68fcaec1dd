//! Structured output: the GBNF grammars (llama.cpp's format) that keep an answer
//! within JSON (OpenAI's `response_format: json_object`, Ollama's `format: "json"`) or
//! within a JSON schema (`json_schema`, Ollama's `format: {…}`). The tail's sampler
//! rules out every token that would leave the grammar, so the text is valid by
//! construction (unless `max_tokens` cuts it short). Pure: schema in, grammar out.
//!
//! Schemas: `type` (one or a list), `properties` (every listed property is written,
//! in order: what OpenAI's strict mode asks for, and valid whether or not a property is
//! `required`), `items` with `minItems`/`maxItems`, `enum`, `const`, `anyOf`/`oneOf`,
//! `$ref` to `#/$defs/…` or `#/definitions/…` (recursion allowed), `nullable`,
//! `minLength`/`maxLength`. Keywords that constrain in other ways (`pattern`,
//! `minimum`, `format`, …) are refused with their name rather than ignored.

use crate::backend::ToolSyntax;
use serde_json::Value;
use std::collections::BTreeMap;

/// Any JSON object (the root) and the JSON building blocks every schema grammar uses.
const BASE: &str = r#"value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws ( string ws ":" ws value ws ( "," ws string ws ":" ws value ws )* )? "}"
array ::= "[" ws ( value ws ( "," ws value ws )* )? "]"
string ::= "\"" char* "\""
char ::= [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} )
integer ::= "-"? ( "0" | [1-9] [0-9]{0,15} )
number ::= integer ( "." [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,3} )?
boolean ::= "true" | "false"
ws ::= [ \t\n]{0,16}
"#;

/// Deepest schema nesting accepted (a schema is client input).
const MAX_DEPTH: usize = 32;

/// Keywords that describe without constraining: accepted and ignored.
const DESCRIPTIVE: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "$defs",
    "definitions",
    "required",
    "additionalProperties",
    "strict",
    "deprecated",
    "readOnly",
    "writeOnly",
];

/// The grammar of any JSON object.
pub fn json_object() -> String {
    format!("root ::= ws object ws\n{BASE}")
}

/// The grammar of the JSON values `schema` describes, or why it cannot be followed.
pub fn from_schema(schema: &Value) -> Result<String, String> {
    let mut c = Converter { root: schema, prefix: String::new(), rules: BTreeMap::new(), defs_done: Vec::new() };
    let root = c.expr(schema, 0)?;
    let mut out = format!("root ::= ws {root} ws\n{BASE}");
    for (name, body) in &c.rules {
        out += &format!("{name} ::= {body}\n");
    }
    if out.len() > shoal_types::MAX_GRAMMAR_BYTES {
        return Err(format!("the schema is too large ({} bytes of grammar)", out.len()));
    }
    Ok(out)
}

/// Most tool calls one answer may make (a bound, so a looping model stops).
const MAX_CALLS: usize = 8;

/// The grammar of a tool-calling answer (see `tools`): `{"tool_calls": [{"name",
/// "arguments"}]}` naming one of `tools` (name, parameter schema) with arguments its
/// schema allows, several calls when `parallel`, or, when `reply`, `{"response": "…"}`
/// instead. In a model's own `syntax` instead (`reply` is then not offered: a reply is
/// free text, without a grammar): Hermes' `<tool_call>\n{"name", "arguments"}\n</tool_call>`
/// blocks, one per line; Llama 3's one object `{"name", "parameters"}`. A schema the
/// grammar cannot follow (or one making the grammar too large) allows any JSON object.
pub(crate) fn tool_answer(tools: &[(&str, &Value)], reply: bool, parallel: bool, syntax: ToolSyntax) -> String {
    let args_key = if syntax == ToolSyntax::Llama3 { "\"parameters\"" } else { "\"arguments\"" };
    let build = |strict: bool| {
        let mut rules = BTreeMap::new();
        let mut calls = Vec::new();
        for (i, (name, params)) in tools.iter().enumerate() {
            let mut c =
                Converter { root: params, prefix: format!("t{i}-"), rules: BTreeMap::new(), defs_done: Vec::new() };
            let args = if strict { c.expr(params, 0).ok() } else { None };
            let args = match args {
                Some(a) => {
                    rules.append(&mut c.rules);
                    a
                }
                None => "object".to_string(),
            };
            let rule = format!("call-{i}");
            let name = literal(&Value::String((*name).to_string()).to_string());
            rules.insert(
                rule.clone(),
                format!(
                    "\"{{\" ws {} ws \":\" ws {name} ws \",\" ws {} ws \":\" ws {args} ws \"}}\"",
                    literal("\"name\""),
                    literal(args_key)
                ),
            );
            calls.push(rule);
        }
        let head = match syntax {
            ToolSyntax::Hermes => {
                let more = if parallel { format!(" ( \"\\n\" block ){{0,{}}}", MAX_CALLS - 1) } else { String::new() };
                format!(
                    "root ::= block{more}\nblock ::= \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall ::= {}\n",
                    alternatives(calls.into_iter()),
                )
            }
            // Llama 3's templates allow one call per message.
            ToolSyntax::Llama3 => format!("root ::= call\ncall ::= {}\n", alternatives(calls.into_iter())),
            ToolSyntax::Generic => {
                let more =
                    if parallel { format!("( \",\" ws call ws ){{0,{}}}", MAX_CALLS - 1) } else { String::new() };
                format!(
                    "root ::= ws {} ws\ncalls ::= \"{{\" ws {} ws \":\" ws \"[\" ws call ws {more} \"]\" ws \"}}\"\n\
                     call ::= {}\n",
                    if reply { "( calls | reply )" } else { "calls" },
                    literal("\"tool_calls\""),
                    alternatives(calls.into_iter()),
                )
            }
        };
        let mut out = head;
        if reply && syntax == ToolSyntax::Generic {
            out += &format!("reply ::= \"{{\" ws {} ws \":\" ws string ws \"}}\"\n", literal("\"response\""));
        }
        out += BASE;
        for (name, body) in &rules {
            out += &format!("{name} ::= {body}\n");
        }
        out
    };
    let strict = build(true);
    if strict.len() <= shoal_types::MAX_GRAMMAR_BYTES {
        strict
    } else {
        build(false)
    }
}

struct Converter<'a> {
    /// The whole schema, where `$ref`s point.
    root: &'a Value,
    /// Put before the names of the rules made (several schemas in one grammar).
    prefix: String,
    /// Named rules made so far (definitions), by name.
    rules: BTreeMap<String, String>,
    /// Definitions whose rule exists or is being made (recursion stops here).
    defs_done: Vec<String>,
}

impl Converter<'_> {
    /// A GBNF expression for values matching `s`.
    fn expr(&mut self, s: &Value, depth: usize) -> Result<String, String> {
        if depth > MAX_DEPTH {
            return Err(format!("the schema nests deeper than {MAX_DEPTH} levels"));
        }
        let obj = match s {
            Value::Bool(true) => return Ok("value".into()),
            Value::Bool(false) => return Err("a `false` schema matches nothing".into()),
            Value::Object(o) => o,
            _ => return Err(format!("a schema must be an object, not {s}")),
        };
        for k in obj.keys() {
            let known = DESCRIPTIVE.contains(&k.as_str())
                || matches!(
                    k.as_str(),
                    "type"
                        | "properties"
                        | "items"
                        | "minItems"
                        | "maxItems"
                        | "enum"
                        | "const"
                        | "anyOf"
                        | "oneOf"
                        | "$ref"
                        | "nullable"
                        | "minLength"
                        | "maxLength"
                );
            if !known {
                return Err(format!("the schema keyword `{k}` is not supported"));
            }
        }
        let inner = self.expr_of(obj, depth)?;
        Ok(if obj.get("nullable") == Some(&Value::Bool(true)) { format!("( {inner} | \"null\" )") } else { inner })
    }

    fn expr_of(&mut self, obj: &serde_json::Map<String, Value>, depth: usize) -> Result<String, String> {
        if let Some(r) = obj.get("$ref") {
            return self.reference(r, depth);
        }
        if let Some(c) = obj.get("const") {
            return Ok(literal(&c.to_string()));
        }
        if let Some(e) = obj.get("enum") {
            let Some(values) = e.as_array().filter(|v| !v.is_empty()) else {
                return Err("`enum` must be a non-empty list".into());
            };
            return Ok(alternatives(values.iter().map(|v| literal(&v.to_string()))));
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(list) = obj.get(key) {
                let Some(list) = list.as_array().filter(|l| !l.is_empty()) else {
                    return Err(format!("`{key}` must be a non-empty list"));
                };
                let alts = list.iter().map(|s| self.expr(s, depth + 1)).collect::<Result<Vec<_>, _>>()?;
                return Ok(alternatives(alts.into_iter()));
            }
        }
        match obj.get("type") {
            Some(Value::Array(types)) if !types.is_empty() => {
                let mut alts = Vec::new();
                for t in types {
                    let mut one = obj.clone();
                    one.insert("type".into(), t.clone());
                    alts.push(self.expr_of(&one, depth + 1)?);
                }
                Ok(alternatives(alts.into_iter()))
            }
            Some(Value::String(t)) => self.typed(t, obj, depth),
            Some(other) => Err(format!("`type` must be a name or a list of names, not {other}")),
            None if obj.contains_key("properties") => self.typed("object", obj, depth),
            None if obj.contains_key("items") => self.typed("array", obj, depth),
            None => Ok("value".into()),
        }
    }

    fn typed(&mut self, t: &str, obj: &serde_json::Map<String, Value>, depth: usize) -> Result<String, String> {
        let count = |k: &str| -> Result<Option<u64>, String> {
            match obj.get(k) {
                None => Ok(None),
                Some(v) => {
                    v.as_u64().filter(|n| *n <= 10_000).map(Some).ok_or_else(|| format!("`{k}` must be 0..=10000"))
                }
            }
        };
        match t {
            "string" => {
                let (min, max) = (count("minLength")?.unwrap_or(0), count("maxLength")?);
                Ok(match max {
                    None if min == 0 => "string".into(),
                    None => format!("\"\\\"\" char{{{min},}} \"\\\"\""),
                    Some(max) if max < min => return Err("`maxLength` is below `minLength`".into()),
                    Some(max) => format!("\"\\\"\" char{{{min},{max}}} \"\\\"\""),
                })
            }
            "integer" => Ok("integer".into()),
            "number" => Ok("number".into()),
            "boolean" => Ok("boolean".into()),
            "null" => Ok("\"null\"".into()),
            "object" => {
                let Some(props) = obj.get("properties") else { return Ok("object".into()) };
                let Some(props) = props.as_object() else { return Err("`properties` must be an object".into()) };
                if props.is_empty() {
                    return Ok("\"{\" ws \"}\"".into());
                }
                let mut parts = Vec::new();
                for (name, schema) in props {
                    let value = self.expr(schema, depth + 1)?;
                    parts.push(format!("{} ws \":\" ws {value} ws", literal(&Value::String(name.clone()).to_string())));
                }
                Ok(format!("\"{{\" ws {} \"}}\"", parts.join(" \",\" ws ")))
            }
            "array" => {
                let item = match obj.get("items") {
                    None => "value".to_string(),
                    Some(s) => self.expr(s, depth + 1)?,
                };
                let (min, max) = (count("minItems")?.unwrap_or(0), count("maxItems")?);
                if max.is_some_and(|m| m < min) {
                    return Err("`maxItems` is below `minItems`".into());
                }
                let body = match max {
                    Some(0) => String::new(),
                    _ => {
                        let rest_min = min.saturating_sub(1);
                        let rest = match max {
                            None => format!("{{{rest_min},}}"),
                            Some(m) => format!("{{{rest_min},{}}}", m - 1),
                        };
                        let list = format!("{item} ws ( \",\" ws {item} ws ){rest}");
                        if min == 0 {
                            format!("( {list} )?")
                        } else {
                            list
                        }
                    }
                };
                Ok(format!("\"[\" ws {body} \"]\""))
            }
            other => Err(format!("unknown type `{other}`")),
        }
    }

    /// A rule for the definition `r` points to (made once; recursion refers to it).
    fn reference(&mut self, r: &Value, depth: usize) -> Result<String, String> {
        let path = r.as_str().ok_or("`$ref` must be a string")?;
        let name = path
            .strip_prefix("#/$defs/")
            .or_else(|| path.strip_prefix("#/definitions/"))
            .ok_or_else(|| format!("`$ref` {path:?}: only #/$defs/NAME and #/definitions/NAME are supported"))?;
        let rule = format!("{}def-{}", self.prefix, rule_name(name));
        if !self.defs_done.contains(&rule) {
            self.defs_done.push(rule.clone());
            let def = ["$defs", "definitions"]
                .iter()
                .find_map(|k| self.root.get(k)?.get(name))
                .ok_or_else(|| format!("`$ref` {path:?} points to nothing"))?;
            let body = self.expr(def, depth + 1)?;
            self.rules.insert(rule.clone(), body);
        }
        Ok(rule)
    }
}

/// A GBNF string literal matching `text` exactly.
fn literal(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out += "\\\"",
            '\\' => out += "\\\\",
            '\n' => out += "\\n",
            '\r' => out += "\\r",
            '\t' => out += "\\t",
            c if (c as u32) < 0x20 => out += &format!("\\x{:02x}", c as u32),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `( a | b | … )`.
fn alternatives(alts: impl Iterator<Item = String>) -> String {
    format!("( {} )", alts.collect::<Vec<_>>().join(" | "))
}

/// A rule name from a definition's name: letters, digits and dashes.
fn rule_name(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '-' }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn objects_list_every_property_in_order_with_their_types() {
        let g = from_schema(&json!({"type": "object", "properties": {
            "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}
        }, "required": ["name"]}))
        .unwrap();
        let root = g.lines().next().unwrap();
        assert!(
            root.starts_with("root ::= ws \"{\" ws \"\\\"name\\\"\" ws \":\" ws string ws \",\" ws \"\\\"age\\\"\""),
            "{root}"
        );
        assert!(root.contains("integer") && root.contains("( \"\\\"a\\\"\" | \"\\\"b\\\"\" )"), "{root}");
        assert!(root.contains("){0,2}"), "at most 3 items: {root}");
    }

    #[test]
    fn references_become_rules_and_may_recurse() {
        let g = from_schema(&json!({"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
            "value": {"type": "number"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}))
        .unwrap();
        assert!(g.starts_with("root ::= ws def-node ws"), "{g}");
        let rule = g.lines().find(|l| l.starts_with("def-node ::=")).unwrap();
        assert!(rule.contains("def-node"), "the rule refers to itself: {rule}");
    }

    #[test]
    fn constraints_it_cannot_follow_are_refused_by_name() {
        for (schema, word) in [
            (json!({"type": "string", "pattern": "^a+$"}), "pattern"),
            (json!({"type": "integer", "minimum": 3}), "minimum"),
            (json!({"type": "string", "format": "date-time"}), "format"),
            (json!({"allOf": [{"type": "string"}]}), "allOf"),
            (json!({"$ref": "http://example.com/s.json"}), "$ref"),
            (json!({"$ref": "#/$defs/missing"}), "points to nothing"),
            (json!({"type": "colour"}), "colour"),
            (json!({"type": "array", "minItems": 4, "maxItems": 2}), "maxItems"),
            (json!(7), "object"),
        ] {
            let e = from_schema(&schema).unwrap_err();
            assert!(e.contains(word), "{schema}: {e}");
        }
        let mut deep = json!({"type": "string"});
        for _ in 0..40 {
            deep = json!({"type": "array", "items": deep});
        }
        assert!(from_schema(&deep).unwrap_err().contains("deeper"));
    }

    #[test]
    fn literals_escape_what_gbnf_needs() {
        assert_eq!(literal("a\"b\\c\nd"), "\"a\\\"b\\\\c\\nd\"");
        assert_eq!(literal("\u{1}"), "\"\\x01\"");
        let g = from_schema(&json!({"const": "say \"hi\""})).unwrap();
        assert!(g.starts_with("root ::= ws \"\\\"say \\\\\\\"hi\\\\\\\"\\\"\" ws"), "{g}");
    }
}
