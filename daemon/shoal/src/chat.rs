//! `shoal chat`: a conversation in the terminal through a node's HTTP API (OpenAI's
//! chat route, streamed). It keeps the conversation, streams each answer as it comes
//! and says how fast it came. Lines starting with `/` are commands (`/reset`, `/exit`).

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

/// `shoal chat`.
#[derive(Args, Debug)]
pub struct ChatArgs {
    /// The model [default: the first one the cluster runs].
    #[arg(long)]
    model: Option<String>,
    /// The API to talk to [default: this machine's node, from its data directory].
    #[arg(long, value_name = "URL")]
    node: Option<String>,
    /// API key (needed for another machine's node) [env: SHOAL_API_KEY].
    #[arg(long, env = "SHOAL_API_KEY", hide_env_values = true)]
    key: Option<String>,
    /// A system prompt.
    #[arg(long)]
    system: Option<String>,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 1024)]
    max_tokens: u32,
    /// The node's data directory (to find its API) [default: $SHOAL_DATA_DIR, else ~/.local/share/shoal, else the service's /var/lib/shoal].
    #[arg(long)]
    data_dir: Option<PathBuf>,
}

pub fn chat(a: ChatArgs) -> Result<()> {
    let base = match &a.node {
        Some(u) => u.trim_end_matches('/').to_string(),
        None => {
            let file = crate::pipeline::data_dir(&a.data_dir).join(shoal_node::http::HTTP_FILE);
            let addr = std::fs::read_to_string(&file)
                .with_context(|| format!("{}: is `shoal serve` running here? (or give --node URL)", file.display()))?;
            format!("http://{}", addr.trim().replace("0.0.0.0", "127.0.0.1"))
        }
    };
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let auth = a.key.as_ref().map(|k| format!("Bearer {k}"));
    let model = match a.model.clone() {
        Some(m) => m,
        None => first_running(&agent, &base, auth.as_deref())?,
    };
    let tty = std::io::stdin().is_terminal();
    if tty {
        eprintln!("chatting with {model} at {base}; /reset starts over, /exit (or Ctrl-D) ends");
    }
    let mut messages: Vec<Value> = a.system.iter().map(|s| json!({"role": "system", "content": s})).collect();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        if tty {
            eprint!("> ");
        }
        let Some(line) = lines.next() else { break };
        let line = line?;
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages.retain(|m| m["role"] == "system");
                eprintln!("[the conversation starts over]");
                continue;
            }
            _ => {}
        }
        messages.push(json!({"role": "user", "content": line}));
        let body = json!({"model": model, "messages": messages, "stream": true, "temperature": a.temperature,
            "max_tokens": a.max_tokens, "stream_options": {"include_usage": true}});
        let answer = ask(&agent, &base, auth.as_deref(), &body)?;
        messages.push(json!({"role": "assistant", "content": answer}));
    }
    Ok(())
}

/// Stream one answer to stdout; returns its text. Speed and size go to stderr.
fn ask(agent: &ureq::Agent, base: &str, auth: Option<&str>, body: &Value) -> Result<String> {
    let mut req = agent.post(&format!("{base}/v1/chat/completions")).header("content-type", "application/json");
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let t0 = Instant::now();
    let mut r = req.send(body.to_string()).with_context(|| format!("asking {base}"))?;
    if r.status() != 200 {
        let text = r.body_mut().read_to_string().unwrap_or_default();
        let why = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or(text);
        bail!("{} from {base}: {why}", r.status());
    }
    let mut out = std::io::stdout().lock();
    let (mut text, mut first, mut usage) = (String::new(), None, Value::Null);
    for line in std::io::BufReader::new(r.body_mut().as_reader()).lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).context("a malformed chunk")?;
        if let Some(e) = v.get("error") {
            bail!("the answer broke off: {}", e["message"]);
        }
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            first.get_or_insert_with(Instant::now);
            write!(out, "{t}")?;
            out.flush()?;
            text += t;
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    writeln!(out)?;
    let made = usage["completion_tokens"].as_u64().unwrap_or(0);
    let speed = first.map_or(0.0, |f| made.saturating_sub(1) as f64 / f.elapsed().as_secs_f64().max(1e-9));
    eprintln!(
        "[{made} tokens, {speed:.1} tok/s, first after {:.2} s, context {} tokens]",
        first.map_or(0.0, |f| (f - t0).as_secs_f64()),
        usage["total_tokens"].as_u64().unwrap_or(0)
    );
    Ok(text)
}

/// The first model the cluster runs (Ollama's `/api/ps`).
fn first_running(agent: &ureq::Agent, base: &str, auth: Option<&str>) -> Result<String> {
    let mut req = agent.get(&format!("{base}/api/ps"));
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let mut r = req.call().with_context(|| format!("asking {base}"))?;
    let v: Value = serde_json::from_str(&r.body_mut().read_to_string()?).context("an answer that is not JSON")?;
    v["models"][0]["name"]
        .as_str()
        .map(str::to_string)
        .context("the cluster runs no model (shoal models load NAME), or give --model")
}
