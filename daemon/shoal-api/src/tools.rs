//! Tool calling. Models whose template speaks a tool syntax Shoal reads (Hermes' for
//! Qwen 2.5 and 3 …, Qwen3-Coder's XML, Llama 3's, Command R7B's, Command R+'s,
//! DeepSeek R1's and V3.1's, Mistral's, gpt-oss's harmony: see [`ToolSyntax`]) get
//! their own: the template lists the tools (or, for DeepSeek's templates, which do
//! not, the system message does) and writes the conversation's calls and results, the
//! model answers in its syntax (held by a grammar when a call is required, or with
//! `auto` when the reply must be JSON of a given format; read back from free text with
//! `auto` otherwise). Any other model gets the generic format: the tools are described
//! in the system message, and a grammar holds the answer to one JSON object, either
//! `{"tool_calls": [{"name": …, "arguments": {…}}]}` or `{"response": "…"}` (the
//! generic format llama.cpp falls back to for templates without a tool syntax of their
//! own). A call names one of the request's tools, and its arguments follow the tool's
//! parameter schema, by construction. Earlier turns (the assistant's calls, the tools'
//! results) are written back in the same format, so the model reads its own
//! conversation. Pure: requests in, prompt turns and grammar out; the model's text in,
//! calls or a reply out.
//!
//! Shared by OpenAI's `tools`/`tool_choice` and Ollama's `tools` (whose `tool_choice`
//! is always auto).

use crate::backend::{ChatMessage, PromptOptions, TextModel, ToolSyntax};
use crate::grammar::{Besides, Structured, XmlValue};
use serde_json::{json, Value};
use std::ops::Range;

/// The tools a request offers and how the model may use them.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Toolbox {
    /// Offered tools, in the request's order.
    tools: Vec<Tool>,
    /// Whether the model must call, may call, or must call one named tool.
    choice: Choice,
    /// Several calls in one answer (OpenAI's `parallel_tool_calls`, default true).
    parallel: bool,
    /// The syntax the model calls in (the generic one until [`Toolbox::speak`]).
    syntax: ToolSyntax,
    /// The JSON a reply must be, with `auto` (OpenAI's `response_format`, Ollama's
    /// `format`); a reply in words when none.
    reply: Option<Structured>,
}

/// One function the model may call.
#[derive(Clone, Debug, PartialEq)]
struct Tool {
    name: String,
    /// The request's whole `function` object, shown to the model as given.
    described: Value,
    /// The arguments' JSON schema (`{"type": "object"}` when none was given).
    parameters: Value,
}

/// OpenAI's `tool_choice` (less `none`, which offers no toolbox at all).
#[derive(Clone, Debug, PartialEq)]
enum Choice {
    /// Call tools or answer: the model decides.
    Auto,
    /// Call at least one tool.
    Required,
    /// Call this tool.
    Named(String),
}

/// A tool call the model made.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Call {
    /// The call's id, as the client's history gives it (calls the model makes get
    /// theirs when they are sent).
    pub id: Option<String>,
    /// The tool's name (one of the request's).
    pub name: String,
    /// Its arguments (a JSON object, following the tool's schema).
    pub arguments: Value,
}

/// What the model's answer was, read back.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Reply {
    /// One or more tool calls.
    Calls(Vec<Call>),
    /// A reply to the user.
    Text(String),
}

/// A turn of the conversation as a client sent it, tool fields included.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Turn {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// Its text.
    pub content: String,
    /// The calls an assistant turn made.
    pub calls: Vec<Call>,
    /// Which call a tool turn answers (OpenAI's `tool_call_id`).
    pub call_id: Option<String>,
    /// The tool a tool turn is from, when the client says (Ollama's `tool_name`).
    pub tool: Option<String>,
}

/// Most tools one request may offer (each is a grammar alternative).
const MAX_TOOLS: usize = 128;

impl Toolbox {
    /// The toolbox of `tools` (OpenAI's and Ollama's shape: `{"type": "function",
    /// "function": {"name", "description", "parameters"}}`) used as `choice` says
    /// (OpenAI's `tool_choice`: `"auto"` when absent, `"none"`, `"required"`, or
    /// `{"type": "function", "function": {"name"}}`). `None` when no tool may be
    /// called: none offered, or `"none"`.
    pub fn new(tools: &[Value], choice: Option<&Value>, parallel: Option<bool>) -> Result<Option<Toolbox>, String> {
        if tools.len() > MAX_TOOLS {
            return Err(format!("tools: at most {MAX_TOOLS}"));
        }
        let tools = tools.iter().enumerate().map(|(i, t)| Tool::of(t).map_err(|e| format!("tools[{i}]: {e}")));
        let tools = tools.collect::<Result<Vec<_>, _>>()?;
        for (i, t) in tools.iter().enumerate() {
            if tools[..i].iter().any(|o| o.name == t.name) {
                return Err(format!("tools: the name {:?} is given twice", t.name));
            }
        }
        let choice = match choice {
            None | Some(Value::Null) => Choice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "auto" => Choice::Auto,
                "none" => return Ok(None),
                "required" => Choice::Required,
                other => return Err(format!("tool_choice {other:?}: expected auto, none, required or a function")),
            },
            Some(v) => {
                let name = v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
                match (v.get("type").and_then(Value::as_str), name) {
                    (Some("function"), Some(n)) if tools.iter().any(|t| t.name == n) => Choice::Named(n.to_string()),
                    (Some("function"), Some(n)) => return Err(format!("tool_choice names {n:?}, which is not a tool")),
                    _ => {
                        return Err("tool_choice: expected {\"type\": \"function\", \"function\": {\"name\": …}}".into())
                    }
                }
            }
        };
        if tools.is_empty() {
            return match choice {
                Choice::Auto => Ok(None),
                _ => Err("tool_choice asks for a tool call, but no tools are given".into()),
            };
        }
        Ok(Some(Toolbox {
            tools,
            choice,
            parallel: parallel.unwrap_or(true),
            syntax: ToolSyntax::Generic,
            reply: None,
        }))
    }

    /// Call in `syntax`, the model's (its template's) own.
    pub fn speak(&mut self, syntax: ToolSyntax) {
        self.syntax = syntax;
    }

    /// Hold a reply to `format` (OpenAI's `response_format`, Ollama's `format`): with
    /// `auto` the model calls tools or replies in that JSON; a required call has no
    /// reply, so the format does not apply to it (as OpenAI's API treats it).
    pub fn reply_as(&mut self, format: Option<Structured>) {
        self.reply = format;
    }

    /// Whether a reply, when there is one, is the model's text as it wrote it (so its
    /// tokens' log-probabilities are the reply's): always in a model's own syntax, and
    /// where no reply is offered (a cut-short answer is its text as it came); not in
    /// the generic format with `auto`, whose reply is the string or value inside
    /// `{"response": …}`, written in tokens that are not the reply's.
    pub fn replies_verbatim(&self) -> bool {
        self.syntax != ToolSyntax::Generic || self.choice != Choice::Auto
    }

    /// The grammar that holds the answer to a call of the offered tools (or, with
    /// `auto`, a reply: in the [`Toolbox::reply_as`] format when one is set). A tool
    /// whose parameter schema uses keywords the grammar cannot follow (`pattern`,
    /// `minimum`, …) gets any JSON object as arguments: the tool then checks them, as
    /// it must anyway. None in a model's own syntax with `auto` and no reply format:
    /// the model writes text or calls as it was trained to.
    pub fn grammar(&self) -> Option<String> {
        let callable: Vec<(&str, &Value)> = self
            .tools
            .iter()
            .filter(|t| match &self.choice {
                Choice::Named(n) => *n == t.name,
                Choice::Auto | Choice::Required => true,
            })
            .map(|t| (t.name.as_str(), &t.parameters))
            .collect();
        let besides = match (&self.choice, &self.reply) {
            (Choice::Auto, Some(format)) => Besides::Json(format),
            (Choice::Auto, None) => Besides::Text,
            (Choice::Required | Choice::Named(_), _) => Besides::Nothing,
        };
        match (self.syntax, besides) {
            // A reply in words in the model's own syntax: it writes freely.
            (ToolSyntax::Hermes | ToolSyntax::QwenXml | ToolSyntax::Llama3, Besides::Text)
            | (ToolSyntax::CommandR7b | ToolSyntax::CommandRPlus, Besides::Text)
            | (ToolSyntax::DeepSeekR1 { .. } | ToolSyntax::DeepSeekV31 { .. }, Besides::Text)
            | (ToolSyntax::MistralNemo | ToolSyntax::Mistral { .. } | ToolSyntax::Harmony, Besides::Text) => None,
            _ => Some(crate::grammar::tool_answer(&callable, besides, self.parallel, self.syntax)),
        }
    }

    /// What the model is told of the tools in the system message, where its own syntax
    /// is used but its template does not list them (DeepSeek's own templates): the
    /// tools and the syntax, as the model's makers describe them.
    fn told(&self) -> Option<String> {
        match self.syntax {
            ToolSyntax::DeepSeekR1 { lists_tools: false } => {
                let described: Vec<&Value> = self.tools.iter().map(|t| &t.described).collect();
                let list = serde_json::to_string_pretty(&described).unwrap_or_default();
                Some(format!(
                    "You can call any of the following function tools to satisfy the user's requests: {list}\n\n\
                     Example function tool call syntax:\n\n\
                     <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>example_function_name\n\
                     ```json\n{{\n  \"arg1\": \"some_value\"\n}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
                ))
            }
            ToolSyntax::DeepSeekV31 { lists_tools: false } => {
                let mut out = String::from("## Tools\nYou have access to the following tools:\n");
                for t in &self.tools {
                    out += &format!("\n### {}\n", t.name);
                    if let Some(d) = t.described.get("description").and_then(Value::as_str) {
                        out += &format!("Description: {d}\n");
                    }
                    out += &format!("\nParameters: {}\n", t.parameters);
                }
                out += "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n\
                        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments\
                        <｜tool▁call▁end｜>{additional_tool_calls}<｜tool▁calls▁end｜>\n\n\
                        Where:\n\
                        - `tool_call_name` must be an exact match to one of the available tools\n\
                        - `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n\
                        - For multiple tool calls, chain them directly without separators or spaces";
                Some(out)
            }
            _ => None,
        }
    }

    /// What the model is told, after any system text of the client's: the tools, and
    /// the one JSON object its answer must be.
    fn instructions(&self) -> String {
        let described: Vec<&Value> = self.tools.iter().map(|t| &t.described).collect();
        let list = Value::from(described.into_iter().cloned().collect::<Vec<_>>()).to_string();
        let example = r#"{"tool_calls": [{"name": "tool_name", "arguments": {"arg1": "some_value"}}]}"#;
        let answer = match (&self.choice, &self.reply) {
            (Choice::Auto, None) => {
                "Respond in JSON format, either with `tool_calls` (a request to call tools) or with `response` \
                 (a reply to the user's request), as in {\"response\": \"…\"}."
                    .to_string()
            }
            (Choice::Auto, Some(format)) => {
                let value = match format.schema_given() {
                    Some(schema) => format!("a JSON value that follows this JSON schema: {schema}"),
                    None => "a JSON object".to_string(),
                };
                format!(
                    "Respond in JSON format, either with `tool_calls` (a request to call tools) or with `response` \
                     (a reply to the user's request), whose value is {value}, as in {{\"response\": {{…}}}}."
                )
            }
            (Choice::Required, _) => "Respond in JSON format with `tool_calls` (a request to call tools).".to_string(),
            (Choice::Named(n), _) => format!("Respond in JSON format with `tool_calls`, calling the tool {n:?}."),
        };
        format!(
            "You can call any of the following tools to satisfy the user's requests: {list}\n\n\
             Example tool call syntax:\n\n{example}\n\n{answer}"
        )
    }

    /// The model's answer (held by [`Toolbox::grammar`]) read back: its calls, or its
    /// reply. Text that is not such an object (an answer cut by `max_tokens`) is
    /// returned as it is, as a reply. A reply held to a JSON format is that JSON's
    /// text: in the generic format the `response` value written out (a string value
    /// too, quoted, as JSON); DeepSeek's without the closed thinking before it; Command
    /// R+'s after its `directly-answer` action, where it wrote one.
    pub fn read(&self, text: &str) -> Reply {
        let json_reply = self.reply.is_some() && self.choice == Choice::Auto;
        match self.syntax {
            ToolSyntax::Hermes => return read_hermes(text),
            ToolSyntax::QwenXml => return read_qwen_xml(text, &self.tools),
            // A JSON reply may itself look like a call (`{"name": …, "parameters": …}`):
            // the grammar allowed a call only of an offered tool, so any other name
            // was the reply.
            ToolSyntax::Llama3 => {
                return match read_llama3(text) {
                    Reply::Calls(c) if json_reply && !c.iter().all(|c| self.tools.iter().any(|t| t.name == c.name)) => {
                        Reply::Text(text.to_string())
                    }
                    r => r,
                }
            }
            ToolSyntax::CommandR7b => return read_command_r7b(text),
            // (A JSON reply cannot be taken for an action: an `Action:` within it is in a
            // string, and what follows it reads as a string, not a list.)
            ToolSyntax::CommandRPlus => return read_command_r_plus(text, &self.tools),
            ToolSyntax::DeepSeekR1 { .. } | ToolSyntax::DeepSeekV31 { .. } => {
                let v31 = matches!(self.syntax, ToolSyntax::DeepSeekV31 { .. });
                return match read_deepseek(text, v31) {
                    Reply::Text(_) if json_reply => Reply::Text(after_thinking(text).to_string()),
                    r => r,
                };
            }
            ToolSyntax::MistralNemo => return read_mistral_nemo(text),
            ToolSyntax::Mistral { .. } => return read_mistral(text),
            ToolSyntax::Harmony => return read_harmony(text),
            ToolSyntax::Generic => {}
        }
        let Ok(v) = serde_json::from_str::<Value>(text.trim()) else { return Reply::Text(text.to_string()) };
        if let Some(calls) = v.get("tool_calls").and_then(Value::as_array) {
            let calls: Option<Vec<Call>> = calls
                .iter()
                .map(|c| {
                    let name = c.get("name")?.as_str()?;
                    let arguments = c.get("arguments").cloned().unwrap_or(json!({}));
                    Some(Call { id: None, name: name.to_string(), arguments })
                })
                .collect();
            if let Some(calls) = calls.filter(|c| !c.is_empty()) {
                return Reply::Calls(calls);
            }
        }
        match v.get("response") {
            Some(r) if json_reply => Reply::Text(r.to_string()),
            Some(Value::String(r)) => Reply::Text(r.clone()),
            _ => Reply::Text(text.to_string()),
        }
    }

    /// Where `reply`, read from the answer `text` by [`Toolbox::read`], lies in
    /// `text` (bytes), so that its tokens can be told from the rest: the whole answer;
    /// Command R7B's after `<|START_RESPONSE|>`; Command R+'s after its action list
    /// where it lies there (else before it); DeepSeek's after its closed thinking.
    /// None where the reply is not a part of the text as written (the generic format's
    /// `response`, unescaped or written out again).
    pub fn reply_span(&self, text: &str, reply: &str) -> Option<Range<usize>> {
        if reply == text {
            return Some(0..text.len());
        }
        let from = match self.syntax {
            ToolSyntax::Generic => return None,
            ToolSyntax::Hermes
            | ToolSyntax::QwenXml
            | ToolSyntax::Llama3
            | ToolSyntax::MistralNemo
            | ToolSyntax::Mistral { .. }
            | ToolSyntax::Harmony => 0,
            ToolSyntax::CommandR7b => text.find(COHERE_REPLY).map_or(0, |i| i + COHERE_REPLY.len()),
            ToolSyntax::CommandRPlus => match plus_action(text) {
                Some((action, _)) if text[action.end..].contains(reply) => action.end,
                _ => 0,
            },
            ToolSyntax::DeepSeekR1 { .. } | ToolSyntax::DeepSeekV31 { .. } => text.len() - after_thinking(text).len(),
        };
        // The reply starts where its reader took it from, so the first match there is it.
        let at = from + text.get(from..)?.find(reply)?;
        Some(at..at + reply.len())
    }

    /// A new id for a call the model made, as the API sends it (OpenAI's `call_…`; for
    /// Mistral's syntaxes 9 letters or digits, the only ids their templates take back).
    pub fn new_call_id(&self) -> String {
        match self.syntax {
            ToolSyntax::MistralNemo | ToolSyntax::Mistral { .. } => mistral_id(&random_bytes()),
            _ => crate::common::new_id("call_"),
        }
    }

    /// The tokens of `text`'s vocabulary that are one of the syntax's markers and
    /// render as nothing (control tokens: Mistral's `[TOOL_CALLS]`, `[ARGS]` …), with
    /// the marker's text: a generation shows them as that text, so that the answer
    /// reads back (llama.cpp's server keeps such "preserved tokens" too).
    pub fn shown_markers(&self, text: &dyn TextModel) -> Vec<(shoal_types::TokenId, Vec<u8>)> {
        let markers: &[&str] = match self.syntax {
            ToolSyntax::MistralNemo => &["[TOOL_CALLS]"],
            ToolSyntax::Mistral { .. } => &["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"],
            // The special tokens of Qwen's vocabularies among Qwen3-Coder's markers
            // (`<function=`, `<parameter=` are text), as llama.cpp preserves them.
            ToolSyntax::QwenXml => &["<tool_call>", "</tool_call>"],
            // Harmony's are the thinking's too: every answer shows them (`gen::run`).
            // Command R7B's reader takes a bare list where its markers render as nothing;
            // Command R+'s `Action:` and fences are text.
            _ => &[],
        };
        crate::thinking::shown_markers(text, markers)
    }
}

/// DeepSeek's answer after a closed thinking (`</think>`) and the white space after it.
fn after_thinking(text: &str) -> &str {
    match text.find("</think>") {
        Some(i) => text[i + "</think>".len()..].trim_start(),
        None => text,
    }
}

/// A harmony answer read back (gpt-oss's): its calls, each a message addressed
/// `to=functions.NAME` whose body (after `<|message|>`, up to `<|call|>`, `<|end|>`,
/// the next `<|start|>` or the end) is a JSON object of arguments; any call that does
/// not read makes the whole answer text, as it came. No call: the text as it came (the
/// `final` channel's, where the thinking was kept apart).
fn read_harmony(text: &str) -> Reply {
    use crate::thinking::harmony;
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(harmony::TO_FUNCTIONS) {
        let after = &rest[at + harmony::TO_FUNCTIONS.len()..];
        let name_end = after.find(|c: char| c.is_whitespace() || c == '<').unwrap_or(after.len());
        let name = &after[..name_end];
        let Some(open) = after.find(harmony::MESSAGE) else { return Reply::Text(text.to_string()) };
        let body = &after[open + harmony::MESSAGE.len()..];
        let end = [harmony::CALL, harmony::END, harmony::START, harmony::RETURN]
            .iter()
            .filter_map(|m| body.find(m))
            .min()
            .unwrap_or(body.len());
        let arguments = serde_json::from_str::<Value>(body[..end].trim()).ok().filter(Value::is_object);
        match arguments {
            Some(arguments) if !name.is_empty() => calls.push(Call { id: None, name: name.to_string(), arguments }),
            _ => return Reply::Text(text.to_string()),
        }
        rest = &body[end..];
    }
    if !calls.is_empty() {
        return Reply::Calls(calls);
    }
    // An answer with its headers (the thinking not kept apart): the final message's body.
    const FINAL: &str = "<|channel|>final<|message|>";
    match text.rfind(FINAL) {
        Some(at) => {
            let body = &text[at + FINAL.len()..];
            let end = [harmony::END, harmony::RETURN, harmony::START].iter().filter_map(|m| body.find(m)).min();
            Reply::Text(body[..end.unwrap_or(body.len())].to_string())
        }
        None => Reply::Text(text.to_string()),
    }
}

/// Where Command R7B's reply starts.
const COHERE_REPLY: &str = "<|START_RESPONSE|>";

/// Where Mistral's calls start.
const MISTRAL_CALLS: &str = "[TOOL_CALLS]";

/// Mistral Nemo's answer read back: after `[TOOL_CALLS]` (text before it, the model's
/// thinking, is not part of the calls), one non-empty JSON list of `{"name",
/// "arguments"}` objects (their `id`s are the model's, not the client's: dropped) and
/// nothing but white space after it; anything else (no marker, a list that is not one
/// of calls or is cut short) is the text as it came.
fn read_mistral_nemo(text: &str) -> Reply {
    let calls = text.find(MISTRAL_CALLS).and_then(|at| {
        let list = serde_json::from_str::<Value>(text[at + MISTRAL_CALLS.len()..].trim()).ok()?;
        let calls = list
            .as_array()?
            .iter()
            .map(|c| {
                let name = c.get("name")?.as_str()?.to_string();
                Some(Call { id: None, name, arguments: arguments(c.get("arguments")) })
            })
            .collect::<Option<Vec<_>>>()?;
        (!calls.is_empty()).then_some(calls)
    });
    match calls {
        Some(calls) => Reply::Calls(calls),
        None => Reply::Text(text.to_string()),
    }
}

/// Later Mistrals' answer read back: from the first `[TOOL_CALLS]` (text before it is
/// not part of the calls), calls `[TOOL_CALLS]NAME[ARGS]{…}` (an id as
/// `NAME[CALL_ID]ID[ARGS]` allowed, and dropped) with only white space between and
/// after them; a call that does not read (no `[ARGS]`, a name with spaces, arguments
/// that are not one JSON object, a call cut short) makes the whole answer text.
fn read_mistral(text: &str) -> Reply {
    let Some(at) = text.find(MISTRAL_CALLS) else { return Reply::Text(text.to_string()) };
    let mut rest = &text[at..];
    let mut calls = Vec::new();
    while let Some(call) = rest.strip_prefix(MISTRAL_CALLS) {
        let Some((head, args)) = call.split_once("[ARGS]") else { return Reply::Text(text.to_string()) };
        let name = head.split_once("[CALL_ID]").map_or(head, |(name, _)| name);
        if name.is_empty() || name.contains(char::is_whitespace) || name.contains('[') {
            return Reply::Text(text.to_string());
        }
        // One JSON value, then whatever follows it (the next call).
        let mut values = serde_json::Deserializer::from_str(args).into_iter::<Value>();
        match values.next() {
            Some(Ok(arguments)) if arguments.is_object() => {
                calls.push(Call { id: None, name: name.to_string(), arguments });
            }
            _ => return Reply::Text(text.to_string()),
        }
        rest = args[values.byte_offset()..].trim_start();
    }
    if rest.is_empty() {
        Reply::Calls(calls)
    } else {
        Reply::Text(text.to_string())
    }
}

/// 12 random bytes (the clock's where the system has none to give: ids only tell
/// calls apart).
fn random_bytes() -> [u8; 12] {
    let mut bytes = [0u8; 12];
    if getrandom::getrandom(&mut bytes).is_err() {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        bytes.copy_from_slice(&nanos.to_le_bytes()[..12]);
    }
    bytes
}

/// A Mistral call id from `seed`: 9 letters or digits (the 64-bit FNV-1a hash of the
/// seed in base 62: 62^9 ids, more than 2^53, so different seeds seldom meet).
fn mistral_id(seed: &[u8]) -> String {
    const DIGITS: &[u8; 62] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in seed {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    (0..9)
        .map(|_| {
            let d = DIGITS[(h % 62) as usize] as char;
            h /= 62;
            d
        })
        .collect()
}

/// Whether `id` is one Mistral's templates take: 9 ASCII letters or digits.
fn is_mistral_id(id: &str) -> bool {
    id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// A conversation as Mistral's templates take it: an assistant turn with calls and no
/// text has content `""` rather than null (Ministral 3's and Devstral's templates take
/// the length of any content that is not a string or write its first block), and its
/// call ids (OpenAI's `tool_calls[].id`, `tool_call_id`) are as they require them, 9
/// letters or digits, so that clients' ids (`call_…`, Anthropic's `toolu_…`) render
/// instead of failing the template: an id that is one
/// already stays; another becomes a hash of itself, the same for the call and its
/// results, and never one an earlier id took. Calls without an id (Ollama's) get one,
/// and a result without one (Ollama's name only) answers the earliest call not yet
/// answered of the last assistant turn with calls (of its tool, when it is named).
fn for_mistral(messages: &mut Value) {
    /// The id `given` becomes, noted in `ids` (each id given, and what it became).
    fn short(given: &str, ids: &mut Vec<(String, String)>) -> String {
        if let Some((_, s)) = ids.iter().find(|(g, _)| g == given) {
            return s.clone();
        }
        let mut s = if is_mistral_id(given) { given.to_string() } else { mistral_id(given.as_bytes()) };
        // A clash (another id that hashed, or was, the same): hash again, salted.
        let mut salt = 0u32;
        while ids.iter().any(|(_, t)| *t == s) {
            salt += 1;
            s = mistral_id(format!("{given}#{salt}").as_bytes());
        }
        ids.push((given.to_string(), s.clone()));
        s
    }
    let Some(list) = messages.as_array_mut() else { return };
    let mut ids: Vec<(String, String)> = Vec::new();
    // The last assistant turn's calls not answered yet: (tool, id).
    let mut open: Vec<(String, String)> = Vec::new();
    for (turn, m) in list.iter_mut().enumerate() {
        if m.get("content").is_some_and(Value::is_null) {
            m["content"] = json!("");
        }
        if let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) {
            open.clear();
            for (i, c) in calls.iter_mut().enumerate() {
                let given = c.get("id").and_then(Value::as_str).map(str::to_string);
                // Named by its place, which no client's id looks like.
                let id = short(&given.unwrap_or_else(|| format!("#{turn}.{i}")), &mut ids);
                let tool = c.pointer("/function/name").and_then(Value::as_str).unwrap_or_default().to_string();
                c["id"] = json!(id);
                open.push((tool, id));
            }
        }
        if m.get("role").and_then(Value::as_str) == Some("tool") {
            let id = match m.get("tool_call_id").and_then(Value::as_str) {
                Some(given) => short(given, &mut ids),
                None => {
                    let tool = m.get("name").and_then(Value::as_str);
                    let at =
                        open.iter().position(|(t, _)| tool.is_none_or(|n| n == t)).or((!open.is_empty()).then_some(0));
                    match at {
                        Some(at) => open[at].1.clone(),
                        None => short(&format!("#{turn}"), &mut ids),
                    }
                }
            };
            open.retain(|(_, o)| *o != id);
            m["tool_call_id"] = json!(id);
        }
    }
}

/// Hermes' answer read back: the `<tool_call>` blocks holding `{"name", "arguments"}`
/// objects, or (none, or one that is not such an object) the text as a reply.
fn read_hermes(text: &str) -> Reply {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        let after = &rest[start + OPEN.len()..];
        // A block cut by `max_tokens` has no end: what is there is read.
        let (body, next) = match after.find(CLOSE) {
            Some(end) => (&after[..end], &after[end + CLOSE.len()..]),
            None => (after, ""),
        };
        let call = serde_json::from_str::<Value>(body.trim()).ok().and_then(|v| {
            let name = v.get("name")?.as_str()?.to_string();
            // Some models write the arguments as JSON text.
            Some(Call { id: None, name, arguments: arguments(v.get("arguments")) })
        });
        match call {
            Some(c) => calls.push(c),
            None => return Reply::Text(text.to_string()),
        }
        rest = next;
    }
    if calls.is_empty() {
        Reply::Text(text.to_string())
    } else {
        Reply::Calls(calls)
    }
}

/// Qwen3-Coder's answer read back: from the first `<tool_call>` (text before it, the
/// model's reasoning, is not part of the calls), blocks
/// `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n…</function>\n</tool_call>`
/// with only white space between and after them, each NAME one of `tools`; a VALUE,
/// less one newline either side (as the template writes it), typed by its property's
/// schema ([`XmlValue`]). Anything else (no call, a tag left open, a tool not offered,
/// a parameter given twice, text after the calls) is the text as it came.
fn read_qwen_xml(text: &str, tools: &[Tool]) -> Reply {
    const OPEN: &str = "<tool_call>";
    let Some(at) = text.find(OPEN) else { return Reply::Text(text.to_string()) };
    let mut rest = &text[at..];
    let mut calls = Vec::new();
    while !rest.is_empty() {
        match rest.strip_prefix(OPEN).and_then(|block| qwen_xml_call(block, tools)) {
            Some((call, next)) => {
                calls.push(call);
                rest = next.trim_start();
            }
            None => return Reply::Text(text.to_string()),
        }
    }
    Reply::Calls(calls)
}

/// One XML call, from after its `<tool_call>`: the call, and what follows its
/// `</tool_call>`; `None` where it does not read.
fn qwen_xml_call<'a>(block: &'a str, tools: &[Tool]) -> Option<(Call, &'a str)> {
    let (name, mut rest) = block.trim_start().strip_prefix("<function=")?.split_once('>')?;
    let tool = tools.iter().find(|t| t.name == name.trim())?;
    let properties = tool.parameters.get("properties");
    let mut arguments = serde_json::Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("</function>") {
            rest = after;
            break;
        }
        let (key, after) = rest.strip_prefix("<parameter=")?.split_once('>')?;
        let (value, after) = after.split_once("</parameter>")?;
        // A name that is not one, a name given twice, or a value holding the next
        // parameter's start (this one was left open).
        if key.is_empty() || key.contains(['<', '\n']) || arguments.contains_key(key) || value.contains("\n<parameter=")
        {
            return None;
        }
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let kind = crate::grammar::xml_value(properties.and_then(|p| p.get(key)), &tool.parameters);
        arguments.insert(key.to_string(), xml_typed(value, kind));
        rest = after;
    }
    let next = rest.trim_start().strip_prefix("</tool_call>")?;
    Some((Call { id: None, name: tool.name.clone(), arguments: Value::Object(arguments) }, next))
}

/// An XML call's value `text` as JSON, as `kind` says: a string; or the JSON it reads
/// as, where that is not a string (else the text, for the tool to judge), Python's
/// `True`, `False` and `None` read too where no string is allowed (a template rendered
/// by Python's Jinja writes them so, and the model learned from those).
fn xml_typed(text: &str, kind: XmlValue) -> Value {
    if kind == XmlValue::Text {
        return Value::String(text.to_string());
    }
    match serde_json::from_str::<Value>(text) {
        Ok(v) if !v.is_string() => v,
        _ if kind == XmlValue::Json => match text.trim() {
            "True" => Value::Bool(true),
            "False" => Value::Bool(false),
            "None" => Value::Null,
            _ => Value::String(text.to_string()),
        },
        _ => Value::String(text.to_string()),
    }
}

/// Llama 3's answer read back: the whole answer one `{"name", "parameters"}` object
/// (after the `<|python_tag|>` some answers start with), or text.
fn read_llama3(text: &str) -> Reply {
    let body = text.trim();
    let body = body.strip_prefix("<|python_tag|>").unwrap_or(body);
    let call = serde_json::from_str::<Value>(body).ok().and_then(|v| {
        let name = v.get("name")?.as_str()?.to_string();
        let arguments = match v.get("parameters").or_else(|| v.get("arguments")) {
            None | Some(Value::Null) => json!({}),
            Some(a) => a.clone(),
        };
        Some(Call { id: None, name, arguments })
    });
    match call {
        Some(c) => Reply::Calls(vec![c]),
        None => Reply::Text(text.to_string()),
    }
}

/// Command R7B's answer read back: the calls in its `<|START_ACTION|>` lists of
/// `{"tool_call_id", "tool_name", "parameters"}` objects (any of them not such a list:
/// the text), else its reply (what follows `<|START_RESPONSE|>`, up to
/// `<|END_RESPONSE|>`; a plan before it is not part of the reply), else the text. In a
/// model whose markers are control tokens, which render as nothing, a call comes as the
/// bare list: an answer that is all such a list is read as calls too.
fn read_command_r7b(text: &str) -> Reply {
    const OPEN: &str = "<|START_ACTION|>";
    const CLOSE: &str = "<|END_ACTION|>";
    const REPLY: &str = COHERE_REPLY;
    if !text.contains(OPEN) {
        if let Some(calls) = cohere_calls(text.trim()) {
            return Reply::Calls(calls);
        }
        return match text.split_once(REPLY) {
            // `split` yields at least the whole string.
            Some((_, reply)) => Reply::Text(reply.split("<|END_RESPONSE|>").next().unwrap_or(reply).to_string()),
            None => Reply::Text(text.to_string()),
        };
    }
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        let after = &rest[start + OPEN.len()..];
        // A list cut by `max_tokens` has no end: what is there is read.
        let (body, next) = match after.find(CLOSE) {
            Some(end) => (&after[..end], &after[end + CLOSE.len()..]),
            None => (after, ""),
        };
        match cohere_calls(body.trim()) {
            Some(mut c) => calls.append(&mut c),
            None => return Reply::Text(text.to_string()),
        }
        rest = next;
    }
    Reply::Calls(calls)
}

/// The calls of a Command R7B action list, `[{"tool_call_id", "tool_name",
/// "parameters"}, …]` (the ids are the model's count, not the client's: dropped); `None`
/// unless `body` is a non-empty list of such objects.
fn cohere_calls(body: &str) -> Option<Vec<Call>> {
    action_calls(&serde_json::from_str::<Value>(body).ok()?)
}

/// The calls of a Cohere action list (Command R7B's, with ids, or Command R+'s,
/// without): `{"tool_name", "parameters"}` objects; `None` unless `list` is a
/// non-empty list of such objects.
fn action_calls(list: &Value) -> Option<Vec<Call>> {
    let calls = list
        .as_array()?
        .iter()
        .map(|c| {
            let name = c.get("tool_name")?.as_str()?.to_string();
            Some(Call { id: None, name, arguments: arguments(c.get("parameters")) })
        })
        .collect::<Option<Vec<_>>>()?;
    (!calls.is_empty()).then_some(calls)
}

/// What opens Command R+'s action list.
const PLUS_ACTION: &str = "Action:";

/// The tool Command R+'s template tells the model to call when it answers without
/// tools, as the template spells it and as Cohere's model card does.
const DIRECTLY_ANSWER: [&str; 2] = ["directly-answer", "directly_answer"];

/// Command R+'s answer read back: the calls in its action list (see [`plus_action`];
/// text before it, a "Plan: …", is not part of them; text after a list of calls is
/// dropped, as the other Cohere reader drops it), less any `directly-answer`, which
/// stands for no call (unless the request offers a tool of that name). A list of
/// nothing but `directly-answer`: a reply, the text the model wrote after the list,
/// else before it, else (it wrote the action alone) the whole answer as it came, so
/// that the client sees what the model said rather than an empty reply. No list, or
/// one that is not of calls: the text as it came.
fn read_command_r_plus(text: &str, tools: &[Tool]) -> Reply {
    let Some((action, calls)) = plus_action(text) else { return Reply::Text(text.to_string()) };
    let direct = |c: &Call| DIRECTLY_ANSWER.contains(&c.name.as_str()) && !tools.iter().any(|t| t.name == c.name);
    let calls: Vec<Call> = calls.into_iter().filter(|c| !direct(c)).collect();
    if !calls.is_empty() {
        return Reply::Calls(calls);
    }
    let (before, after) = (text[..action.start].trim(), text[action.end..].trim());
    let reply = [after, before].into_iter().find(|t| !t.is_empty()).unwrap_or(text);
    Reply::Text(reply.to_string())
}

/// Command R+'s action in `text`: where it lies (from its `Action:` to the end of the
/// fence closing its list, or of the list where the fence is left open, as at the end
/// of a generation cut short) and its calls. The first `Action:` then, after any white
/// space, a `` ```json `` (or bare `` ``` ``) fence, or none, and a non-empty JSON list
/// of `{"tool_name", "parameters"}` objects; `None` otherwise.
fn plus_action(text: &str) -> Option<(Range<usize>, Vec<Call>)> {
    let at = text.find(PLUS_ACTION)?;
    let after = text[at + PLUS_ACTION.len()..].trim_start();
    let body = after.strip_prefix("```json").or_else(|| after.strip_prefix("```")).unwrap_or(after).trim_start();
    // The list is the first JSON value: what follows it (the fence's close, words)
    // is not read as JSON.
    let mut values = serde_json::Deserializer::from_str(body).into_iter::<Value>();
    let list = values.next()?.ok()?;
    let calls = action_calls(&list)?;
    let rest = body.get(values.byte_offset()..)?;
    let rest = rest.trim_start().strip_prefix("```").unwrap_or(rest);
    Some((at..text.len() - rest.len(), calls))
}

/// The ways DeepSeek's models open their calls: the template's marker, and the
/// variants R1's distills are known to write instead (llama.cpp accepts the same).
const DEEPSEEK_OPENINGS: [&str; 5] = [
    "<｜tool▁calls▁begin｜>",
    "<｜tool_calls_begin｜>",
    "<｜tool calls begin｜>",
    "<｜tool\\_calls\\_begin｜>",
    "<｜tool▁calls｜>",
];

/// DeepSeek's answer read back (R1's calls, or V3.1's with `v31`): the calls after
/// the first opening marker, up to `<｜tool▁calls▁end｜>`, each (after an optional
/// `<｜tool▁call▁begin｜>`) up to its `<｜tool▁call▁end｜>`; any call that does not read
/// (or none at all) makes the whole answer text, as it came. Text before the calls
/// (the model's thinking) is not part of them.
fn read_deepseek(text: &str, v31: bool) -> Reply {
    const BEGIN: &str = "<｜tool▁call▁begin｜>";
    const END: &str = "<｜tool▁call▁end｜>";
    const ALL_END: &str = "<｜tool▁calls▁end｜>";
    let opening = DEEPSEEK_OPENINGS.iter().filter_map(|m| Some((text.find(m)?, m.len()))).min();
    let Some((at, len)) = opening else { return Reply::Text(text.to_string()) };
    let mut rest = &text[at + len..];
    let mut calls = Vec::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() || rest.starts_with(ALL_END) {
            break;
        }
        let call = rest.strip_prefix(BEGIN).unwrap_or(rest);
        // A call cut by `max_tokens` has no end: what is there is read.
        let (body, next) = match call.find(END) {
            Some(end) => (&call[..end], &call[end + END.len()..]),
            None => (call, ""),
        };
        match deepseek_call(body, v31) {
            Some(c) => calls.push(c),
            None => return Reply::Text(text.to_string()),
        }
        rest = next;
    }
    if calls.is_empty() {
        Reply::Text(text.to_string())
    } else {
        Reply::Calls(calls)
    }
}

/// One DeepSeek call between its markers: R1's `function<｜tool▁sep｜>NAME\n```json\n{…}\n```
/// (the type before the separator, the name on its line) or V3.1's `NAME<｜tool▁sep｜>{…}`;
/// the arguments must be a JSON object (a fence around them is allowed in both).
fn deepseek_call(body: &str, v31: bool) -> Option<Call> {
    let (head, tail) = body.split_once("<｜tool▁sep｜>")?;
    let (name, args) = if v31 { (head, tail) } else { tail.split_once('\n')? };
    let name = name.trim();
    if name.is_empty() || name.contains(char::is_whitespace) {
        return None;
    }
    let args = args.trim();
    let args = args.strip_prefix("```json").or_else(|| args.strip_prefix("```")).unwrap_or(args);
    let args = args.strip_suffix("```").unwrap_or(args);
    let arguments = serde_json::from_str::<Value>(args.trim()).ok().filter(Value::is_object)?;
    Some(Call { id: None, name: name.to_string(), arguments })
}

/// The prompt of `turns` for `text`'s model, with `toolbox` offered: through the
/// model's own template and tool syntax where it has one, in the generic format
/// ([`prompt_turns`]) otherwise.
pub(crate) fn prompt(
    text: &dyn TextModel,
    turns: &[Turn],
    toolbox: Option<&Toolbox>,
    options: &PromptOptions,
) -> Result<String, String> {
    match toolbox {
        Some(b) if b.syntax != ToolSyntax::Generic => {
            let mut tools: Vec<Value> =
                b.tools.iter().map(|t| json!({"type": "function", "function": t.described})).collect();
            let mut messages = openai_messages(turns);
            if let Some(told) = b.told() {
                add_to_system(&mut messages, &told);
            }
            if matches!(b.syntax, ToolSyntax::MistralNemo | ToolSyntax::Mistral { .. }) {
                for_mistral(&mut messages);
            }
            if matches!(b.syntax, ToolSyntax::Harmony | ToolSyntax::CommandRPlus) {
                // gpt-oss's template looks inside every assistant turn's content (as
                // text: null is an error there, as in Python's Jinja); Command R+'s
                // writes a call's content, trimmed, before its action (a null one as
                // "None", as Python's Jinja writes it).
                for m in messages.as_array_mut().into_iter().flatten() {
                    if m["content"].is_null() {
                        m["content"] = json!("");
                    }
                }
            }
            if b.syntax == ToolSyntax::CommandRPlus {
                for (tool, t) in tools.iter_mut().zip(&b.tools) {
                    tool["function"]["parameters"] = for_command_r_plus(&t.parameters);
                }
            }
            text.chat_prompt_with_tools_as(&messages, &Value::Array(tools), options)
        }
        _ => text.chat_prompt_as(&prompt_turns(turns, toolbox), options),
    }
}

/// A tool's parameter schema as Command R+'s template can list it: the template adds
/// each property's `description` to its text and looks names up in `required` and
/// `properties`, and an undefined one is an error there (as in Python's Jinja), where a
/// schema may leave them out: missing ones are given, empty.
fn for_command_r_plus(parameters: &Value) -> Value {
    let mut out = parameters.clone();
    let Some(schema) = out.as_object_mut() else { return out };
    let properties = schema.entry("properties").or_insert_with(|| json!({}));
    for property in properties.as_object_mut().into_iter().flat_map(|p| p.values_mut()) {
        if let Some(p) = property.as_object_mut() {
            p.entry("description").or_insert_with(|| json!(""));
        }
    }
    schema.entry("required").or_insert_with(|| json!([]));
    out
}

/// `messages` (OpenAI's shape) with `text` joined to the system message (one is added
/// first when there is none).
fn add_to_system(messages: &mut Value, text: &str) {
    let Some(list) = messages.as_array_mut() else { return };
    match list.first_mut() {
        Some(first) if first["role"] == "system" => {
            let content = first["content"].as_str().unwrap_or_default();
            first["content"] = json!(format!("{content}\n\n{text}"));
        }
        _ => list.insert(0, json!({"role": "system", "content": text})),
    }
}

/// `turns` in OpenAI's shape, as chat templates read them: an assistant's calls as
/// `tool_calls` (arguments as objects, as Hugging Face passes them; the content null
/// when the turn has no text, as OpenAI's is, which templates test for), a tool's result
/// with its `tool_call_id` and the tool's `name`.
fn openai_messages(turns: &[Turn]) -> Value {
    let mut names = CallNames::default();
    let out = turns.iter().map(|t| {
        let mut m = json!({"role": t.role, "content": t.content});
        if !t.calls.is_empty() {
            names.note(&t.calls);
            let calls: Vec<Value> = t
                .calls
                .iter()
                .map(|c| {
                    let mut call = json!({"type": "function", "function": {"name": c.name, "arguments": c.arguments}});
                    if let Some(id) = &c.id {
                        call["id"] = json!(id);
                    }
                    call
                })
                .collect();
            m["tool_calls"] = Value::Array(calls);
            if t.content.is_empty() {
                // DeepSeek R1's template writes any content that is not none as a
                // reply of its own.
                m["content"] = Value::Null;
            }
        }
        if t.role == "tool" {
            let name = names.of(t);
            if let Some(id) = &t.call_id {
                m["tool_call_id"] = json!(id);
            }
            if let Some(name) = name {
                m["name"] = json!(name);
            }
        }
        m
    });
    Value::Array(out.collect())
}

impl Tool {
    fn of(v: &Value) -> Result<Tool, String> {
        if v.get("type").and_then(Value::as_str) != Some("function") {
            return Err("only tools of type \"function\" are supported".into());
        }
        let f = v.get("function").filter(|f| f.is_object()).ok_or("function is missing")?;
        let name = f.get("name").and_then(Value::as_str).ok_or("function.name is missing")?;
        // OpenAI's own rule: what a call's name can be matched against.
        let valid = !name.is_empty()
            && name.len() <= 64
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.');
        if !valid {
            return Err(format!("function.name {name:?}: 1 to 64 letters, digits, _ - or ."));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(p) if p.is_object() => p.clone(),
            Some(_) => return Err("function.parameters must be a JSON schema object".into()),
        };
        Ok(Tool { name: name.to_string(), described: f.clone(), parameters })
    }
}

/// The conversation as the chat template gets it: the toolbox's instructions joined to
/// the system message (one is added first when the client sent none), an assistant's
/// calls and every assistant reply (while tools are offered) written as the JSON the
/// model answers in, and a tool's result as a user turn holding a `tool_response`
/// (templates without a tool role would drop or garble it).
pub(crate) fn prompt_turns(turns: &[Turn], toolbox: Option<&Toolbox>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(turns.len() + 1);
    let mut names = CallNames::default();
    for t in turns {
        let content = match t.role.as_str() {
            "assistant" if !t.calls.is_empty() => {
                names.note(&t.calls);
                let calls: Vec<Value> =
                    t.calls.iter().map(|c| json!({"name": c.name, "arguments": c.arguments})).collect();
                json!({"tool_calls": calls}).to_string()
            }
            "assistant" if toolbox.is_some() => json!({"response": t.content}).to_string(),
            "tool" => {
                let tool = names.of(t);
                let mut r = json!({"content": t.content});
                if let Some(tool) = tool {
                    r["tool"] = json!(tool);
                }
                if let Some(id) = &t.call_id {
                    r["tool_call_id"] = json!(id);
                }
                json!({"tool_response": r}).to_string()
            }
            _ => t.content.clone(),
        };
        let role = if t.role == "tool" { "user" } else { t.role.as_str() };
        out.push(ChatMessage { role: role.to_string(), content });
    }
    if let Some(b) = toolbox {
        let text = b.instructions();
        match out.first_mut() {
            Some(first) if first.role == "system" => first.content = format!("{}\n\n{text}", first.content),
            _ => out.insert(0, ChatMessage { role: "system".into(), content: text }),
        }
    }
    out
}

/// The calls of an assistant turn in OpenAI's shape (`[{"id", "type": "function",
/// "function": {"name", "arguments": "<JSON text>"}}]`) or Ollama's
/// (`[{"function": {"name", "arguments": {…}}}]`); arguments given as JSON text are
/// parsed (text that is not JSON stays a string).
pub(crate) fn calls_of(v: &Value) -> Result<Vec<Call>, String> {
    let Some(list) = v.as_array() else { return Err("tool_calls must be a list".into()) };
    list.iter()
        .map(|c| {
            let f = c.get("function").ok_or("a tool call without function")?;
            let name = f.get("name").and_then(Value::as_str).ok_or("a tool call without function.name")?;
            let id = c.get("id").and_then(Value::as_str).map(str::to_string);
            Ok(Call { id, name: name.to_string(), arguments: arguments(f.get("arguments")) })
        })
        .collect()
}

/// A call's arguments as given: none (an empty object), an object, or JSON text,
/// parsed (text that is not JSON stays a string).
fn arguments(v: Option<&Value>) -> Value {
    match v {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) => serde_json::from_str(s).unwrap_or_else(|_| Value::String(s.clone())),
        Some(a) => a.clone(),
    }
}

/// The tools' names by call id, as a conversation gives them, for results that give
/// only the id (OpenAI's).
#[derive(Default)]
struct CallNames(Vec<(String, String)>);

impl CallNames {
    /// Note the ids and names of an assistant turn's `calls`.
    fn note(&mut self, calls: &[Call]) {
        self.0.extend(calls.iter().filter_map(|c| Some((c.id.clone()?, c.name.clone()))));
    }

    /// The tool a tool turn is from: as the client says, or by its call's id.
    fn of(&self, t: &Turn) -> Option<String> {
        t.tool.clone().or_else(|| {
            let id = t.call_id.as_ref()?;
            self.0.iter().find(|(i, _)| i == id).map(|(_, n)| n.clone())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grammar::gbnf;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}})
    }

    fn time() -> Value {
        json!({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]"}}}}})
    }

    #[test]
    fn choices_are_read_as_openai_defines_them_and_bad_ones_refused() {
        let tools = [weather(), time()];
        let b = Toolbox::new(&tools, None, None).unwrap().unwrap();
        assert_eq!(b.choice, Choice::Auto);
        assert!(b.parallel);
        assert_eq!(Toolbox::new(&tools, Some(&json!("none")), None).unwrap(), None);
        assert_eq!(Toolbox::new(&[], None, None).unwrap(), None);
        let named = json!({"type": "function", "function": {"name": "get_time"}});
        let b = Toolbox::new(&tools, Some(&named), Some(false)).unwrap().unwrap();
        assert_eq!(b.choice, Choice::Named("get_time".into()));
        assert!(!b.parallel);
        for (tools, choice, why) in [
            (vec![weather()], json!("sometimes"), "tool_choice \"sometimes\""),
            (vec![weather()], json!({"type": "function", "function": {"name": "nope"}}), "not a tool"),
            (vec![], json!("required"), "no tools are given"),
            (vec![weather(), weather()], json!("auto"), "given twice"),
            (vec![json!({"type": "retrieval"})], json!("auto"), "tools[0]: only tools of type"),
            (vec![json!({"type": "function", "function": {"name": "a b"}})], json!("auto"), "function.name"),
            (vec![json!({"type": "function", "function": {"name": "a", "parameters": 3}})], json!("auto"), "schema"),
        ] {
            let e = Toolbox::new(&tools, Some(&choice), None).unwrap_err();
            assert!(e.contains(why), "{e} (wanted {why})");
        }
    }

    #[test]
    fn the_grammar_offers_the_tools_by_name_and_a_reply_only_with_auto() {
        let tools = [weather(), time()];
        let auto = Toolbox::new(&tools, None, None).unwrap().unwrap().grammar().unwrap();
        assert!(auto.contains("\"\\\"get_weather\\\"\"") && auto.contains("\"\\\"get_time\\\"\""), "{auto}");
        assert!(auto.contains("\\\"response\\\""), "{auto}");
        // get_time's `pattern` cannot be followed: its arguments are any object.
        assert!(auto.contains("\"\\\"c\\\"\""), "the weather's enum is followed: {auto}");
        let required = Toolbox::new(&tools, Some(&json!("required")), None).unwrap().unwrap().grammar().unwrap();
        assert!(!required.contains("\\\"response\\\""), "{required}");
        let named = json!({"type": "function", "function": {"name": "get_time"}});
        let one = Toolbox::new(&tools, Some(&named), None).unwrap().unwrap().grammar().unwrap();
        assert!(!one.contains("get_weather") && one.contains("get_time"), "{one}");
    }

    /// In Hermes' syntax a required call is a `<tool_call>` block held by the grammar
    /// (several, one per line, when parallel); `auto` leaves the model free.
    #[test]
    fn hermes_grammar_holds_tool_call_blocks_and_leaves_auto_free() {
        let tools = [weather(), time()];
        let mut auto = Toolbox::new(&tools, None, None).unwrap().unwrap();
        auto.speak(ToolSyntax::Hermes);
        assert_eq!(auto.grammar(), None);
        let mut required = Toolbox::new(&tools, Some(&json!("required")), Some(false)).unwrap().unwrap();
        required.speak(ToolSyntax::Hermes);
        let g = required.grammar().unwrap();
        assert!(g.starts_with("root ::= block\nblock ::= \"<tool_call>\\n\" call \"\\n</tool_call>\"\n"), "{g}");
        assert!(g.contains("\"\\\"get_weather\\\"\"") && !g.contains("response"), "{g}");
        assert!(gbnf::accepts(&g, "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"), "{g}");
        let mut parallel = Toolbox::new(&tools, Some(&json!("required")), None).unwrap().unwrap();
        parallel.speak(ToolSyntax::Hermes);
        assert!(parallel.grammar().unwrap().starts_with("root ::= block ( \"\\n\" block ){0,7}\n"));
    }

    #[test]
    fn hermes_answers_read_back_as_calls_or_text() {
        let mut b = Toolbox::new(&[weather(), time()], None, None).unwrap().unwrap();
        b.speak(ToolSyntax::Hermes);
        let two = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n\
                   <tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"zone\\\": \\\"CET\\\"}\"}\n</tool_call>";
        assert_eq!(
            b.read(two),
            Reply::Calls(vec![
                Call { id: None, name: "get_weather".into(), arguments: json!({"city": "Paris"}) },
                // Arguments given as JSON text are read as JSON.
                Call { id: None, name: "get_time".into(), arguments: json!({"zone": "CET"}) },
            ])
        );
        assert_eq!(b.read("It is sunny."), Reply::Text("It is sunny.".into()));
        // A block that is not a call: the whole answer is text, as it came.
        let broken = "<tool_call>\nnot json\n</tool_call>";
        assert_eq!(b.read(broken), Reply::Text(broken.into()));
        // Cut by max_tokens inside the block's end: no whole block, so text, as it came.
        let cut = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_";
        assert_eq!(b.read(cut), Reply::Text(cut.into()));
    }

    /// A tool whose parameters have every kind of value: a string, an integer, a
    /// boolean, an object, a string again, one of no type, one either a string or an
    /// integer; the path and the line required.
    fn edit() -> Value {
        json!({"type": "function", "function": {"name": "edit_file", "parameters": {"type": "object",
            "properties": {"path": {"type": "string"}, "line": {"type": "integer"}, "dry_run": {"type": "boolean"},
                "options": {"type": "object", "properties": {"indent": {"type": "integer"}}},
                "version": {"type": "string"}, "note": {"description": "Anything."},
                "limit": {"type": ["integer", "string"]}},
            "required": ["path", "line"]}}})
    }

    /// An XML call of `name` with these parameters (key, value as written).
    fn xml_call(name: &str, parameters: &[(&str, &str)]) -> String {
        let parameters: String =
            parameters.iter().map(|(k, v)| format!("<parameter={k}>\n{v}\n</parameter>\n")).collect();
        format!("<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>")
    }

    /// Qwen3-Coder's syntax: a required call is `<tool_call>` blocks of XML, one per
    /// line when parallel, naming an offered tool and its properties (the required ones
    /// always), a string's value as text (without `</parameter>`, within its
    /// `maxLength`), an enum's as the template writes its values, any other as JSON of
    /// its schema; `auto` leaves the model free.
    #[test]
    fn qwen_xml_grammar_holds_xml_calls_of_the_tools_parameters() {
        let b = required(ToolSyntax::QwenXml, true);
        let g = b.grammar().unwrap();
        let oslo = xml_call("get_weather", &[("city", "Oslo"), ("unit", "c")]);
        let cet = xml_call("get_time", &[("zone", "CET")]);
        let two = format!("{oslo}\n{cet}");
        assert!(gbnf::accepts(&g, &two), "{g}");
        // unit is optional; get_time's zone (whose pattern text cannot follow) too.
        assert!(gbnf::accepts(&g, &xml_call("get_weather", &[("city", "Oslo")])), "{g}");
        assert!(gbnf::accepts(&g, &xml_call("get_time", &[])), "{g}");
        for bad in [
            two.replace("get_time", "get_date"),
            xml_call("get_weather", &[("unit", "c")]),
            xml_call("get_weather", &[("city", "Oslo"), ("unit", "k")]),
            xml_call("get_weather", &[("city", "Oslo"), ("country", "NO")]),
            xml_call("get_weather", &[("unit", "c"), ("city", "Oslo")]),
            oslo.replace("<tool_call>\n", "<tool_call>"),
            format!("Let me look. {oslo}"),
            format!("{oslo}{cet}"),
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>".to_string(),
        ] {
            assert!(!gbnf::accepts(&g, &bad), "{bad}");
        }
        let one = required(ToolSyntax::QwenXml, false).grammar().unwrap();
        assert!(!gbnf::accepts(&one, &two) && gbnf::accepts(&one, &cet), "{one}");
        let named = json!({"type": "function", "function": {"name": "get_time"}});
        let mut named = Toolbox::new(&[weather(), time()], Some(&named), None).unwrap().unwrap();
        named.speak(ToolSyntax::QwenXml);
        let g = named.grammar().unwrap();
        assert!(gbnf::accepts(&g, &cet) && !gbnf::accepts(&g, &oslo), "{g}");
        let mut auto = Toolbox::new(&[weather()], None, None).unwrap().unwrap();
        auto.speak(ToolSyntax::QwenXml);
        assert_eq!(auto.grammar(), None);

        // Values by type: text, JSON of the schema, text or JSON where both are allowed.
        let mut b = Toolbox::new(&[edit()], Some(&json!("required")), Some(false)).unwrap().unwrap();
        b.speak(ToolSyntax::QwenXml);
        let g = b.grammar().unwrap();
        let code = "fn main() {\n    if a < b && c </ d {} // <parameter=x> </div> <\n}";
        let full = [
            ("path", "src/main.rs"),
            ("line", "42"),
            ("dry_run", "true"),
            ("options", "{\"indent\": 4}"),
            ("version", code),
            ("note", "{\"a\": 1}"),
            ("limit", "seven"),
        ];
        assert!(gbnf::accepts(&g, &xml_call("edit_file", &full)), "{g}");
        assert!(gbnf::accepts(&g, &xml_call("edit_file", &[("path", ""), ("line", "-3")])), "{g}");
        for bad in [
            xml_call("edit_file", &[("path", "a.rs")]),
            xml_call("edit_file", &[("path", "a.rs"), ("line", "forty")]),
            xml_call("edit_file", &[("path", "a.rs"), ("line", "1"), ("dry_run", "yes")]),
            xml_call("edit_file", &[("path", "a.rs"), ("line", "1"), ("options", "{\"indent\": \"4\"}")]),
            xml_call("edit_file", &[("path", "a.rs</parameter>b"), ("line", "1")]),
            xml_call("edit_file", &[("path", "a.rs"), ("line", "1"), ("version", "<</parameter>")]),
        ] {
            assert!(!gbnf::accepts(&g, &bad), "{bad}");
        }
        // A string's maxLength bounds its text.
        let short = json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object",
            "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"]}}});
        let mut b = Toolbox::new(&[short], Some(&json!("required")), None).unwrap().unwrap();
        b.speak(ToolSyntax::QwenXml);
        let g = b.grammar().unwrap();
        assert!(gbnf::accepts(&g, &xml_call("f", &[("s", "abc")])), "{g}");
        assert!(!gbnf::accepts(&g, &xml_call("f", &[("s", "abcd")])), "{g}");
    }

    /// Qwen3-Coder's answers read back call by call, each value typed by its
    /// property's schema; any block that does not read makes the answer text.
    #[test]
    fn qwen_xml_answers_read_back_as_typed_calls_or_text() {
        let b = required(ToolSyntax::QwenXml, true);
        let oslo = xml_call("get_weather", &[("city", "Oslo"), ("unit", "c")]);
        let cet = xml_call("get_time", &[("zone", "CET")]);
        let two = format!("{oslo}\n{cet}");
        assert_eq!(b.read(&two), oslo_and_cet());
        assert_eq!(
            b.read(&oslo),
            Reply::Calls(vec![Call {
                id: None,
                name: "get_weather".into(),
                arguments: json!({"city": "Oslo", "unit": "c"})
            }])
        );
        // After the model's words (or thinking); blocks apart by any white space.
        assert_eq!(b.read(&format!("I will look both up.\n\n{oslo}\n\n{cet}\n")), oslo_and_cet());
        assert_eq!(b.read("It is -3 C."), Reply::Text("It is -3 C.".into()));
        for text in [
            // Cut short; a tag left open; a tool not offered; a parameter twice; words after.
            two[..two.len() - 5].to_string(),
            oslo.replace("</function>\n", ""),
            oslo.replace("Oslo\n</parameter>", "Oslo\n"),
            oslo.replace("<function=get_weather>", "<function=get_weather"),
            oslo.replace("get_weather", "get_date"),
            xml_call("get_weather", &[("city", "Oslo"), ("city", "Bergen")]),
            format!("{oslo} Done."),
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>".to_string(),
        ] {
            assert_eq!(b.read(&text), Reply::Text(text.clone()), "{text}");
        }

        // Values: strings as written (one newline either side taken off), others as JSON.
        let mut b = Toolbox::new(&[edit()], None, None).unwrap().unwrap();
        b.speak(ToolSyntax::QwenXml);
        let code = "\nfn main() {\n    println!(\"<b>\");\n}\n";
        let call = xml_call(
            "edit_file",
            &[
                ("path", "src/main.rs"),
                ("line", "42"),
                ("dry_run", "true"),
                ("options", "{\"indent\": 4, \"tabs\": [false]}"),
                ("version", "1.10"),
                ("note", "{\"a\": 1}"),
                ("limit", "7"),
                ("extra", "3"),
            ],
        );
        let Reply::Calls(calls) = b.read(&call) else { panic!("{call} read as text") };
        assert_eq!(
            calls[0].arguments,
            json!({"path": "src/main.rs", "line": 42, "dry_run": true, "options": {"indent": 4, "tabs": [false]},
                "version": "1.10", "note": "{\"a\": 1}", "limit": 7, "extra": "3"})
        );
        // Text where JSON does not read (or reads as a string); Python's spellings where no
        // string is allowed; a value's own newlines kept.
        let call = xml_call(
            "edit_file",
            &[
                ("path", code),
                ("line", "forty"),
                ("dry_run", "True"),
                ("options", "\"x\""),
                ("limit", "seven"),
                ("version", "\"2\""),
            ],
        );
        let Reply::Calls(calls) = b.read(&call) else { panic!("{call} read as text") };
        assert_eq!(
            calls[0].arguments,
            json!({"path": code, "line": "forty", "dry_run": true, "options": "\"x\"", "limit": "seven",
                "version": "\"2\""})
        );
    }

    /// Llama 3's syntax: a required call is one `{"name", "parameters"}` object (one
    /// call per message, whatever `parallel` says); answers read back as that object
    /// (after a `<|python_tag|>`) or as text.
    #[test]
    fn llama3_grammar_holds_one_call_object_and_answers_read_back() {
        let mut b = Toolbox::new(&[weather(), time()], Some(&json!("required")), None).unwrap().unwrap();
        b.speak(ToolSyntax::Llama3);
        let g = b.grammar().unwrap();
        assert!(g.starts_with("root ::= call\ncall ::= ( call-0 | call-1 )\n"), "{g}");
        assert!(g.contains("\"\\\"parameters\\\"\"") && !g.contains("arguments"), "{g}");
        assert!(gbnf::accepts(&g, r#"{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}}"#), "{g}");
        let mut auto = Toolbox::new(&[weather()], None, None).unwrap().unwrap();
        auto.speak(ToolSyntax::Llama3);
        assert_eq!(auto.grammar(), None);
        let call =
            Reply::Calls(vec![Call { id: None, name: "get_weather".into(), arguments: json!({"city": "Oslo"}) }]);
        assert_eq!(b.read(r#" {"name": "get_weather", "parameters": {"city": "Oslo"}}"#), call);
        assert_eq!(b.read(r#"<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}"#), call);
        assert_eq!(b.read("Oslo is cold."), Reply::Text("Oslo is cold.".into()));
        assert_eq!(b.read(r#"{"city": "Oslo"}"#), Reply::Text(r#"{"city": "Oslo"}"#.into()));
    }

    /// A required call in the model's own syntax, as the grammar holds it.
    fn required(syntax: ToolSyntax, parallel: bool) -> Toolbox {
        let mut b = Toolbox::new(&[weather(), time()], Some(&json!("required")), Some(parallel)).unwrap().unwrap();
        b.speak(syntax);
        b
    }

    /// A reply format: an object with a city (string) and a temperature (integer).
    fn forecast() -> Structured {
        Structured::schema(&json!({"type": "object", "properties": {"city": {"type": "string"},
            "temp": {"type": "integer"}}, "required": ["city", "temp"]}))
        .unwrap()
    }

    /// With `auto` and a reply format, every syntax's grammar takes a call (as a
    /// required one is written) or a reply in that format, and refuses a reply outside
    /// it; the answer reads back as calls or as the reply's JSON text.
    #[test]
    fn a_reply_format_holds_the_reply_beside_the_calls_in_every_syntax() {
        let reply = r#"{"city": "Oslo", "temp": -3}"#;
        let not_the_schema = r#"{"city": "Oslo"}"#;
        let weather_call = |syntax| -> String {
            match syntax {
                ToolSyntax::Generic => {
                    r#"{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]}"#.into()
                }
                ToolSyntax::Hermes => {
                    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"c\"}}\n</tool_call>"
                        .into()
                }
                ToolSyntax::QwenXml => "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n\
                                        <parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>"
                    .into(),
                ToolSyntax::Llama3 => r#"{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}"#.into(),
                ToolSyntax::CommandR7b => "<|START_ACTION|>[{\"tool_call_id\": \"0\", \"tool_name\": \"get_weather\", \
                                           \"parameters\": {\"city\": \"Oslo\", \"unit\": \"c\"}}]<|END_ACTION|>"
                    .into(),
                ToolSyntax::CommandRPlus => "Action: ```json\n[{\"tool_name\": \"get_weather\", \"parameters\": \
                                             {\"city\": \"Oslo\", \"unit\": \"c\"}}]\n```"
                    .into(),
                ToolSyntax::DeepSeekR1 { .. } => "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>\
                                                   get_weather\n```json\n{\"city\": \"Oslo\", \"unit\": \"c\"}\n```\
                                                   <｜tool▁call▁end｜><｜tool▁calls▁end｜>"
                    .into(),
                ToolSyntax::DeepSeekV31 { .. } => "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>\
                                                    {\"city\": \"Oslo\", \"unit\": \"c\"}<｜tool▁call▁end｜>\
                                                    <｜tool▁calls▁end｜>"
                    .into(),
                ToolSyntax::MistralNemo => "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \
                                            \"unit\": \"c\"}, \"id\": \"a1B2c3D4e\"}]"
                    .into(),
                ToolSyntax::Mistral { .. } => "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Oslo\", \"unit\": \"c\"}".into(),
                ToolSyntax::Harmony => "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>\
                                        {\"city\": \"Oslo\", \"unit\": \"c\"}"
                    .into(),
            }
        };
        // How each syntax writes a reply (the generic format: inside `response`).
        let written = |syntax, json: &str| -> String {
            match syntax {
                ToolSyntax::Generic => format!(r#"{{"response": {json}}}"#),
                ToolSyntax::CommandR7b => format!("<|START_RESPONSE|>{json}<|END_RESPONSE|>"),
                ToolSyntax::DeepSeekR1 { .. } | ToolSyntax::DeepSeekV31 { .. } => format!("</think>\n\n{json}"),
                ToolSyntax::Harmony => format!("<|channel|>final<|message|>{json}"),
                _ => json.to_string(),
            }
        };
        for syntax in [
            ToolSyntax::Generic,
            ToolSyntax::Hermes,
            ToolSyntax::QwenXml,
            ToolSyntax::Llama3,
            ToolSyntax::CommandR7b,
            ToolSyntax::CommandRPlus,
            ToolSyntax::DeepSeekR1 { lists_tools: true },
            ToolSyntax::DeepSeekV31 { lists_tools: true },
            ToolSyntax::MistralNemo,
            ToolSyntax::Mistral { call_ids: true },
            ToolSyntax::Harmony,
        ] {
            let mut b = Toolbox::new(&[weather(), time()], None, None).unwrap().unwrap();
            b.speak(syntax);
            b.reply_as(Some(forecast()));
            let g = b.grammar().unwrap();
            let call = weather_call(syntax);
            assert!(gbnf::accepts(&g, &call), "{syntax:?}: {call}\n{g}");
            let answer = written(syntax, reply);
            assert!(gbnf::accepts(&g, &answer), "{syntax:?}: {answer}\n{g}");
            for bad in [written(syntax, not_the_schema), written(syntax, r#""Oslo is cold.""#), "Oslo is cold.".into()]
            {
                assert!(!gbnf::accepts(&g, &bad), "{syntax:?}: {bad}\n{g}");
            }
            assert!(matches!(b.read(&call), Reply::Calls(c) if c[0].name == "get_weather"), "{syntax:?}");
            let Reply::Text(t) = b.read(&answer) else { panic!("{syntax:?}: {answer} read as calls") };
            assert_eq!(serde_json::from_str::<Value>(&t).unwrap(), json!({"city": "Oslo", "temp": -3}), "{syntax:?}");
            // The reply is where its reader took it from (none in the generic format).
            let span = b.reply_span(&answer, &t);
            match syntax {
                ToolSyntax::Generic => assert_eq!(span, None),
                _ => assert_eq!(&answer[span.unwrap()], t, "{syntax:?}"),
            }

            // Any JSON object: the same, less the schema.
            b.reply_as(Some(Structured::object()));
            let g = b.grammar().unwrap();
            assert!(gbnf::accepts(&g, &call) && gbnf::accepts(&g, &written(syntax, not_the_schema)), "{syntax:?}");
            assert!(!gbnf::accepts(&g, &written(syntax, "[1]")), "{syntax:?}");

            // A required call: the format does not apply, no reply is offered.
            let mut r = required(syntax, true);
            r.reply_as(Some(forecast()));
            let g = r.grammar().unwrap();
            assert!(gbnf::accepts(&g, &call) && !gbnf::accepts(&g, &answer), "{syntax:?}");
            assert_eq!(g, required(syntax, true).grammar().unwrap(), "{syntax:?}");
        }
    }

    /// Llama 3's call is itself a JSON object: a reply that looks like a call of no
    /// offered tool is the reply; the generic format's string reply is written as JSON.
    #[test]
    fn json_replies_that_look_like_calls_or_strings_read_back_as_json_text() {
        let mut b = Toolbox::new(&[weather()], None, None).unwrap().unwrap();
        b.speak(ToolSyntax::Llama3);
        let lookalike = r#"{"name": "Bob", "parameters": {}}"#;
        assert!(matches!(b.read(lookalike), Reply::Calls(_)), "without a format, as before");
        b.reply_as(Some(Structured::object()));
        assert_eq!(b.read(lookalike), Reply::Text(lookalike.into()));
        assert_eq!(b.reply_span(lookalike, lookalike), Some(0..lookalike.len()));

        let mut g = Toolbox::new(&[weather()], None, None).unwrap().unwrap();
        g.reply_as(Some(Structured::schema(&json!({"type": "string"})).unwrap()));
        assert_eq!(g.read(r#"{"response": "Cold."}"#), Reply::Text(r#""Cold.""#.into()));
        // The model is told the schema its reply follows.
        let told = g.instructions();
        assert!(told.contains(r#"follows this JSON schema: {"type":"string"}"#), "{told}");
        // Logprobs: only where the reply is the model's text as written.
        assert!(!g.replies_verbatim() && b.replies_verbatim());
        assert!(required(ToolSyntax::Generic, true).replies_verbatim());
    }

    fn oslo_and_cet() -> Reply {
        Reply::Calls(vec![
            Call { id: None, name: "get_weather".into(), arguments: json!({"city": "Oslo", "unit": "c"}) },
            Call { id: None, name: "get_time".into(), arguments: json!({"zone": "CET"}) },
        ])
    }

    /// Command R7B's syntax: a required call is one `<|START_ACTION|>` list of
    /// `{"tool_call_id", "tool_name", "parameters"}` objects (one object unless
    /// parallel); answers read back from marked lists, bare lists (where the markers
    /// are control tokens that render as nothing) or `<|START_RESPONSE|>` replies.
    #[test]
    fn command_r7b_grammar_holds_an_action_list_and_answers_read_back() {
        let b = required(ToolSyntax::CommandR7b, true);
        let g = b.grammar().unwrap();
        let list =
            "[\n    {\"tool_call_id\": \"0\", \"tool_name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\", \
                    \"unit\": \"c\"}},\n    {\"tool_call_id\": \"1\", \"tool_name\": \"get_time\", \"parameters\": \
                    {\"zone\": \"CET\"}}\n]";
        let two = format!("<|START_ACTION|>{list}<|END_ACTION|>");
        assert!(gbnf::accepts(&g, &two), "{g}");
        // A template that leaves the thinking open has it closed first.
        assert!(gbnf::accepts(&g, &format!("<|END_THINKING|>{two}")));
        for bad in [
            "<|START_ACTION|>[]<|END_ACTION|>".to_string(),
            two.replace("\"tool_call_id\": \"1\", ", ""),
            two.replace("get_time", "get_date"),
            two.replace("\"unit\": \"c\"", "\"unit\": \"k\""),
            two.replace("parameters", "arguments"),
            list.to_string(),
            "<|START_RESPONSE|>Hi<|END_RESPONSE|>".to_string(),
        ] {
            assert!(!gbnf::accepts(&g, &bad), "{bad}");
        }
        let one = required(ToolSyntax::CommandR7b, false).grammar().unwrap();
        assert!(!gbnf::accepts(&one, &two));
        let first = "<|START_ACTION|>[{\"tool_call_id\": \"0\", \"tool_name\": \"get_time\", \"parameters\": {}}]<|END_ACTION|>";
        assert!(gbnf::accepts(&one, first), "{one}");
        let mut auto = Toolbox::new(&[weather()], None, None).unwrap().unwrap();
        auto.speak(ToolSyntax::CommandR7b);
        assert_eq!(auto.grammar(), None);

        assert_eq!(b.read(&two), oslo_and_cet());
        assert_eq!(b.read(&format!("<|START_THINKING|>I will look both up.<|END_THINKING|>{two}")), oslo_and_cet());
        // The markers rendered as nothing: the bare list (after the plan's end) is read.
        assert_eq!(b.read(&format!(" {list}")), oslo_and_cet());
        assert_eq!(b.read("<|START_RESPONSE|>It is -3 C.<|END_RESPONSE|>"), Reply::Text("It is -3 C.".into()));
        assert_eq!(b.read("It is -3 C."), Reply::Text("It is -3 C.".into()));
        // A list that is not one of calls, or one cut short: the answer as it came.
        for text in [
            "<|START_ACTION|>[{\"tool_call_id\": \"0\", \"tool_name\": 3}]<|END_ACTION|>",
            "<|START_ACTION|>[]<|END_ACTION|>",
            "<|START_ACTION|>[{\"tool_call_id\": \"0\", \"tool_na",
            "[1, 2]",
        ] {
            assert_eq!(b.read(text), Reply::Text(text.into()));
        }
    }

    /// An action list as Command R+'s template writes an earlier call (`Action:` and
    /// the fence on lines of their own, the objects indented, `]` and the fence's close
    /// on one line) of get_weather(Oslo, c) and get_time(CET).
    const PLUS_TWO: &str = "Action:\n```json\n[\n    {\n        \"tool_name\": \"get_weather\",\n        \"parameters\": {\n\
                            \x20           \"city\": \"Oslo\",\n            \"unit\": \"c\"\n        }\n    },\n    {\n\
                            \x20       \"tool_name\": \"get_time\",\n        \"parameters\": {\"zone\": \"CET\"}\n    }\n]```";

    /// Command R+'s syntax: a required call is `Action:` and one fenced JSON list of
    /// `{"tool_name", "parameters"}` objects (one object unless parallel), of the
    /// offered tools, their parameters as their schemas say; `auto` leaves the model
    /// free.
    #[test]
    fn command_r_plus_grammar_holds_an_action_list_of_the_tools() {
        let g = required(ToolSyntax::CommandRPlus, true).grammar().unwrap();
        // As the template writes calls, and as the model card shows the model's.
        assert!(gbnf::accepts(&g, PLUS_TWO), "{g}");
        let card = "Action: ```json\n[\n    {\n        \"tool_name\": \"get_time\",\n        \"parameters\": {}\n    }\n]\n```";
        assert!(gbnf::accepts(&g, card), "{g}");
        for bad in [
            // A tool not offered; a required parameter missing; a value outside its
            // enum; R7B's `tool_call_id`; Hermes' names; no fence; a plan first; an
            // empty list; `directly-answer` (a call is required); the fence left open.
            PLUS_TWO.replace("get_time", "get_date"),
            PLUS_TWO.replace("\"city\": \"Oslo\",\n            ", ""),
            PLUS_TWO.replace("\"c\"", "\"k\""),
            PLUS_TWO.replace("\"tool_name\": \"get_time\"", "\"tool_call_id\": \"1\", \"tool_name\": \"get_time\""),
            PLUS_TWO.replace("tool_name", "name").replace("parameters", "arguments"),
            PLUS_TWO.replace("```json\n", ""),
            format!("Plan: I will look both up.\n{PLUS_TWO}"),
            "Action: ```json\n[]\n```".to_string(),
            "Action: ```json\n[{\"tool_name\": \"directly-answer\", \"parameters\": {}}]\n```".to_string(),
            PLUS_TWO.trim_end_matches('`').to_string(),
        ] {
            assert!(!gbnf::accepts(&g, &bad), "{bad}");
        }
        // One call unless parallel; a named tool alone.
        let one = required(ToolSyntax::CommandRPlus, false).grammar().unwrap();
        assert!(!gbnf::accepts(&one, PLUS_TWO) && gbnf::accepts(&one, card), "{one}");
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let mut named = Toolbox::new(&[weather(), time()], Some(&named), None).unwrap().unwrap();
        named.speak(ToolSyntax::CommandRPlus);
        let g = named.grammar().unwrap();
        let oslo = "Action: ```json\n[{\"tool_name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\", \"unit\": \"c\"}}]\n```";
        assert!(gbnf::accepts(&g, oslo) && !gbnf::accepts(&g, card), "{g}");
        let mut auto = Toolbox::new(&[weather()], None, None).unwrap().unwrap();
        auto.speak(ToolSyntax::CommandRPlus);
        assert_eq!(auto.grammar(), None);

        // With a reply format: the reply alone, or after a `directly-answer` action.
        let mut b = Toolbox::new(&[weather(), time()], None, None).unwrap().unwrap();
        b.speak(ToolSyntax::CommandRPlus);
        b.reply_as(Some(forecast()));
        let g = b.grammar().unwrap();
        let direct = "Action: ```json\n[\n    {\n        \"tool_name\": \"directly-answer\",\n        \"parameters\": {}\n    }\n]\n```";
        let reply = format!("{direct}\n{{\"city\": \"Oslo\", \"temp\": -3}}");
        assert!(gbnf::accepts(&g, &reply) && gbnf::accepts(&g, PLUS_TWO), "{g}");
        assert!(!gbnf::accepts(&g, direct) && !gbnf::accepts(&g, &format!("{direct}\nIt is cold.")), "{g}");
        assert_eq!(b.read(&reply), Reply::Text("{\"city\": \"Oslo\", \"temp\": -3}".into()));
        let span = b.reply_span(&reply, "{\"city\": \"Oslo\", \"temp\": -3}").unwrap();
        assert_eq!(span.start, direct.len() + 1);
        // A reply holding an `Action:` (in a string) is the reply.
        let holding = "{\"city\": \"Action: ```json\\n[{\\\"tool_name\\\": \\\"get_time\\\"}]\", \"temp\": 1}";
        assert!(serde_json::from_str::<Value>(holding).is_ok(), "{holding}");
        assert_eq!(b.read(holding), Reply::Text(holding.into()));
    }

    /// Command R+'s answers read back: the action list's calls (after a plan, the fence
    /// left open at the end), `directly-answer` as no call, anything else as the text.
    #[test]
    fn command_r_plus_answers_read_back_as_calls_or_text() {
        let b = required(ToolSyntax::CommandRPlus, true);
        assert_eq!(b.read(PLUS_TWO), oslo_and_cet());
        let cet = Reply::Calls(vec![Call { id: None, name: "get_time".into(), arguments: json!({"zone": "CET"}) }]);
        // One call, as the model card shows it (arguments as JSON text read as JSON).
        let one = "Action: ```json\n[\n    {\n        \"tool_name\": \"get_time\",\n        \"parameters\": \
                   \"{\\\"zone\\\": \\\"CET\\\"}\"\n    }\n]\n```";
        assert_eq!(b.read(one), cet);
        // After a plan; white space anywhere; the fence bare, left open, or missing.
        let planned = format!("Plan: First I will look up the weather, then the time.\n{PLUS_TWO}");
        assert_eq!(b.read(&planned), oslo_and_cet());
        let loose = "  Action:```json[{\"tool_name\":\"get_time\",\"parameters\":{\"zone\":\"CET\"}}]```\n";
        assert_eq!(b.read(loose), cet);
        assert_eq!(b.read(&PLUS_TWO.replace("```json", "```")), oslo_and_cet());
        assert_eq!(b.read(PLUS_TWO.trim_end_matches('`')), oslo_and_cet());
        assert_eq!(b.read(&PLUS_TWO.replace("```json\n", "")), oslo_and_cet());
        // `directly-answer` beside calls is dropped; alone, it is a reply: the words after
        // the list, else before it, else the whole answer (no words at all).
        let direct = "Action: ```json\n[{\"tool_name\": \"directly-answer\", \"parameters\": {}}]\n```";
        let beside = PLUS_TWO.replacen('[', "[{\"tool_name\": \"directly_answer\", \"parameters\": {}},", 1);
        assert_eq!(b.read(&beside), oslo_and_cet());
        assert_eq!(
            b.read(&format!("{direct}\nHello! How can I help?\n")),
            Reply::Text("Hello! How can I help?".into())
        );
        let before = format!("Plan: I will greet the user.\n{direct}");
        assert_eq!(b.read(&before), Reply::Text("Plan: I will greet the user.".into()));
        assert_eq!(b.read(direct), Reply::Text(direct.into()));
        let answer = format!("{direct}\nHello!");
        assert_eq!(b.reply_span(&answer, "Hello!"), Some(answer.len() - 6..answer.len()));
        // A tool the request offers by that name is called.
        let named = json!({"type": "function", "function": {"name": "directly-answer"}});
        let mut own = Toolbox::new(&[named], None, None).unwrap().unwrap();
        own.speak(ToolSyntax::CommandRPlus);
        assert_eq!(
            own.read(direct),
            Reply::Calls(vec![Call { id: None, name: "directly-answer".into(), arguments: json!({}) }])
        );
        // No action; an action that is not a list of calls (not JSON, an empty list,
        // an object without a name, cut short): the answer as it came.
        for text in [
            "It is -3 C in Oslo.".to_string(),
            "Action: look it up.".to_string(),
            "Action: ```json\n[]\n```".to_string(),
            "Action: ```json\n[{\"parameters\": {}}]\n```".to_string(),
            "Action: ```json\n{\"tool_name\": \"get_time\", \"parameters\": {}}\n```".to_string(),
            PLUS_TWO[..PLUS_TWO.find("CET").unwrap()].to_string(),
        ] {
            assert_eq!(b.read(&text), Reply::Text(text.clone()), "{text}");
        }
    }

    /// DeepSeek R1's syntax: a required call is `<｜tool▁calls▁begin｜>` then calls
    /// `function<｜tool▁sep｜>NAME` with fenced JSON arguments, one per line; answers
    /// read back from that (after the model's thinking, with the opening markers the
    /// distills write instead), a malformed call making the answer text.
    #[test]
    fn deepseek_r1_grammar_holds_fenced_calls_and_answers_read_back() {
        let r1 = ToolSyntax::DeepSeekR1 { lists_tools: false };
        let b = required(r1, true);
        let g = b.grammar().unwrap();
        let weather = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Oslo\", \
                       \"unit\": \"c\"}\n```<｜tool▁call▁end｜>";
        let time =
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{\"zone\": \"CET\"}\n```<｜tool▁call▁end｜>";
        let two = format!("<｜tool▁calls▁begin｜>{weather}\n{time}<｜tool▁calls▁end｜>");
        assert!(gbnf::accepts(&g, &two), "{g}");
        assert!(gbnf::accepts(&g, &format!("</think>\n\n{two}")));
        for bad in [
            two.replace("function<｜tool▁sep｜>get_time", "get_time<｜tool▁sep｜>"),
            two.replace("```json\n{\"zone\"", "{\"zone\""),
            two.replace("get_weather", "get_date"),
            "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>".to_string(),
            format!("Let me see. {two}"),
        ] {
            assert!(!gbnf::accepts(&g, &bad), "{bad}");
        }
        let one = required(r1, false).grammar().unwrap();
        assert!(
            !gbnf::accepts(&one, &two)
                && gbnf::accepts(&one, &format!("<｜tool▁calls▁begin｜>{time}<｜tool▁calls▁end｜>"))
        );

        assert_eq!(b.read(&two), oslo_and_cet());
        // After its thinking; an end of sentence after the calls.
        let thought = format!("<think>\nOslo first, then the time.\n</think>\n\n{two}<｜end▁of▁sentence｜>");
        assert_eq!(b.read(&thought), oslo_and_cet());
        // The distills' other opening; no call-begin marker; arguments unfenced.
        let variant =
            format!("<｜tool▁calls｜>{}\n{}<｜tool▁calls▁end｜>", weather, time.replace("<｜tool▁call▁begin｜>", ""));
        assert_eq!(b.read(&variant), oslo_and_cet());
        let bare = "<｜tool▁calls▁begin｜>function<｜tool▁sep｜>get_time\n{\"zone\": \"CET\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert_eq!(
            b.read(bare),
            Reply::Calls(vec![Call { id: None, name: "get_time".into(), arguments: json!({"zone": "CET"}) }])
        );
        assert_eq!(b.read("It is -3 C."), Reply::Text("It is -3 C.".into()));
        for text in [
            // No separator, arguments that are not JSON or not an object, no name, cut short.
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time {}<｜tool▁call▁end｜><｜tool▁calls▁end｜>".to_string(),
            two.replace("{\"zone\": \"CET\"}", "{zone: CET}"),
            two.replace("{\"zone\": \"CET\"}", "[\"CET\"]"),
            two.replace("get_time", ""),
            two[..two.find("CET").unwrap()].to_string(),
            "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>".to_string(),
        ] {
            assert_eq!(b.read(&text), Reply::Text(text.clone()));
        }
    }

    /// DeepSeek V3.1's syntax: calls `NAME<｜tool▁sep｜>{ARGS}` chained without
    /// separators; R1's shape is not V3.1's.
    #[test]
    fn deepseek_v31_grammar_holds_chained_calls_and_answers_read_back() {
        let v31 = ToolSyntax::DeepSeekV31 { lists_tools: false };
        let b = required(v31, true);
        let g = b.grammar().unwrap();
        let two = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Oslo\", \"unit\": \
                   \"c\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"zone\": \"CET\"}\
                   <｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert!(gbnf::accepts(&g, two), "{g}");
        assert!(!gbnf::accepts(&g, &two.replace("get_time<｜tool▁sep｜>", "function<｜tool▁sep｜>get_time\n")));
        assert!(!gbnf::accepts(&required(v31, false).grammar().unwrap(), two));
        assert_eq!(b.read(two), oslo_and_cet());
        assert_eq!(b.read(&format!("</think>{two}")), oslo_and_cet());
        let malformed = two.replace("<｜tool▁sep｜>{\"zone\"", "{\"zone\"");
        assert_eq!(b.read(&malformed), Reply::Text(malformed.clone()));
        assert_eq!(b.read("Oslo is cold."), Reply::Text("Oslo is cold.".into()));
    }

    /// DeepSeek's own templates do not list the tools: the system message does, in
    /// the shape each model was taught (joined to the client's system text); a template
    /// that lists them gets the conversation alone.
    #[test]
    fn deepseeks_tools_are_described_in_the_system_message_when_the_template_does_not_list_them() {
        let user = Turn { role: "user".into(), content: "Weather?".into(), ..Turn::default() };
        let system = Turn { role: "system".into(), content: "Be brief.".into(), ..Turn::default() };
        let mut b = Toolbox::new(&[weather()], None, None).unwrap().unwrap();
        b.speak(ToolSyntax::DeepSeekR1 { lists_tools: false });
        let told = b.told().unwrap();
        assert!(told.contains("\"name\": \"get_weather\"") && told.contains("function<｜tool▁sep｜>"), "{told}");
        let mut messages = openai_messages(&[system.clone(), user.clone()]);
        add_to_system(&mut messages, &told);
        assert_eq!(messages[0]["content"], json!(format!("Be brief.\n\n{told}")));
        let mut messages = openai_messages(std::slice::from_ref(&user));
        add_to_system(&mut messages, &told);
        assert_eq!(messages, json!([{"role": "system", "content": told}, {"role": "user", "content": "Weather?"}]));

        b.speak(ToolSyntax::DeepSeekV31 { lists_tools: false });
        let told = b.told().unwrap();
        assert!(
            told.starts_with("## Tools\n") && told.contains("\n### get_weather\nDescription: The weather in a city\n")
        );
        assert!(told.contains(&format!("Parameters: {}", weather()["function"]["parameters"])), "{told}");
        b.speak(ToolSyntax::DeepSeekR1 { lists_tools: true });
        assert_eq!(b.told(), None);
        b.speak(ToolSyntax::CommandR7b);
        assert_eq!(b.told(), None);
    }

    /// Harmony's syntax (gpt-oss): a required call is one `commentary` message to the
    /// function, maybe after an `analysis` message; answers read back from that (with
    /// or without their headers), a malformed call making the answer text.
    #[test]
    fn harmony_grammar_holds_one_call_and_answers_read_back() {
        let b = required(ToolSyntax::Harmony, true);
        let g = b.grammar().unwrap();
        let call = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>\
                    {\"city\": \"Oslo\", \"unit\": \"c\"}";
        assert!(gbnf::accepts(&g, call), "{g}");
        let thought = format!("<|channel|>analysis<|message|>Oslo's weather, in C.<|end|><|start|>assistant{call}");
        assert!(gbnf::accepts(&g, &thought), "{g}");
        let cet = "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{\"zone\": \"CET\"}";
        assert!(gbnf::accepts(&g, cet));
        for bad in [
            call.replace("get_weather", "get_date"),
            call.replace("\"c\"", "\"k\""),
            call.replace(" <|constrain|>json", ""),
            format!("{call}{cet}"),
            "<|channel|>final<|message|>It is cold.".to_string(),
            thought.replace("<|end|>", ""),
        ] {
            assert!(!gbnf::accepts(&g, &bad), "{bad}");
        }
        let mut named = Toolbox::new(
            &[weather(), time()],
            Some(&json!({"type": "function", "function": {"name": "get_time"}})),
            None,
        )
        .unwrap()
        .unwrap();
        named.speak(ToolSyntax::Harmony);
        let g = named.grammar().unwrap();
        assert!(gbnf::accepts(&g, cet), "{g}");
        assert!(!gbnf::accepts(&g, call));
        let mut auto = Toolbox::new(&[weather()], None, None).unwrap().unwrap();
        auto.speak(ToolSyntax::Harmony);
        assert_eq!(auto.grammar(), None);

        let oslo = Reply::Calls(vec![Call {
            id: None,
            name: "get_weather".into(),
            arguments: json!({"city": "Oslo", "unit": "c"}),
        }]);
        assert_eq!(b.read(call), oslo);
        assert_eq!(b.read(&format!("{call}<|call|>")), oslo);
        assert_eq!(b.read(&thought), oslo);
        // The recipient in the role's header, as the template writes earlier calls.
        let header_first =
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Oslo\", \"unit\": \"c\"}";
        assert_eq!(b.read(header_first), oslo);
        assert_eq!(b.read("It is -3 C."), Reply::Text("It is -3 C.".into()));
        assert_eq!(
            b.read(
                "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Cold.<|return|>"
            ),
            Reply::Text("Cold.".into())
        );
        // A call that is not one: the answer as it came.
        for text in [
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": ",
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>[1]",
            "<|channel|>commentary to=functions. <|constrain|>json<|message|>{}",
            "<|channel|>commentary to=functions.get_weather",
        ] {
            assert_eq!(b.read(text), Reply::Text(text.into()), "{text}");
        }
    }

    #[test]
    fn the_syntax_is_read_off_the_template() {
        let hermes =
            "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> <tool_call>{% endif %}";
        assert_eq!(ToolSyntax::of(hermes), ToolSyntax::Hermes);
        // Qwen3-Coder's XML; GLM's `<arg_key>` pairs are not Hermes' (nor read yet);
        // Seed-OSS's `<seed:tool_call>` XML is not Qwen's.
        let qwen_xml = "{% for tool in tools %}<function>{% endfor %}{{- '<tool_call>\\n<function=' + \
                        tool_call.name + '>\\n' }}{{- '<parameter=' + args_name + '>\\n' }}";
        assert_eq!(ToolSyntax::of(qwen_xml), ToolSyntax::QwenXml);
        assert_eq!(ToolSyntax::of(&qwen_xml.replace("tools", "functions")), ToolSyntax::Generic);
        let glm = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}{{ '<tool_call>' + tc.name }}\
                   {{ '<arg_key>' + k + '</arg_key><arg_value>' + v + '</arg_value>' }}</tool_call>";
        assert_eq!(ToolSyntax::of(glm), ToolSyntax::Generic);
        let seed = "{% for tool in tools %}{% endfor %}{{ '<seed:tool_call>\\n<function=' + name + '>\\n' }}\
                    {{ '<parameter=' + arg_name + '>' }}";
        assert_eq!(ToolSyntax::of(seed), ToolSyntax::Generic);
        let llama3 = "{%- if tools is not none %}Environment: ipython\n{{- '\"parameters\": ' }}{% endif %}";
        assert_eq!(ToolSyntax::of(llama3), ToolSyntax::Llama3);
        assert_eq!(
            ToolSyntax::of("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}"),
            ToolSyntax::Generic
        );
        // Mistral's: Nemo's list; the later calls with `[ARGS]`, with or without ids; a
        // template that never names the tools is not read as Mistral's.
        assert_eq!(ToolSyntax::of("[AVAILABLE_TOOLS]{{ tools | tojson }}[TOOL_CALLS]"), ToolSyntax::MistralNemo);
        let later = "[AVAILABLE_TOOLS]{{ tools | tojson }}{{ '[TOOL_CALLS]' + name + '[ARGS]' + arguments }}";
        assert_eq!(ToolSyntax::of(later), ToolSyntax::Mistral { call_ids: false });
        let ids = "{{ tools | tojson }}{{ '[TOOL_CALLS]' + name }}{{ '[CALL_ID]' + id }}{{ '[ARGS]' + arguments }}";
        assert_eq!(ToolSyntax::of(ids), ToolSyntax::Mistral { call_ids: true });
        assert_eq!(ToolSyntax::of("{{ '[TOOL_CALLS]' + name + '[ARGS]' }}"), ToolSyntax::Generic);
        let r7b = "{% for tool in tools %}{{ tool }}{% endfor %}<|START_ACTION|>[{\"tool_call_id\": \"0\", \
                   \"tool_name\": \"{{ tc.function.name }}\"}]<|END_ACTION|>";
        assert_eq!(ToolSyntax::of(r7b), ToolSyntax::CommandR7b);
        // R7B's instructions say `Action:` and show a `json` fence too: its markers decide.
        let r7b_told = format!("{r7b}1. Action: write <|START_ACTION|> …\n```json\n[]\n```");
        assert_eq!(ToolSyntax::of(&r7b_told), ToolSyntax::CommandR7b);
        // Command R+'s `Action:` lists (fenced, of `"tool_name"`s); not without the fence,
        // the names or the tools.
        let plus = "{% for tool in tools %}{% endfor %}{{- '\\nAction:\\n```json\\n[\\n' }}\
                    {{- '\"tool_name\": \"' + tool_call.name + '\",\\n' }}";
        assert_eq!(ToolSyntax::of(plus), ToolSyntax::CommandRPlus);
        assert_eq!(ToolSyntax::of(&plus.replace("```json", "")), ToolSyntax::Generic);
        assert_eq!(ToolSyntax::of(&plus.replace("tool_name", "name")), ToolSyntax::Generic);
        assert_eq!(ToolSyntax::of(&plus.replace("tools", "functions")), ToolSyntax::Generic);
        // DeepSeek's own templates never name the tools; llama.cpp's R1 template lists them.
        let r1 = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + \
                  tool['function']['name'] + '\\n' + '```json' }}";
        assert_eq!(ToolSyntax::of(r1), ToolSyntax::DeepSeekR1 { lists_tools: false });
        let listed = format!("{{% if tools %}}{{{{ tools | tojson }}}}{{% endif %}}{r1}");
        assert_eq!(ToolSyntax::of(&listed), ToolSyntax::DeepSeekR1 { lists_tools: true });
        let v31 = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + \
                   tool['function']['arguments'] | tojson }}";
        assert_eq!(ToolSyntax::of(v31), ToolSyntax::DeepSeekV31 { lists_tools: false });
        // gpt-oss's harmony: calls written as commentary messages to "functions.".
        let harmony = "{%- if tools %}{{ tools }}{% endif %}{{- \"<|start|>assistant to=\" }}{{- \"functions.\" + \
                       tool_call.name + \"<|channel|>commentary \" }}";
        assert_eq!(ToolSyntax::of(harmony), ToolSyntax::Harmony);
    }

    /// A model whose template speaks a tool syntax gets the conversation in OpenAI's
    /// shape and the tools as given; any other gets the generic turns.
    #[test]
    fn the_prompt_goes_through_the_models_own_tool_syntax_when_it_has_one() {
        struct Model(ToolSyntax);
        impl TextModel for Model {
            fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, String> {
                Ok(format!("generic {}", messages.len()))
            }
            fn tokenize(&self, _: &str, _: bool) -> Vec<shoal_types::TokenId> {
                Vec::new()
            }
            fn piece(&self, _: shoal_types::TokenId) -> Vec<u8> {
                Vec::new()
            }
            fn eog_tokens(&self) -> Vec<shoal_types::TokenId> {
                Vec::new()
            }
            fn tool_syntax(&self) -> ToolSyntax {
                self.0
            }
            fn chat_prompt_with_tools(&self, messages: &Value, tools: &Value) -> Result<String, String> {
                Ok(format!("{messages}|{tools}"))
            }
        }
        let turns = [
            Turn { role: "user".into(), content: "Weather?".into(), ..Turn::default() },
            Turn {
                role: "assistant".into(),
                calls: vec![Call {
                    id: Some("c1".into()),
                    name: "get_weather".into(),
                    arguments: json!({"city": "Oslo"}),
                }],
                ..Turn::default()
            },
            Turn { role: "tool".into(), content: "-3".into(), call_id: Some("c1".into()), ..Turn::default() },
        ];
        let mut b = Toolbox::new(&[weather()], None, None).unwrap().unwrap();
        assert_eq!(
            prompt(&Model(ToolSyntax::Generic), &turns, Some(&b), &PromptOptions::default()).unwrap(),
            "generic 4"
        );
        b.speak(ToolSyntax::Hermes);
        let p = prompt(&Model(ToolSyntax::Hermes), &turns, Some(&b), &PromptOptions::default()).unwrap();
        let (messages, tools) = p.split_once('|').unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(messages).unwrap(),
            json!([
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "id": "c1",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "content": "-3", "tool_call_id": "c1", "name": "get_weather"},
            ])
        );
        assert_eq!(serde_json::from_str::<Value>(tools).unwrap(), json!([weather()]));

        // Mistral's templates take 9-character ids only, and a call's content as text.
        b.speak(ToolSyntax::MistralNemo);
        let p = prompt(&Model(ToolSyntax::MistralNemo), &turns, Some(&b), &PromptOptions::default()).unwrap();
        let m: Value = serde_json::from_str(p.split_once('|').unwrap().0).unwrap();
        let id = m[1]["tool_calls"][0]["id"].as_str().unwrap();
        assert!(is_mistral_id(id) && m[2]["tool_call_id"] == id && m[1]["content"] == "", "{m}");

        // Command R+'s template writes every parameter's description and looks names up
        // in `required` (a call's content, too, as text): none undefined.
        let bare = json!({"type": "function", "function": {"name": "now"}});
        let mut both = Toolbox::new(&[weather(), bare], None, None).unwrap().unwrap();
        both.speak(ToolSyntax::CommandRPlus);
        let p = prompt(&Model(ToolSyntax::CommandRPlus), &turns, Some(&both), &PromptOptions::default()).unwrap();
        let (messages, tools) = p.split_once('|').unwrap();
        assert_eq!(serde_json::from_str::<Value>(messages).unwrap()[1]["content"], "");
        let tools: Value = serde_json::from_str(tools).unwrap();
        assert_eq!(
            tools[0]["function"]["parameters"],
            json!({"type": "object", "properties": {"city": {"type": "string", "description": ""},
                "unit": {"enum": ["c", "f"], "description": ""}}, "required": ["city"]})
        );
        assert_eq!(tools[0]["function"]["description"], "The weather in a city");
        assert_eq!(tools[1]["function"]["parameters"], json!({"type": "object", "properties": {}, "required": []}));
    }

    /// Mistral Nemo's syntax: a required call is `[TOOL_CALLS]` then one JSON list of
    /// `{"name", "arguments", "id"}` objects, each id 9 letters or digits (one object
    /// unless parallel); answers read back from that list after the marker (after any
    /// thinking), anything else as text.
    #[test]
    fn mistral_nemo_grammar_holds_a_call_list_and_answers_read_back() {
        let b = required(ToolSyntax::MistralNemo, true);
        let g = b.grammar().unwrap();
        let two = "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"unit\": \"c\"}, \
                   \"id\": \"a1B2c3D4e\"}, {\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}, \"id\": \"000000001\"}]";
        assert!(gbnf::accepts(&g, two), "{g}");
        // Mistral 7B v0.3's template writes a space after the marker.
        let spaced = two.replacen("[TOOL_CALLS][", "[TOOL_CALLS] [", 1);
        assert!(gbnf::accepts(&g, &spaced));
        for bad in [
            two.replace("a1B2c3D4e", "a1B2c3D4"),
            two.replace("a1B2c3D4e", "call_1234"),
            two.replace(", \"id\": \"000000001\"", ""),
            two.replace("get_time", "get_date"),
            two.replace("\"unit\": \"c\"", "\"unit\": \"k\""),
            two.replace("[TOOL_CALLS]", ""),
            "[TOOL_CALLS][]".to_string(),
            format!("Sure. {two}"),
        ] {
            assert!(!gbnf::accepts(&g, &bad), "{bad}");
        }
        let one = required(ToolSyntax::MistralNemo, false).grammar().unwrap();
        let first = "[TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {}, \"id\": \"zzzzzzzzz\"}]";
        assert!(!gbnf::accepts(&one, two) && gbnf::accepts(&one, first), "{one}");
        let mut auto = Toolbox::new(&[weather()], None, None).unwrap().unwrap();
        auto.speak(ToolSyntax::MistralNemo);
        assert_eq!(auto.grammar(), None);

        assert_eq!(b.read(two), oslo_and_cet());
        assert_eq!(b.read(&spaced), oslo_and_cet());
        assert_eq!(b.read(&format!("[THINK]Oslo, then the time.[/THINK]{two}\n")), oslo_and_cet());
        for text in [
            "It is -3 C.".to_string(),
            "[TOOL_CALLS][]".to_string(),
            "[TOOL_CALLS][{\"name\": 3, \"arguments\": {}}]".to_string(),
            "[TOOL_CALLS]{\"name\": \"get_time\", \"arguments\": {}}".to_string(),
            two[..two.len() - 4].to_string(),
            format!("{two} Done."),
        ] {
            assert_eq!(b.read(&text), Reply::Text(text.clone()));
        }
    }

    /// Later Mistrals' syntax: a required call is `[TOOL_CALLS]NAME[ARGS]{…}`, chained
    /// without separators when parallel; an id (`NAME[CALL_ID]ID[ARGS]`) only where the
    /// template writes ids. Answers read back call by call, a malformed one making the
    /// answer text.
    #[test]
    fn mistral_grammar_holds_chained_calls_and_answers_read_back() {
        let two = "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Oslo\", \"unit\": \"c\"}[TOOL_CALLS]get_time[ARGS]{\"zone\": \"CET\"}";
        let with_id = two.replace("get_time[ARGS]", "get_time[CALL_ID]a1B2c3D4e[ARGS]");
        for call_ids in [false, true] {
            let syntax = ToolSyntax::Mistral { call_ids };
            let b = required(syntax, true);
            let g = b.grammar().unwrap();
            assert!(gbnf::accepts(&g, two), "{g}");
            assert_eq!(gbnf::accepts(&g, &with_id), call_ids, "{g}");
            for bad in [
                two.replace("[ARGS]{\"zone\"", "{\"zone\""),
                two.replace("get_time", "get_date"),
                two.replace("}[TOOL_CALLS]", "}\n[TOOL_CALLS]"),
                with_id.replace("a1B2c3D4e", "a1B2c3D4"),
                "[TOOL_CALLS]get_weather".to_string(),
                "[TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {}}]".to_string(),
                format!("Sure. {two}"),
            ] {
                assert!(!gbnf::accepts(&g, &bad), "{bad}");
            }
            let one = required(syntax, false).grammar().unwrap();
            assert!(!gbnf::accepts(&one, two) && gbnf::accepts(&one, "[TOOL_CALLS]get_time[ARGS]{}"), "{one}");
            let mut auto = Toolbox::new(&[weather()], None, None).unwrap().unwrap();
            auto.speak(syntax);
            assert_eq!(auto.grammar(), None);

            assert_eq!(b.read(two), oslo_and_cet());
            assert_eq!(b.read(&with_id), oslo_and_cet());
            assert_eq!(b.read(&format!("[THINK]Oslo first.[/THINK]{two}")), oslo_and_cet());
            assert_eq!(b.read(&format!("Let me look. {}\n", two.replace("}[TOOL", "}\n[TOOL"))), oslo_and_cet());
            for text in [
                "It is -3 C.".to_string(),
                "[TOOL_CALLS]get_weather{\"city\": \"Oslo\"}".to_string(),
                "[TOOL_CALLS]get weather[ARGS]{}".to_string(),
                "[TOOL_CALLS][ARGS]{}".to_string(),
                "[TOOL_CALLS]get_time[ARGS][\"CET\"]".to_string(),
                "[TOOL_CALLS]get_time[ARGS]{zone: CET}".to_string(),
                two[..two.len() - 3].to_string(),
                format!("{two} Done."),
            ] {
                assert_eq!(b.read(&text), Reply::Text(text.clone()));
            }
        }
    }

    /// Mistral's templates take only 9-character ids: a conversation's are mapped to such
    /// ones (kept where they are), the same for a call and its results, distinct, and the
    /// same every time; calls without ids (Ollama's) get ones their results (by tool
    /// name, else in order) answer; a call's null content becomes `""`.
    #[test]
    fn mistral_conversations_get_nine_character_ids_consistently() {
        let call = |id: Option<&str>, name: &str| {
            let mut c = json!({"type": "function", "function": {"name": name, "arguments": {}}});
            if let Some(id) = id {
                c["id"] = json!(id);
            }
            c
        };
        let clash = mistral_id(b"call_abc");
        let original = json!([
            {"role": "user", "content": "Weather and time?"},
            {"role": "assistant", "content": null, "tool_calls": [call(Some("call_abc"), "get_weather"),
                call(Some("a1B2c3D4e"), "get_time"), call(Some("toolu_01"), "get_time")]},
            {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "12:00"},
            {"role": "tool", "tool_call_id": "call_abc", "content": "-3"},
            {"role": "tool", "tool_call_id": "toolu_01", "content": "12:00"},
            {"role": "assistant", "content": "", "tool_calls": [call(None, "get_weather"), call(None, "get_time")]},
            {"role": "tool", "name": "get_time", "content": "13:00"},
            {"role": "tool", "content": "-4"},
            // A client's id that is what another hashes to.
            {"role": "assistant", "content": null, "tool_calls": [call(Some(&clash), "get_time")]},
        ]);
        let mut m = original.clone();
        for_mistral(&mut m);
        let id = |p: &str| m.pointer(p).and_then(Value::as_str).unwrap().to_string();
        let calls = ["/1/tool_calls/0/id", "/1/tool_calls/1/id", "/1/tool_calls/2/id", "/5/tool_calls/0/id"];
        let mut all: Vec<String> =
            calls.iter().map(|p| id(p)).chain([id("/5/tool_calls/1/id"), id("/8/tool_calls/0/id")]).collect();
        assert!(all.iter().all(|i| is_mistral_id(i)), "{m}");
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 6, "{m}");
        assert_eq!(id("/1/tool_calls/1/id"), "a1B2c3D4e");
        assert_eq!(id("/2/tool_call_id"), "a1B2c3D4e");
        assert_eq!(id("/3/tool_call_id"), id("/1/tool_calls/0/id"));
        assert_eq!(id("/4/tool_call_id"), id("/1/tool_calls/2/id"));
        assert_eq!(
            (id("/6/tool_call_id"), id("/7/tool_call_id")),
            (id("/5/tool_calls/1/id"), id("/5/tool_calls/0/id"))
        );
        assert_eq!((&m[1]["content"], &m[5]["content"]), (&json!(""), &json!("")));
        let mut again = original.clone();
        for_mistral(&mut again);
        assert_eq!(again, m);

        // The ids Shoal gives Mistral models' calls.
        let b = required(ToolSyntax::Mistral { call_ids: true }, true);
        let (a, c) = (b.new_call_id(), b.new_call_id());
        assert!(is_mistral_id(&a) && is_mistral_id(&c) && a != c, "{a} {c}");
        assert!(required(ToolSyntax::Hermes, true).new_call_id().starts_with("call_"));
    }

    /// A syntax's markers that are control tokens (one token, rendered as nothing) are
    /// shown as their text; markers that are text already, or several tokens, are not.
    #[test]
    fn control_token_markers_are_shown_as_their_text() {
        struct Tekken;
        impl TextModel for Tekken {
            fn chat_prompt(&self, _: &[ChatMessage]) -> Result<String, String> {
                Ok(String::new())
            }
            fn tokenize(&self, text: &str, parse_special: bool) -> Vec<shoal_types::TokenId> {
                // BOS 1; [TOOL_CALLS] a control token; [ARGS] a text token; the rest bytes.
                let body = match (text, parse_special) {
                    ("[TOOL_CALLS]", true) => vec![5],
                    ("[ARGS]", true) => vec![6],
                    _ => text.bytes().map(|b| 100 + shoal_types::TokenId::from(b)).collect(),
                };
                [vec![1], body].concat()
            }
            fn piece(&self, token: shoal_types::TokenId) -> Vec<u8> {
                match token {
                    6 => b"[ARGS]".to_vec(),
                    t if t >= 100 => vec![(t - 100) as u8],
                    _ => Vec::new(),
                }
            }
            fn eog_tokens(&self) -> Vec<shoal_types::TokenId> {
                vec![2]
            }
        }
        let b = required(ToolSyntax::Mistral { call_ids: true }, true);
        assert_eq!(b.shown_markers(&Tekken), vec![(5, b"[TOOL_CALLS]".to_vec())]);
        assert_eq!(required(ToolSyntax::MistralNemo, true).shown_markers(&Tekken), vec![(5, b"[TOOL_CALLS]".to_vec())]);
        assert!(required(ToolSyntax::Hermes, true).shown_markers(&Tekken).is_empty());
    }

    #[test]
    fn answers_read_back_as_calls_or_a_reply_and_anything_else_as_text() {
        let b = Toolbox::new(&[weather()], None, None).unwrap().unwrap();
        let calls =
            b.read(r#" {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]}"#);
        assert_eq!(
            calls,
            Reply::Calls(vec![Call {
                id: None,
                name: "get_weather".into(),
                arguments: json!({"city": "Paris", "unit": "c"})
            }])
        );
        assert_eq!(b.read(r#"{"response": "Hello"}"#), Reply::Text("Hello".into()));
        // Cut short by max_tokens: what came, as text.
        assert_eq!(
            b.read(r#"{"tool_calls": [{"name": "get_we"#),
            Reply::Text(r#"{"tool_calls": [{"name": "get_we"#.into())
        );
    }

    #[test]
    fn the_conversation_carries_the_instructions_the_calls_and_the_results() {
        let b = Toolbox::new(&[weather()], None, None).unwrap().unwrap();
        let call = Call { id: Some("call_1".into()), name: "get_weather".into(), arguments: json!({"city": "Paris"}) };
        let turns = vec![
            Turn { role: "system".into(), content: "Be brief.".into(), ..Turn::default() },
            Turn { role: "user".into(), content: "Weather in Paris?".into(), ..Turn::default() },
            Turn { role: "assistant".into(), calls: vec![call], ..Turn::default() },
            Turn { role: "tool".into(), content: "18 C".into(), call_id: Some("call_1".into()), ..Turn::default() },
            Turn { role: "assistant".into(), content: "18 C.".into(), ..Turn::default() },
        ];
        let m = prompt_turns(&turns, Some(&b));
        assert_eq!(m.len(), 5);
        assert!(m[0].content.starts_with("Be brief.\n\nYou can call") && m[0].content.contains("\"get_weather\""));
        assert_eq!(m[2].content, r#"{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}"#);
        assert_eq!(m[3].role, "user");
        let r: Value = serde_json::from_str(&m[3].content).unwrap();
        assert_eq!(r, json!({"tool_response": {"content": "18 C", "tool": "get_weather", "tool_call_id": "call_1"}}));
        assert_eq!(m[4].content, r#"{"response":"18 C."}"#);
        // Without a toolbox nothing is added and replies stay text.
        let plain = prompt_turns(&turns[..2], None);
        assert_eq!(plain[0].content, "Be brief.");
        assert_eq!(prompt_turns(&turns[1..2], Some(&b))[0].role, "system");
    }

    #[test]
    fn calls_are_read_in_openais_and_ollamas_shapes() {
        let openai = json!([{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]);
        let ollama = json!([{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]);
        let (a, b) = (calls_of(&openai).unwrap(), calls_of(&ollama).unwrap());
        assert_eq!(a[0].id.as_deref(), Some("call_1"));
        assert_eq!((&a[0].name, &a[0].arguments), (&b[0].name, &b[0].arguments));
        assert_eq!(b[0].arguments, json!({"city": "Paris"}));
        assert!(calls_of(&json!({})).is_err());
        assert!(calls_of(&json!([{"function": {}}])).unwrap_err().contains("function.name"));
    }
}
