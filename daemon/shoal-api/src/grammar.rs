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
    Structured::object().grammar()
}

/// The grammar of the JSON values `schema` describes, or why it cannot be followed.
pub fn from_schema(schema: &Value) -> Result<String, String> {
    Structured::schema(schema).map(|s| s.grammar())
}

/// A reply held to JSON (OpenAI's `response_format` `json_object` or `json_schema`,
/// Ollama's `format`): the expression of its value and the rules that expression
/// needs, kept apart so that a tool-calling grammar can offer it beside the calls.
#[derive(Clone, Debug, PartialEq)]
pub struct Structured {
    /// The GBNF expression of the value (over [`BASE`]'s rules and `rules`).
    expr: String,
    /// Named rules the expression refers to (a schema's definitions), by name. Their
    /// names start `def-`, which no other rule of a tool grammar uses.
    rules: BTreeMap<String, String>,
    /// The schema, when one was given (the generic tool format tells it the model).
    schema: Option<Value>,
}

impl Structured {
    /// Any JSON object.
    pub fn object() -> Structured {
        Structured { expr: "object".into(), rules: BTreeMap::new(), schema: None }
    }

    /// The JSON values `schema` describes, or why it cannot be followed.
    pub fn schema(schema: &Value) -> Result<Structured, String> {
        let mut c = Converter { root: schema, prefix: String::new(), rules: BTreeMap::new(), defs_done: Vec::new() };
        let expr = c.expr(schema, 0)?;
        let s = Structured { expr, rules: c.rules, schema: Some(schema.clone()) };
        let size = s.grammar().len();
        if size > shoal_types::MAX_GRAMMAR_BYTES {
            return Err(format!("the schema is too large ({size} bytes of grammar)"));
        }
        // Each count becomes that many rules when the tail builds the sampler.
        let n = shoal_types::grammar_repetitions(&s.grammar());
        if n > shoal_types::MAX_GRAMMAR_REPETITIONS {
            return Err(format!(
                "the schema's maxLength, maxItems and the like add up to {n} repetitions (at most {})",
                shoal_types::MAX_GRAMMAR_REPETITIONS
            ));
        }
        Ok(s)
    }

    /// The grammar of an answer that is this value alone.
    pub fn grammar(&self) -> String {
        let mut out = format!("root ::= ws {} ws\n{BASE}", self.expr);
        out += &self.rules();
        out
    }

    /// The schema the value follows, if one was given (else: any JSON object).
    pub fn schema_given(&self) -> Option<&Value> {
        self.schema.as_ref()
    }

    /// The named rules, one a line.
    fn rules(&self) -> String {
        self.rules.iter().map(|(name, body)| format!("{name} ::= {body}\n")).collect()
    }
}

/// What a tool-calling answer may be besides calls (see [`tool_answer`]).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Besides<'a> {
    /// Nothing: a call is required.
    Nothing,
    /// A reply in words: `{"response": "…"}` in the generic format; in a model's own
    /// syntax, free text (no grammar is made then).
    Text,
    /// A reply that is this JSON value: `{"response": VALUE}` in the generic format;
    /// in a model's own syntax the value as the syntax writes a reply (Command R7B's
    /// between `<|START_RESPONSE|>` and `<|END_RESPONSE|>`; Command R+'s as the whole
    /// answer or after an action list of `directly-answer`; DeepSeek's after its
    /// thinking is closed; the others' (Hermes', Qwen3-Coder's, Llama 3's, Mistral's) as
    /// the whole answer).
    Json(&'a Structured),
}

/// Most tool calls one answer may make (a bound, so a looping model stops).
const MAX_CALLS: usize = 8;

/// Harmony's thinking before a call or reply: an `analysis` message (text without
/// `<|`, so it ends only at its `<|end|>`), then the next message's start.
const HARMONY_THOUGHT: &str =
    "thought ::= \"<|channel|>analysis<|message|>\" ( [^<] | \"<\" [^|] )* \"<|end|><|start|>assistant\"\n";

/// A Mistral call id: 9 letters or digits, as Mistral's templates require.
const MISTRAL_ID: &str = "[a-zA-Z0-9]{9}";

/// What opens Command R+'s action list: `Action:`, then on the same line (as Cohere's
/// model card shows the model's answer) or the next (as the template writes earlier
/// calls), the fence and the list's `[`.
const PLUS_OPEN: &str = "\"Action:\" [ \\n] \"```json\\n[\" ws";

/// What closes it: the list's `]` and the fence, on the list's last line (as the
/// template writes it) or the next (as the model card shows it).
const PLUS_CLOSE: &str = "ws \"]\" \"\\n\"? \"```\"";

/// The grammar of a tool-calling answer (see `tools`): `{"tool_calls": [{"name",
/// "arguments"}]}` naming one of `tools` (name, parameter schema) with arguments its
/// schema allows, several calls when `parallel`, or a reply as `besides` says. In a
/// model's own `syntax` instead: Hermes' `<tool_call>\n{"name", "arguments"}\n</tool_call>`
/// blocks, one per line; Llama 3's one object `{"name", "parameters"}`; Command R7B's
/// `<|START_ACTION|>[{"tool_call_id", "tool_name", "parameters"}, …]<|END_ACTION|>`;
/// Command R+'s ``Action: ```json\n[{"tool_name", "parameters"}, …]\n``` ``;
/// Qwen3-Coder's `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n…
/// </function>\n</tool_call>` blocks, one per line (see [`xml_parameters`]);
/// DeepSeek R1's `<｜tool▁calls▁begin｜>` then calls
/// `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>`
/// one per line, then `<｜tool▁calls▁end｜>`; V3.1's the same with calls
/// `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>` chained; Mistral
/// Nemo's `[TOOL_CALLS][{"name", "arguments", "id"}, …]`; later Mistrals'
/// `[TOOL_CALLS]NAME[ARGS]ARGS` chained (`NAME[CALL_ID]ID[ARGS]ARGS` allowed where the
/// template writes ids); harmony's one `<|channel|>commentary to=functions.NAME
/// <|constrain|>json<|message|>ARGS`, maybe after an `analysis` message; a reply there
/// is offered only as JSON ([`Besides::Json`]; free text needs no grammar). A tool's
/// schema the grammar cannot follow (or one making the grammar too large or its repetitions too many) allows any
/// JSON object; the reply's schema is always followed (it was checked when the request
/// was read).
pub(crate) fn tool_answer(tools: &[(&str, &Value)], besides: Besides, parallel: bool, syntax: ToolSyntax) -> String {
    // Up to MAX_CALLS of `item` after the first, each after `sep`, when parallel.
    let more = |sep: &str, item: &str| {
        if parallel {
            format!(" ( {sep} {item} ){{0,{}}}", MAX_CALLS - 1)
        } else {
            String::new()
        }
    };
    let json_reply = match besides {
        Besides::Json(s) => Some(s),
        Besides::Nothing | Besides::Text => None,
    };
    let build = |strict: bool| {
        let mut rules = BTreeMap::new();
        let mut calls = Vec::new();
        for (i, (name, params)) in tools.iter().enumerate() {
            let mut c =
                Converter { root: params, prefix: format!("t{i}-"), rules: BTreeMap::new(), defs_done: Vec::new() };
            // Qwen3-Coder's XML writes each parameter on its own (see `xml_parameters`).
            let args = if strict && syntax != ToolSyntax::QwenXml { c.expr(params, 0).ok() } else { None };
            let args = match args {
                Some(a) => {
                    rules.append(&mut c.rules);
                    a
                }
                None => "object".to_string(),
            };
            let rule = format!("call-{i}");
            let quoted = literal(&Value::String((*name).to_string()).to_string());
            // `"key": value` members of a JSON object.
            let object = |members: &[(&str, &str)]| {
                let members: Vec<String> =
                    members.iter().map(|(k, v)| format!("{} ws \":\" ws {v} ws", literal(k))).collect();
                format!("\"{{\" ws {} \"}}\"", members.join(" \",\" ws "))
            };
            let body = match syntax {
                ToolSyntax::Generic | ToolSyntax::Hermes => object(&[("\"name\"", &quoted), ("\"arguments\"", &args)]),
                ToolSyntax::QwenXml => {
                    let parameters = xml_parameters(&c.prefix, params, strict, &mut rules);
                    format!("{} {parameters} \"</function>\\n\"", literal(&format!("<function={name}>\n")))
                }
                ToolSyntax::Llama3 => object(&[("\"name\"", &quoted), ("\"parameters\"", &args)]),
                // The template numbers calls from 0 across the conversation; any
                // small number will do for a new one.
                ToolSyntax::CommandR7b => object(&[
                    ("\"tool_call_id\"", "\"\\\"\" [0-9]{1,4} \"\\\"\""),
                    ("\"tool_name\"", &quoted),
                    ("\"parameters\"", &args),
                ]),
                ToolSyntax::CommandRPlus => object(&[("\"tool_name\"", &quoted), ("\"parameters\"", &args)]),
                // DeepSeek writes the name bare.
                ToolSyntax::DeepSeekR1 { .. } => format!("{} \"\\n```json\\n\" {args} \"\\n```\"", literal(name)),
                ToolSyntax::DeepSeekV31 { .. } => format!("{} \"<｜tool▁sep｜>\" {args}", literal(name)),
                // The id the model gives its call (the API sends its own).
                ToolSyntax::MistralNemo => object(&[
                    ("\"name\"", &quoted),
                    ("\"arguments\"", &args),
                    ("\"id\"", &format!("\"\\\"\" {MISTRAL_ID} \"\\\"\"")),
                ]),
                // Mistral writes the name bare; an id only where its template showed ids.
                ToolSyntax::Mistral { call_ids } => {
                    let id = if call_ids { format!(" ( \"[CALL_ID]\" {MISTRAL_ID} )?") } else { String::new() };
                    format!("{}{id} \"[ARGS]\" {args}", literal(name))
                }
                // Harmony names the function in the header, then its arguments' format.
                ToolSyntax::Harmony => format!("{} \" <|constrain|>json<|message|>\" {args}", literal(name)),
            };
            rules.insert(rule.clone(), body);
            calls.push(rule);
        }
        let call = format!("call ::= {}\n", alternatives(calls.into_iter()));
        // The calls (the root's expression) and the rules they need besides `call`.
        let (calls, extra) = match syntax {
            ToolSyntax::Hermes => (
                format!("block{}", more("\"\\n\"", "block")),
                "block ::= \"<tool_call>\\n\" call \"\\n</tool_call>\"\n".to_string(),
            ),
            // One block per line, as the template writes earlier calls.
            ToolSyntax::QwenXml => (
                format!("block{}", more("\"\\n\"", "block")),
                format!("block ::= \"<tool_call>\\n\" call \"</tool_call>\"\n{}", xml_rules()),
            ),
            // Llama 3's templates allow one call per message.
            ToolSyntax::Llama3 => ("call".to_string(), String::new()),
            // A template that opens the model's thinking (Cohere's later ones) has it
            // closed at once, as llama.cpp does.
            ToolSyntax::CommandR7b => (
                format!(
                    "( \"<|END_THINKING|>\" )? \"<|START_ACTION|>[\" ws call{} ws \"]<|END_ACTION|>\"",
                    more("ws \",\" ws", "call")
                ),
                String::new(),
            ),
            // One list, as the model card shows it (no plan before it: a call is asked
            // for, not a plan).
            ToolSyntax::CommandRPlus => {
                (format!("{PLUS_OPEN} call{} {PLUS_CLOSE}", more("ws \",\" ws", "call")), String::new())
            }
            // Likewise `<think>` (llama.cpp's R1 template opens it).
            ToolSyntax::DeepSeekR1 { .. } => (
                format!(
                    "( \"</think>\" ws )? \"<｜tool▁calls▁begin｜>\" block{} \"<｜tool▁calls▁end｜>\"",
                    more("\"\\n\"", "block")
                ),
                "block ::= \"<｜tool▁call▁begin｜>function<｜tool▁sep｜>\" call \"<｜tool▁call▁end｜>\"\n".to_string(),
            ),
            ToolSyntax::DeepSeekV31 { .. } => (
                format!(
                    "( \"</think>\" ws )? \"<｜tool▁calls▁begin｜>\" block{} \"<｜tool▁calls▁end｜>\"",
                    more("", "block")
                ),
                "block ::= \"<｜tool▁call▁begin｜>\" call \"<｜tool▁call▁end｜>\"\n".to_string(),
            ),
            // One list after the marker (Mistral 7B v0.3's template writes a space first).
            ToolSyntax::MistralNemo => {
                (format!("\"[TOOL_CALLS]\" ws \"[\" ws call{} ws \"]\"", more("ws \",\" ws", "call")), String::new())
            }
            // Every call after its own marker.
            ToolSyntax::Mistral { .. } => {
                (format!("block{}", more("", "block")), "block ::= \"[TOOL_CALLS]\" call\n".to_string())
            }
            // One call per answer (gpt-oss's template keeps one call per message), after
            // the thinking if the model thinks first; `<|call|>` ends the generation.
            ToolSyntax::Harmony => {
                ("thought? \"<|channel|>commentary to=functions.\" call".to_string(), HARMONY_THOUGHT.to_string())
            }
            ToolSyntax::Generic => {
                let more =
                    if parallel { format!("( \",\" ws call ws ){{0,{}}}", MAX_CALLS - 1) } else { String::new() };
                let reply = !matches!(besides, Besides::Nothing);
                (
                    format!("ws {} ws", if reply { "( calls | reply )" } else { "calls" }),
                    format!(
                        "calls ::= \"{{\" ws {} ws \":\" ws \"[\" ws call ws {more} \"]\" ws \"}}\"\n",
                        literal("\"tool_calls\"")
                    ),
                )
            }
        };
        // In a model's own syntax a JSON reply is the root's other alternative.
        let native_reply = json_reply.is_some() && syntax != ToolSyntax::Generic;
        let mut out = format!("root ::= {calls}{}\n{extra}{call}", if native_reply { " | reply" } else { "" });
        let value = json_reply.map_or("string", |s| s.expr.as_str());
        match (syntax, besides) {
            (ToolSyntax::Generic, Besides::Text | Besides::Json(_)) => {
                out += &format!("reply ::= \"{{\" ws {} ws \":\" ws {value} ws \"}}\"\n", literal("\"response\""))
            }
            // A call is required, or a native reply is free text (no grammar then).
            (_, Besides::Nothing | Besides::Text) => {}
            (
                ToolSyntax::Hermes
                | ToolSyntax::QwenXml
                | ToolSyntax::Llama3
                | ToolSyntax::MistralNemo
                | ToolSyntax::Mistral { .. },
                Besides::Json(_),
            ) => out += &format!("reply ::= ws {value} ws\n"),
            // The reader takes what lies between the markers.
            (ToolSyntax::CommandR7b, Besides::Json(_)) => {
                out += &format!(
                    "reply ::= ( \"<|END_THINKING|>\" )? \"<|START_RESPONSE|>\" ws {value} ws \"<|END_RESPONSE|>\"\n"
                )
            }
            // The value alone, or after the action the template asks for when no tool
            // is called (the reader takes what follows it).
            (ToolSyntax::CommandRPlus, Besides::Json(_)) => {
                let member = |k: &str, v: &str| format!("{} ws \":\" ws {v}", literal(&format!("\"{k}\"")));
                let direct = format!(
                    "\"{{\" ws {} ws \",\" ws {} ws \"}}\"",
                    member("tool_name", &literal("\"directly-answer\"")),
                    member("parameters", "\"{\" ws \"}\"")
                );
                out += &format!("reply ::= ( {PLUS_OPEN} {direct} {PLUS_CLOSE} )? ws {value} ws\n")
            }
            // The reader drops the closed thinking before the value.
            (ToolSyntax::DeepSeekR1 { .. } | ToolSyntax::DeepSeekV31 { .. }, Besides::Json(_)) => {
                out += &format!("reply ::= ( \"</think>\" ws )? {value} ws\n")
            }
            // The final channel's message, after the thinking if the model thinks first.
            (ToolSyntax::Harmony, Besides::Json(_)) => {
                out += &format!("reply ::= thought? \"<|channel|>final<|message|>\" ws {value} ws\n")
            }
        }
        out += BASE;
        for (name, body) in &rules {
            out += &format!("{name} ::= {body}\n");
        }
        if let Some(s) = json_reply {
            out += &s.rules();
        }
        out
    };
    let strict = build(true);
    let within = strict.len() <= shoal_types::MAX_GRAMMAR_BYTES
        && shoal_types::grammar_repetitions(&strict) <= shoal_types::MAX_GRAMMAR_REPETITIONS;
    if within {
        strict
    } else {
        build(false)
    }
}

/// How a parameter's value is written in Qwen3-Coder's XML calls
/// ([`ToolSyntax::QwenXml`]), by its property's schema: as the template writes an
/// earlier call's (a string raw, any other value as JSON) and as Qwen's own parser
/// reads them (a property of no known type as text).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum XmlValue {
    /// The text as it is: a string, or a property whose type is not said (or that the
    /// schema does not list).
    Text,
    /// JSON: the schema allows no string.
    Json,
    /// JSON where the text reads as a JSON value other than a string, else the text:
    /// the schema allows strings and other values.
    TextOrJson,
}

/// How the value of `property` (a property's schema, `None` where the tool's
/// schema `root` does not list it) is written in an XML call.
pub(crate) fn xml_value(property: Option<&Value>, root: &Value) -> XmlValue {
    match property.and_then(|p| value_types(p, root, 0)) {
        None | Some((true, false)) => XmlValue::Text,
        Some((false, _)) => XmlValue::Json,
        Some((true, true)) => XmlValue::TextOrJson,
    }
}

/// Whether the values schema `s` allows include strings and whether they include
/// others (its `type`s, `enum` or `const` values, `anyOf`/`oneOf` alternatives,
/// `$ref`s followed); `None` where it says nothing of types (any value).
fn value_types(s: &Value, root: &Value, depth: usize) -> Option<(bool, bool)> {
    let obj = s.as_object().filter(|_| depth <= MAX_DEPTH)?;
    let of_value = |v: &Value| (v.is_string(), !v.is_string());
    let either = |a: (bool, bool), b: (bool, bool)| (a.0 || b.0, a.1 || b.1);
    let types = if let Some(r) = obj.get("$ref") {
        let path = r.as_str()?;
        let name = path.strip_prefix("#/$defs/").or_else(|| path.strip_prefix("#/definitions/"))?;
        let def = ["$defs", "definitions"].iter().find_map(|k| root.get(k)?.get(name))?;
        value_types(def, root, depth + 1)?
    } else if let Some(c) = obj.get("const") {
        of_value(c)
    } else if let Some(values) = obj.get("enum").and_then(Value::as_array) {
        values.iter().map(of_value).fold((false, false), either)
    } else if let Some(list) = obj.get("anyOf").or_else(|| obj.get("oneOf")).and_then(Value::as_array) {
        let mut types = (false, false);
        for s in list {
            types = either(types, value_types(s, root, depth + 1)?);
        }
        types
    } else {
        match obj.get("type") {
            Some(Value::String(t)) => (t == "string", t != "string"),
            Some(Value::Array(list)) => list
                .iter()
                .filter_map(Value::as_str)
                .map(|t| (t == "string", t != "string"))
                .fold((false, false), either),
            None if obj.contains_key("properties") || obj.contains_key("items") => (false, true),
            _ => return None,
        }
    };
    let nullable = obj.get("nullable") == Some(&Value::Bool(true));
    Some((types.0, types.1 || nullable))
}

/// The parameters of an XML call of a tool whose schema is `params` (the rules its
/// values need added to `rules`, their names after `prefix`): each listed property in
/// the schema's order (the order the template lists them in, and the model's, as in
/// the JSON syntaxes' grammars), `<parameter=KEY>\nVALUE\n</parameter>\n`, the required
/// ones always, the others optional. A value is as [`xml_value`] says:
/// text without `</parameter>` (within `maxLength` where one is given, as text
/// without `<`: a grammar cannot otherwise count the characters of text that must
/// avoid a word), or one of its `enum`/`const` strings; JSON of the property's schema (any JSON value where the grammar cannot
/// follow it); where both are allowed, text (which JSON is too). Parameters of any
/// names, as text, where the schema lists none or is not `strict`ly followed.
fn xml_parameters(prefix: &str, params: &Value, strict: bool, rules: &mut BTreeMap<String, String>) -> String {
    let properties = params.get("properties").and_then(Value::as_object).filter(|_| strict);
    let Some(properties) = properties else { return "xml-param*".to_string() };
    let required: Vec<&str> =
        params.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
    let mut out = Vec::new();
    for (key, schema) in properties {
        let value = match (xml_value(Some(schema), params), schema) {
            (XmlValue::Json, _) => {
                // A converter of its own: one that failed leaves no rule half made
                // for the other properties to refer to.
                let mut c = Converter {
                    root: params,
                    prefix: prefix.to_string(),
                    rules: BTreeMap::new(),
                    defs_done: Vec::new(),
                };
                match c.expr(schema, 1) {
                    Ok(expr) => {
                        rules.append(&mut c.rules);
                        expr
                    }
                    Err(_) => "value".to_string(),
                }
            }
            (XmlValue::TextOrJson, _) => "xml-text".to_string(),
            // Text of a schema with values: they are strings (else it would not be text).
            (XmlValue::Text, Value::Object(o)) if o.contains_key("enum") || o.contains_key("const") => {
                let values = o.get("const").map_or_else(
                    || o.get("enum").and_then(Value::as_array).cloned().unwrap_or_default(),
                    |c| vec![c.clone()],
                );
                let written: Vec<String> = values.iter().filter_map(Value::as_str).map(literal).collect();
                // (An `enum` that is not a list says nothing.)
                if written.is_empty() {
                    "xml-text".to_string()
                } else {
                    alternatives(written.into_iter())
                }
            }
            (XmlValue::Text, _) => {
                let count = |k: &str| schema.get(k).and_then(Value::as_u64).filter(|n| *n <= 10_000);
                match (count("minLength").unwrap_or(0), count("maxLength")) {
                    (min, Some(max)) if max >= min => format!("[^<]{{{min},{max}}}"),
                    (0, _) => "xml-text".to_string(),
                    (min, _) => format!("[^<]{{{min}}} xml-text"),
                }
            }
        };
        let parameter = format!("{} {value} {}", literal(&format!("<parameter={key}>\n")), literal("\n</parameter>\n"));
        out.push(if required.contains(&key.as_str()) { parameter } else { format!("( {parameter} )?") });
    }
    out.join(" ")
}

/// The rules of XML calls' values: `xml-text`, text without `</parameter>` (every
/// `<` but the text's last either starts a run of partial `</parameter>`s, each broken
/// by the next `<`, or begins one broken by a character it does not continue with);
/// `xml-param`, a parameter of any name with a text value.
fn xml_rules() -> String {
    const CLOSE: &str = "/parameter>";
    let broken = (0..CLOSE.len()).map(|n| {
        let next = &CLOSE[n..=n];
        match n {
            0 => format!("[^{next}<]"),
            _ => format!("{} [^{next}<]", literal(&CLOSE[..n])),
        }
    });
    let partial = (1..CLOSE.len()).map(|n| literal(&CLOSE[..n]));
    format!(
        "xml-text ::= ( [^<] | xml-lt )* xml-open?\n\
         xml-lt ::= xml-open* \"<\" {}\n\
         xml-open ::= \"<\" {}?\n\
         xml-param ::= \"<parameter=\" [^<>\\n]+ \">\\n\" xml-text \"\\n</parameter>\\n\"\n",
        alternatives(broken),
        alternatives(partial)
    )
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

/// A recognizer for these grammars, for tests (see its file).
#[cfg(test)]
pub(crate) mod gbnf;

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
    fn a_schema_whose_lengths_add_up_past_the_bound_is_refused() {
        // The review's schema (F14): many strings of maxLength 1,999 (each a count
        // llama.cpp expands into rules). Ten fit; a hundred do not.
        let strings = |n: usize| {
            let props: serde_json::Map<String, Value> =
                (0..n).map(|i| (format!("p{i}"), json!({"type": "string", "maxLength": 1999}))).collect();
            json!({"type": "object", "properties": props})
        };
        assert!(from_schema(&strings(9)).is_ok());
        let e = from_schema(&strings(100)).unwrap_err();
        assert!(e.contains("repetitions") && e.contains("20000"), "{e}");
        // Item counts count too.
        let items = json!({"type": "array", "items": {"type": "string", "maxLength": 10000}, "maxItems": 10000});
        assert!(from_schema(&items).unwrap_err().contains("repetitions"));
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

    /// The tests' recognizer reads these grammars as llama.cpp does.
    #[test]
    fn the_recognizer_accepts_json_and_refuses_the_rest() {
        let g = json_object();
        for ok in [r#"{}"#, r#" {"a": [1, -2.5e3, "x\"y", true, null, {"b": {}}]} "#] {
            assert!(gbnf::accepts(&g, ok), "{ok}");
        }
        for bad in [r#"{"a": }"#, r#"[1]"#, r#"{"a": 01}"#, "{\"a\": \"\u{1}\"}"] {
            assert!(!gbnf::accepts(&g, bad), "{bad}");
        }
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}, "s": {"enum": ["a", "b"]}}});
        let g = from_schema(&schema).unwrap();
        assert!(gbnf::accepts(&g, r#"{"n": 3, "s": "b"}"#));
        assert!(!gbnf::accepts(&g, r#"{"n": 3, "s": "c"}"#) && !gbnf::accepts(&g, r#"{"s": "a", "n": 3}"#));
    }

    #[test]
    fn literals_escape_what_gbnf_needs() {
        assert_eq!(literal("a\"b\\c\nd"), "\"a\\\"b\\\\c\\nd\"");
        assert_eq!(literal("\u{1}"), "\"\\x01\"");
        let g = from_schema(&json!({"const": "say \"hi\""})).unwrap();
        assert!(g.starts_with("root ::= ws \"\\\"say \\\\\\\"hi\\\\\\\"\\\"\" ws"), "{g}");
    }
}
