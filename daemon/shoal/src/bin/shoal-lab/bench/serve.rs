//! `shoal-lab bench serve`: the HTTP API on a local cluster (three `shoal serve` processes
//! on loopback, or with `--netns` each on a namespace host of its own, the client on
//! the first host calling the second's API over the bridge with a key, as another
//! machine would; the model split over them), measured side by side with `shoal run`
//! unsplit in the same run, rounds interleaved (these machines are noisy):
//! - single-stream decode tok/s through the API vs unsplit;
//! - time to first token of a ~1,000-token prompt through the API vs unsplit;
//! - the API's own cost per token: API vs `shoal generate --model` (the node protocol,
//!   no HTTP) on the same placement, the median of back-to-back pairs;
//! - aggregate tok/s with 1, 2, 3 and 6 concurrent streams (a placement of 6 sessions,
//!   loaded afresh for each count so that its step breakdown is its own; every stream
//!   makes its full count of tokens, as the single-stream runs do, so that counts
//!   compare the same work; a count's multiple is of one stream run just before its
//!   load and one just after it, on its load), beside two unsplit processes side by
//!   side: what the machine gives two computations at once in that moment, and a ring
//!   of threads computing one stream's per-stage compute with as many tokens as
//!   streams (no networking; [`super::ring`]): what the machine's scheduler gives any
//!   pipeline; and the same ring with its threads pinned to the CPUs: what a fixed
//!   placement of the stages gets, each ring as a share of what it could reach;
//! - a stream's longest pause while another request's ~1,000-token prompt is read.
//!
//! Generations ignore end-of-text: a stream that stopped early would compare fewer
//! tokens, and a count's aggregate would include time when fewer streams ran.

use super::{median, ring};
use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use shoal::local::Lab;
use shoal_node::api::{NodeRequest, NodeResponse};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// `shoal-lab bench serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// The GGUF model [default: the test model].
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// Memory each node offers, MiB (so the model splits in three).
    #[arg(long, default_value_t = 110)]
    max_memory_mib: u64,
    /// Tokens per generation.
    #[arg(short = 'n', long, default_value_t = 128)]
    tokens: u32,
    /// Rounds of each single-stream measurement (the median is printed).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Each node on a network namespace host of its own (needs root and iproute2).
    #[arg(long)]
    netns: bool,
}

/// Where the bench sends its HTTP: the API's base URL, the key it needs from another
/// host, and the lab node whose host the client runs on.
struct Api<'a> {
    lab: &'a Lab,
    url: String,
    key: Option<String>,
    client: &'static str,
}

impl Api<'_> {
    /// A POST of `body` to `path`, the client's headers set.
    fn request(&self, path: &str, body: &Value) -> Result<ureq::http::Response<ureq::Body>> {
        let mut r = agent().post(&format!("{}{path}", self.url)).header("content-type", "application/json");
        if let Some(k) = &self.key {
            r = r.header("authorization", &format!("Bearer {k}"));
        }
        Ok(r.send(body.to_string())?)
    }

    /// Run `f` on the client's host.
    fn on_client<T: Send>(&self, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        self.lab.near(self.client, f)
    }
}

/// What one generation took.
#[derive(Clone, Copy, Debug)]
struct Timing {
    /// Tokens made.
    tokens: u64,
    /// Request to first token, s.
    ttft: f64,
    /// Tokens after the first per second.
    tok_s: f64,
}

pub fn serve(a: ServeArgs) -> Result<()> {
    let model = super::node::model_or_default(&a.model)?;
    let name = model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let long_prompt = long_prompt(1000);
    let lab = if a.netns {
        eprintln!("[bench] three nodes on namespace hosts, {} MiB each …", a.max_memory_mib);
        Lab::start_on_hosts(3, a.max_memory_mib, &[])?
    } else {
        eprintln!("[bench] three nodes on loopback, {} MiB each …", a.max_memory_mib);
        Lab::start(3, a.max_memory_mib)?
    };
    lab.ask("n0", NodeRequest::ModelAdd { path: model.display().to_string(), name: None })?;
    // On hosts, the client is on n0's host and calls n1's API over the bridge: not
    // loopback, so with a key, as another machine would.
    let key = match a.netns {
        true => {
            match lab.ask("n0", NodeRequest::KeyCreate { name: "bench".into(), scope: shoal_types::KeyScope::Chat })? {
                shoal_node::api::NodeResponse::KeyCreated { secret, .. } => Some(secret),
                other => bail!("creating a key: {other:?}"),
            }
        }
        false => None,
    };
    let api = Api { lab: &lab, url: lab.api_url("n1")?, key, client: if a.netns { "n0" } else { "n1" } };

    // Single stream: one session, a context for the long prompt.
    let ctx = 1024 + a.tokens + 64;
    lab.ask("n2", NodeRequest::ModelLoad { model: name.clone(), context: ctx, sessions: 1, exclude: vec![] })?;
    let (p, _) = lab.running(&name, 0)?;
    eprintln!("[bench] placed in {} stages (context {ctx}, 1 session)", p.stages.len());
    let (mut unsplit, mut via_api) = (Vec::new(), Vec::new());
    let (mut ttft_unsplit, mut ttft_api) = (Vec::new(), Vec::new());
    for round in 0..a.rounds {
        eprintln!("[bench] round {} of {}", round + 1, a.rounds);
        unsplit.push(run_unsplit(&lab.exe, &model, super::node::PROMPT, a.tokens, ctx)?);
        via_api.push(api.on_client(|| api_stream(&api, &name, super::node::PROMPT, a.tokens))?);
        ttft_unsplit.push(run_unsplit(&lab.exe, &model, &long_prompt, 2, ctx)?.ttft);
        ttft_api.push(api.on_client(|| api_stream(&api, &name, &long_prompt, 2))?.ttft);
    }
    let tps = |v: &[Timing]| -> Vec<f64> { v.iter().map(|t| t.tok_s).collect() };
    let (u, api_tps) = (median(&mut tps(&unsplit)), median(&mut tps(&via_api)));
    let (tu, ta) = (median(&mut ttft_unsplit), median(&mut ttft_api));
    println!(
        "single stream, {} tokens, median of {} rounds ({} stages, layers {}):",
        a.tokens,
        a.rounds,
        p.stages.len(),
        layers(&p)
    );
    println!("  decode tok/s   unsplit {u:>7.1}   API {api_tps:>7.1}   ratio {:.3}   (target >= 0.95)", api_tps / u);
    println!(
        "  TTFT of a {}-token prompt   unsplit {tu:.3} s   API {ta:.3} s   ratio {:.3}",
        api.on_client(|| long_prompt_tokens(&api, &name, &long_prompt)).unwrap_or(0),
        ta / tu
    );
    // The API's own cost per token is a fraction of a ms between two ~13 ms figures that
    // drift by more than that within a minute: measured as the median difference of
    // back-to-back pairs (API, then node protocol, or the reverse, alternating), so
    // that each difference compares the same moment of the machine.
    let per_token = |t: &Timing| if t.tok_s > 0.0 { 1e3 / t.tok_s } else { f64::NAN };
    let (mut diffs, mut api_ms, mut node_ms) = (Vec::new(), Vec::new(), Vec::new());
    for pair in 0..OVERHEAD_PAIRS {
        let api_run = || api.on_client(|| api_stream(&api, &name, super::node::PROMPT, a.tokens));
        let node_run = || node_generate(&lab, &name, super::node::PROMPT, a.tokens);
        let (x, y) = if pair % 2 == 0 {
            let x = api_run()?;
            (x, node_run()?)
        } else {
            let y = node_run()?;
            (api_run()?, y)
        };
        let (x, y) = (per_token(&x), per_token(&y));
        diffs.push(x - y);
        api_ms.push(x);
        node_ms.push(y);
    }
    let (lo, hi) = diffs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), &d| (l.min(d), h.max(d)));
    println!(
        "  API overhead per token: {:.3} ms, median of {OVERHEAD_PAIRS} back-to-back pairs (each {lo:+.3} .. {hi:+.3}; \
         API {:.3} ms/token vs node protocol {:.3}; target <= 0.2)",
        median(&mut diffs),
        median(&mut api_ms),
        median(&mut node_ms)
    );
    // The single-stream runs' steps, round the ring (the concurrent ones below would mix in).
    if let NodeResponse::Breakdowns(all) = lab.ask("n0", NodeRequest::Breakdowns)? {
        for (_, b) in all {
            for line in b.lines() {
                println!("  {line}");
            }
        }
    }

    // Concurrent streams: six sessions, short context.
    let p6 = reload(&lab, &name, 384, 6, p.generation)?;
    println!(
        "concurrent streams ({} stages, layers {}, 6 sessions), {} tokens each:",
        p6.stages.len(),
        layers(&p6),
        a.tokens
    );
    // `k` streams at once: each stream's timing, and their aggregate tok/s (first
    // tokens' waits included) and decode tok/s (the streams' decode speeds added up,
    // first tokens' waits left out, to set beside the unsplit processes' below).
    let streams = |k: usize| -> Result<(Vec<Timing>, f64, f64)> {
        // The streams' threads start inside the client's host (they inherit it).
        api.on_client(|| {
            let t0 = Instant::now();
            let tokens = std::thread::scope(|scope| -> Result<Vec<Timing>> {
                let handles: Vec<_> = (0..k)
                    .map(|i| {
                        let (api, name) = (&api, &name);
                        let prompt = format!("{} (Variation {i}.)", super::node::PROMPT);
                        let n = a.tokens;
                        scope.spawn(move || api_stream(api, name, &prompt, n))
                    })
                    .collect();
                let mut all = Vec::new();
                for h in handles {
                    all.push(h.join().map_err(|_| anyhow::anyhow!("a stream thread panicked"))??);
                }
                Ok(all)
            })?;
            let took = t0.elapsed().as_secs_f64();
            let agg = tokens.iter().map(|t| t.tokens).sum::<u64>() as f64 / took;
            let decode = tokens.iter().map(|t| t.tok_s).sum::<f64>();
            Ok((tokens, agg, decode))
        })
    };
    // Each count's decode multiple, and one stream's compute per stage on a core: the
    // ring reference below runs that compute with as many tokens.
    let (mut multiples, mut one_compute) = (Vec::new(), Vec::new());
    // One stream's (aggregate, decode) tok/s run last: the baseline's half before the
    // next count. A count's multiples are of the mean of one stream run just before it
    // (on the previous load: one on the count's own load would mix into its step
    // breakdown) and one just after it on its load: one stream's speed drifts with the
    // machine by more than the quantity, so a count compares with its own moment.
    let mut before = (0.0, 0.0);
    let mut gen6 = p6.generation;
    for k in [1usize, 2, 3, 6] {
        if k > 1 {
            // A fresh load per count, so each count's step breakdown is its own.
            gen6 = reload(&lab, &name, 384, 6, gen6)?.generation;
        }
        let (tokens, agg, decode) = streams(k)?;
        // This count's steps, read before the one stream after it mixes in.
        let breakdowns = match lab.ask("n0", NodeRequest::Breakdowns)? {
            NodeResponse::Breakdowns(all) => all,
            _ => Vec::new(),
        };
        let (one, one_decode) = if k == 1 {
            before = (agg, decode);
            before
        } else {
            let (_, a1, d1) = streams(1)?;
            let mean = ((before.0 + a1) / 2.0, (before.1 + d1) / 2.0);
            before = (a1, d1);
            mean
        };
        let decode_x = decode / one_decode;
        multiples.push((k, decode_x));
        // Where a stream's time goes: its first token's wait, then its decode speed.
        let mean = |f: fn(&Timing) -> f64| tokens.iter().map(f).sum::<f64>() / tokens.len() as f64;
        println!(
            "  {k} stream(s): {agg:>7.1} tok/s aggregate   x{:.2} of one stream   (each: first token after {:.3} s, \
             then {:.1} tok/s; decode x{:.2}{})",
            agg / one,
            mean(|t| t.ttft),
            mean(|t| t.tok_s),
            decode_x,
            if k == 1 { String::new() } else { format!("; one stream before and after: {one:.1} tok/s") }
        );
        // Where the steps' time went at this count: each stage's compute on a core,
        // the time its core ran other threads meanwhile (the stages run one CPU thread
        // each here, so their compute's time off the CPU is that: stages and networking
        // sharing the machine's cores), and its wait for the stage thread (another
        // session's step ahead of it).
        for (_, b) in breakdowns {
            if k == 1 {
                one_compute = b.parts.iter().filter(|p| p.what.contains(" compute (")).map(|p| p.us).collect();
            }
            let per_stage = |what: &str| {
                let us: Vec<String> =
                    b.parts.iter().filter(|p| p.what.contains(what)).map(|p| format!("{:.0}", p.us)).collect();
                us.join(" / ")
            };
            println!(
                "      a session's step every {:.0} µs (median {:.0}): compute on a core {} µs, its core taken by \
                 other threads {} µs, waits for the stage thread {} µs",
                b.interval_us,
                b.interval_p50_us,
                per_stage(" compute ("),
                per_stage(" compute, its thread off the CPU"),
                per_stage(" hand-off to the stage thread")
            );
        }
    }

    // What this machine gives two computations at once, measured now (these machines'
    // state drifts): `shoal run` unsplit alone, then two side by side, decode speeds.
    let solo = run_unsplit(&lab.exe, &model, super::node::PROMPT, a.tokens, ctx)?.tok_s;
    let pair = std::thread::scope(|scope| -> Result<Vec<f64>> {
        let runs: Vec<_> =
            (0..2).map(|_| scope.spawn(|| run_unsplit(&lab.exe, &model, super::node::PROMPT, a.tokens, ctx))).collect();
        runs.into_iter().map(|r| Ok(r.join().map_err(|_| anyhow::anyhow!("a run's thread panicked"))??.tok_s)).collect()
    })?;
    println!(
        "  this machine meanwhile: `shoal run` unsplit {solo:.1} tok/s alone, two side by side {:.1} + {:.1} (decode x{:.2})",
        pair[0],
        pair[1],
        pair.iter().sum::<f64>() / solo
    );
    // What the machine's scheduler gives a pipeline, measured now: a ring of threads
    // computing one stream's per-stage compute, with as many tokens as streams, no
    // networking: stages that only compute and hand over at once, what a pipeline of
    // these stages can at most expect of this machine's scheduler.
    if !one_compute.is_empty() {
        let work: Vec<Duration> =
            one_compute.iter().map(|&us| Duration::try_from_secs_f64(us / 1e6).unwrap_or_default()).collect();
        let rate = |k: usize| ring::tokens_per_s(&work, k, Duration::from_secs(3));
        let single = rate(1);
        let shown: Vec<String> = one_compute.iter().map(|us| format!("{us:.0}")).collect();
        println!(
            "  a ring of {} threads computing those stages' {} µs per token (no model, no networking): 1 token {single:.1} tok/s",
            work.len(),
            shown.join(" / ")
        );
        // What each ring could reach with `k` tokens, as a multiple of its measured one
        // token: free threads on `cpus` cores at most k, or the cores' worth of the
        // round's work, or the slowest stage's pace; pinned ones their busiest CPU's.
        let cpus = ring::allowed_cpus();
        let (sum, max) = (work.iter().sum::<Duration>(), work.iter().max().copied().unwrap_or_default());
        let free_limit = |k: usize, one: f64| -> f64 {
            let cores = cpus.len().max(1) as f64 / sum.as_secs_f64() / one;
            (k as f64).min(cores).min(1.0 / max.as_secs_f64() / one)
        };
        // A ring that made no token in its window (a stalled machine) has no multiple.
        for &(k, multiple) in multiples.iter().filter(|m| m.0 > 1 && single > 0.0) {
            let ring_x = rate(k) / single;
            let limit = free_limit(k, single);
            println!(
                "      {k} tokens x{ring_x:.2}, {:.0}% of the x{limit:.2} {} cores allow; the API's {k} streams decode x{multiple:.2}, {:.0}% of the ring's",
                100.0 * ring_x / limit,
                cpus.len(),
                100.0 * multiple / ring_x
            );
        }
        // The same ring with each thread kept on a CPU (the heaviest stages spread
        // first). Pinning three stages to two cores allows less than free threads
        // could reach; a pinned ring that comes nearer its limit than the free one
        // does to its own shows what the scheduler's placement of woken threads costs.
        let (on, busiest) = ring::balanced(&work, &cpus);
        let pinned = |k: usize| ring::tokens_per_s_pinned(&work, k, Duration::from_secs(3), &on);
        if !on.is_empty() && !busiest.is_zero() {
            if let Some(one) = pinned(1).filter(|r| *r > 0.0) {
                let shown: Vec<String> = on.iter().map(|c| c.to_string()).collect();
                println!(
                    "  the same ring pinned, stage by stage on CPUs {}: 1 token {one:.1} tok/s",
                    shown.join(" / ")
                );
                for &(k, _) in multiples.iter().filter(|m| m.0 > 1) {
                    // With every stage busy, a pinned ring runs at its busiest CPU's pace.
                    let limit = (k as f64).min(1.0 / busiest.as_secs_f64() / one);
                    if let Some(r) = pinned(k) {
                        let x = r / one;
                        println!(
                            "      {k} tokens x{x:.2}, {:.0}% of the x{limit:.2} pinning allows",
                            100.0 * x / limit
                        );
                    }
                }
            }
        }
    }

    // A stream while another request's long prompt is read: the stages run decode
    // steps before other sessions' prompt chunks, so the stream pauses for about one
    // chunk's compute per stage, not the whole prompt's.
    reload(&lab, &name, ctx, 2, gen6)?;
    let (gaps, (from, to)) = api.on_client(|| {
        std::thread::scope(|scope| -> Result<(Vec<Gap>, (Instant, Instant))> {
            let (api, name) = (&api, &name);
            let stream = scope.spawn(move || api_stream_times(api, name, super::node::PROMPT, 4 * a.tokens));
            std::thread::sleep(Duration::from_millis(600));
            let from = Instant::now();
            api_stream(api, name, &long_prompt, 1)?;
            let to = Instant::now();
            let times = stream.join().map_err(|_| anyhow::anyhow!("the stream thread panicked"))??;
            let gaps = times.windows(2).map(|w| (w[1], (w[1] - w[0]).as_secs_f64() * 1e3)).collect();
            Ok((gaps, (from, to)))
        })
    })?;
    let mut all: Vec<f64> = gaps.iter().map(|g| g.1).collect();
    all.sort_by(f64::total_cmp);
    let during =
        gaps.iter().filter(|g| g.0 > from && g.0 <= to + Duration::from_millis(50)).map(|g| g.1).fold(0.0, f64::max);
    println!(
        "a stream while another request's {}-token prompt is read: longest pause {during:.1} ms (prompt read in {:.0} ms; the stream's median gap {:.1} ms)",
        api.on_client(|| long_prompt_tokens(&api, &name, &long_prompt)).unwrap_or(0),
        (to - from).as_secs_f64() * 1e3,
        all.get(all.len() / 2).copied().unwrap_or(f64::NAN)
    );
    Ok(())
}

/// Back-to-back pairs (API stream, node protocol generation) behind the API overhead
/// figure: enough for a median that one burst of the machine does not move.
const OVERHEAD_PAIRS: usize = 7;

/// A stream's gap between two tokens: when the second came, and the gap (ms).
type Gap = (Instant, f64);

/// Unload `name` and load it again with `context` positions and `sessions` (from n2,
/// as the single-stream load): its placement once every stage runs, newer than
/// generation `after`.
fn reload(lab: &Lab, name: &str, context: u32, sessions: u32, after: u64) -> Result<shoal_types::ModelPlacement> {
    lab.ask("n2", NodeRequest::ModelUnload { model: name.into() })?;
    lab.ask("n2", NodeRequest::ModelLoad { model: name.into(), context, sessions, exclude: vec![] })?;
    Ok(lab.running(name, after)?.0)
}

/// The bench's streamed chat request: greedy, `n` tokens whatever the model would end
/// on, the usage in a last chunk.
fn chat_body(model: &str, prompt: &str, n: u32) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
        "max_tokens": n, "stream": true, "stream_options": {"include_usage": true}, "ignore_eos": true})
}

/// When each token of a streamed chat answer arrived.
fn api_stream_times(api: &Api, model: &str, prompt: &str, n: u32) -> Result<Vec<Instant>> {
    Ok(sse_chat(api, &chat_body(model, prompt, n))?.1)
}

/// A streamed chat request's answer read to its end: when the request that was
/// answered went out, when each piece of text arrived, and the completion tokens its
/// usage chunk counts (0 without one). A 503 (the API node's view of a model just
/// loaded can lag its stages' by a moment) is retried after its `Retry-After` (taken
/// as 1–5 s), as the API asks of its clients, a few times; a concurrency count's
/// aggregate then includes the wait, its first-token times do not.
fn sse_chat(api: &Api, body: &Value) -> Result<(Instant, Vec<Instant>, u64)> {
    use std::io::BufRead;
    let mut attempts = 0;
    let (sent, mut r) = loop {
        let sent = Instant::now();
        let r = api.request("/v1/chat/completions", body)?;
        attempts += 1;
        if r.status() != 503 || attempts >= SSE_ATTEMPTS {
            break (sent, r);
        }
        let after = r.headers().get("retry-after").and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
        std::thread::sleep(Duration::from_secs(after.unwrap_or(1).clamp(1, 5)));
    };
    if r.status() != 200 {
        bail!("the API answered {}", r.status());
    }
    let (mut times, mut tokens) = (Vec::new(), 0);
    for line in std::io::BufReader::new(r.body_mut().as_reader()).lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data)?;
        if v["choices"][0]["delta"]["content"].as_str().is_some_and(|t| !t.is_empty()) {
            times.push(Instant::now());
        }
        tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(tokens);
    }
    Ok((sent, times, tokens))
}

/// Requests [`sse_chat`] makes while the API answers 503.
const SSE_ATTEMPTS: u32 = 5;

/// A prompt of about `tokens` tokens (English prose runs ~1.3 tokens a word).
fn long_prompt(tokens: usize) -> String {
    let words: Vec<&str> = super::node::PROMPT.split_whitespace().collect();
    (0..tokens * 17 / 20).map(|i| words[i % words.len()]).collect::<Vec<_>>().join(" ")
}

/// The long prompt's length in the model's tokens (the chat route's usage, 1 token).
fn long_prompt_tokens(api: &Api, name: &str, prompt: &str) -> Result<u64> {
    let body = json!({"model": name, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1});
    let mut r = api.request("/v1/chat/completions", &body)?;
    let text = r.body_mut().read_to_string()?;
    if r.status() != 200 {
        bail!("the API answered {} {text}", r.status());
    }
    let v: Value = serde_json::from_str(&text)?;
    v["usage"]["prompt_tokens"].as_u64().context("no usage")
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).build().into()
}

/// One greedy streamed chat through the API: first token and decode speed as the
/// client sees them.
fn api_stream(api: &Api, model: &str, prompt: &str, n: u32) -> Result<Timing> {
    let (t0, times, tokens) = sse_chat(api, &chat_body(model, prompt, n))?;
    let (Some(&first), Some(&last)) = (times.first(), times.last()) else { bail!("no text came") };
    let decode = (last - first).as_secs_f64();
    Ok(Timing {
        tokens,
        ttft: (first - t0).as_secs_f64(),
        tok_s: if decode > 0.0 { tokens.saturating_sub(1) as f64 / decode } else { 0.0 },
    })
}

/// `shoal generate --model` through node n1 (the node protocol, no HTTP).
fn node_generate(lab: &Lab, model: &str, prompt: &str, n: u32) -> Result<Timing> {
    let out = lab
        .command("n1")
        .args(["generate", "--model", model, "--prompt", prompt, "-n", &n.to_string(), "--json", "--ignore-eos"])
        .arg("--data-dir")
        .arg(lab.dir("n1"))
        .output()?;
    if !out.status.success() {
        bail!("shoal generate: {}", String::from_utf8_lossy(&out.stderr));
    }
    let v: Value = serde_json::from_slice(&out.stdout)?;
    Ok(Timing {
        tokens: v["tokens"].as_array().map_or(0, |t| t.len() as u64),
        ttft: v["prefill_s"].as_f64().unwrap_or(0.0),
        tok_s: v["tok_per_s"].as_f64().unwrap_or(0.0),
    })
}

/// A placement's layer ranges, stage by stage ("0-10 / 10-20 / 20-30").
fn layers(p: &shoal_types::ModelPlacement) -> String {
    p.stages.iter().map(|s| s.layers.to_string()).collect::<Vec<_>>().join(" / ")
}

/// `shoal run` unsplit (one process), as JSON.
fn run_unsplit(exe: &Path, model: &Path, prompt: &str, n: u32, ctx: u32) -> Result<Timing> {
    let out = Command::new(exe)
        .args(["run", "--model"])
        .arg(model)
        .args(["--prompt", prompt, "-n", &n.to_string(), "--json", "--ignore-eos", "--ctx", &ctx.to_string()])
        .args(["--threads", "1"])
        .output()?;
    if !out.status.success() {
        bail!("shoal run: {}", String::from_utf8_lossy(&out.stderr));
    }
    let v: Value = serde_json::from_slice(&out.stdout)?;
    Ok(Timing {
        tokens: v["tokens"].as_array().map_or(0, |t| t.len() as u64),
        ttft: v["prefill_s"].as_f64().unwrap_or(0.0),
        tok_s: v["tok_per_s"].as_f64().unwrap_or(0.0),
    })
}
