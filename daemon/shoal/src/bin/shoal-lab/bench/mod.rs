//! `shoal-lab bench …`: commands that print figures. Each measurement runs in a child
//! process (`shoal run --json`) so that peak RSS is per configuration, and the
//! configurations alternate round by round so that a noisy machine hurts both alike.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde::Deserialize;
use shoal_engine::{open_model, ShardCache};
use shoal_types::split_ranges;
use std::path::PathBuf;
use std::process::Command;

mod adoption;
mod cluster;
mod faults;
mod keepalive;
mod live;
mod node;
mod plan;
mod reconnect;
mod ring;
mod serve;
mod soak;
mod speculative;
mod zoo;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Unsplit vs split into K in-process stages: decode tok/s, ratio, peak RSS.
    Split(SplitArgs),
    /// Unsplit vs K stage processes over QUIC on loopback (optionally impaired):
    /// decode tok/s, ratio, per-token overhead, time to first token.
    Pipeline(PipelineArgs),
    /// Stages on namespace hosts; the middle host's link goes down for seconds, several
    /// times, during a generation: link-up to next-token times, output identical.
    Reconnect(reconnect::ReconnectArgs),
    /// Stages on namespace hosts through a seeded schedule of mixed faults (link cuts,
    /// loss, SIGKILL and restart of a stage, also while its link is down) during one
    /// long generation: each fault's healing to the next token, output identical.
    Faults(faults::FaultsArgs),
    /// The planner's predictions against real runs: SmolLM2 on 2-3 namespace hosts with
    /// different splits and link delays; predicted vs measured decode tok/s.
    Plan(plan::PlanBenchArgs),
    /// The live path's predictions against runs: two cluster nodes on loopback measure
    /// themselves when a placement is planned; predicted vs measured decode tok/s.
    LivePlan(live::LivePlanArgs),
    /// Keep-alive off vs on: the same split on loopback twice, one set of stages
    /// sleeping between tokens, one spinning; decode tok/s and CPU time per token.
    Keepalive(keepalive::KeepaliveArgs),
    /// Cluster nodes on namespace hosts: time to discover, form, elect; failover after
    /// killing the leader; heartbeat traffic; a partition with the leader cut off.
    Cluster(cluster::ClusterBenchArgs),
    /// The cluster against a stranger on namespace hosts: a stranger's cluster approves
    /// a fresh node (it stays out), a stranger's forged welcome while the node waits for
    /// its owner's approval (refused), its owner lets it in by approval, with a code and
    /// with a token, a member restarts through a flood of spoofed QUIC handshakes, and
    /// this machine's own requests are answered while 8 addresses hold slow bodies.
    Adoption(adoption::AdoptionArgs),
    /// The one-daemon flow on loopback: time from `models load` to ready, cold
    /// (shards travel) and warm (cache); transfer throughput against the link;
    /// predicted vs allocated memory per stage.
    Load(node::LoadArgs),
    /// A stage's node SIGKILLed during a generation, round after round: time from the
    /// kill to the next token, tokens replayed, and whether the answer changed.
    Replace(node::ReplaceArgs),
    /// The HTTP API on a local cluster (the model in three stages) against `shoal run`
    /// unsplit: decode tok/s, time to first token of a long prompt, the API's cost per
    /// token, aggregate tok/s with 1, 2, 3 and 6 concurrent streams.
    Serve(serve::ServeArgs),
    /// Hours of home WiFi: cluster nodes on namespace hosts, clients streaming through
    /// every node's API, one fault at a time (WiFi drops, loss bursts, lids, crashes
    /// with the leader's, renumbers): answers changed, requests failed, stalls per kind.
    Soak(soak::SoakArgs),
    /// Speculative decoding: unsplit without vs with speculation vs split with it, on
    /// a repetitive prompt and a free-form one, on loopback and over a delayed link:
    /// decode tok/s, ratios, acceptance rate, mean k, per-token overhead.
    Speculative(speculative::SpeculativeArgs),
    /// The model zoo: the time to write each family's zoo model, and its decode tok/s
    /// unsplit vs split into two in-process stages, with the output compared.
    Zoo(zoo::ZooArgs),
    /// Lab tool: send spoofed QUIC Initial packets (loopback or namespace hosts only).
    #[command(hide = true)]
    Flood(adoption::FloodArgs),
    /// Lab tool: send a stranger's welcome (a cluster state of its making) to a node's
    /// join endpoint; print the answer.
    #[command(hide = true)]
    ForgeWelcome(adoption::ForgeArgs),
    /// Lab tool: hold HTTP requests open with bodies sent a byte at a time, from several
    /// source addresses; print what the server did with them.
    #[command(hide = true)]
    SlowBodies(adoption::SlowArgs),
}

#[derive(Args, Debug)]
pub struct PipelineArgs {
    /// The GGUF model file.
    #[arg(long, short)]
    model: PathBuf,
    /// Number of stage processes.
    #[arg(long, default_value_t = 2)]
    stages: u32,
    /// Tokens generated per decode run.
    #[arg(short = 'n', long, default_value_t = 128)]
    tokens: usize,
    /// Alternating decode rounds.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Impairment of every stage's outgoing packets, e.g. "delay=3ms,jitter=2ms,loss=1%".
    #[arg(long, default_value = "")]
    impair: shoal_net::Impairment,
    /// Prefill chunk size C.
    #[arg(long, default_value_t = 128)]
    chunk: u32,
    /// Prompt length for the time-to-first-token measurement.
    #[arg(long, default_value_t = 1000)]
    prompt_tokens: usize,
    /// The stages' keep-alive (`shoal serve --keepalive`): auto, on or off.
    #[arg(long, default_value = "auto")]
    keepalive: String,
}

#[derive(Args, Debug)]
pub struct SplitArgs {
    /// The GGUF model file.
    #[arg(long, short)]
    model: PathBuf,
    /// Number of stages of the split run.
    #[arg(long, default_value_t = 2)]
    stages: u32,
    /// Tokens generated per run.
    #[arg(short = 'n', long, default_value_t = 128)]
    tokens: usize,
    /// Alternating rounds (each runs unsplit once and split once).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// CPU threads per stage (and for the unsplit run).
    #[arg(long, default_value_t = 1)]
    threads: u32,
    /// Prefill chunk size C.
    #[arg(long, default_value_t = 128)]
    chunk: u32,
    /// Where shard files are cached [default: ~/.cache/shoal/shards].
    #[arg(long)]
    cache: Option<PathBuf>,
}

/// The part of `shoal run --json` a benchmark reads.
#[derive(Deserialize)]
struct RunOutput {
    tokens: Vec<i32>,
    tok_per_s: f64,
    logits_digest: String,
    stage_ms: Vec<f64>,
    peak_rss_bytes: Option<u64>,
}

pub fn bench(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Split(a) => split(a),
        BenchCommand::Pipeline(a) => pipeline(a),
        BenchCommand::Reconnect(a) => reconnect::reconnect(a),
        BenchCommand::Faults(a) => faults::faults(a),
        BenchCommand::Plan(a) => plan::plan(a),
        BenchCommand::Cluster(a) => cluster::cluster(a),
        BenchCommand::Adoption(a) => adoption::adoption(a),
        BenchCommand::Flood(a) => adoption::flood(a),
        BenchCommand::ForgeWelcome(a) => adoption::forge_welcome(a),
        BenchCommand::SlowBodies(a) => adoption::slow_bodies(a),
        BenchCommand::Keepalive(a) => keepalive::keepalive(a),
        BenchCommand::LivePlan(a) => live::live_plan(a),
        BenchCommand::Load(a) => node::load(a),
        BenchCommand::Replace(a) => node::replace(a),
        BenchCommand::Serve(a) => serve::serve(a),
        BenchCommand::Soak(a) => soak::soak(a),
        BenchCommand::Zoo(a) => zoo::zoo(a),
        BenchCommand::Speculative(a) => speculative::speculative(a),
    }
}

pub use shoal::stats::{even_split, median};

fn split(a: SplitArgs) -> Result<()> {
    let (_, meta) = open_model(&a.model)?;
    let points = even_split(meta.n_layer, a.stages, meta.layer_period())?;
    let cache = ShardCache::new(a.cache.clone().unwrap_or_else(shoal::run::default_cache));
    let ranges = split_ranges(meta.n_layer, &points, meta.layer_period(), meta.arch.name())?;
    let mut files = vec![a.model.clone()];
    for r in ranges {
        files.push(cache.shard_path(&a.model, r)?);
    }
    let exe = shoal::shoal_exe().context("locating the shoal binary")?;
    let run_once = |split: &[u32]| -> Result<RunOutput> {
        // Every run starts with the model's files out of the page cache. Otherwise the
        // history of a file's pages decides the speed: a freshly written copy of the
        // same bytes was measured decoding 15% faster than an old one.
        files.iter().for_each(|f| drop_page_cache(f));
        let mut cmd = Command::new(&exe);
        cmd.arg("run").arg("--model").arg(&a.model).args(["--raw", "--ignore-eos", "--json"]);
        cmd.args(["--prompt", SHORT_PROMPT]);
        cmd.args(["-n", &a.tokens.to_string(), "--threads", &a.threads.to_string(), "--chunk", &a.chunk.to_string()]);
        cmd.arg("--cache").arg(cache.dir());
        if !split.is_empty() {
            cmd.arg("--split").arg(split.iter().map(u32::to_string).collect::<Vec<_>>().join(","));
        }
        json_of(cmd, "run")
    };
    // Build the shards once, outside the measurements.
    run_once(&points).context("warm-up run")?;

    println!(
        "bench split: {} ({}, {} layers), {} stages split at {:?}, {} tokens, {} thread(s) per stage, chunk {}, \
         page cache of the model files dropped before each run",
        a.model.display(),
        meta.arch.name(),
        meta.n_layer,
        a.stages,
        points,
        a.tokens,
        a.threads,
        a.chunk
    );
    println!("{:>6} {:>14} {:>12} {:>7}   split ms per stage", "round", "unsplit tok/s", "split tok/s", "ratio");
    let (mut u, mut s) = (Vec::new(), Vec::new());
    let (mut rss_u, mut rss_s) = (0u64, 0u64);
    let mut identical = true;
    for round in 1..=a.rounds {
        let ru = run_once(&[])?;
        let rs = run_once(&points)?;
        identical &= ru.tokens == rs.tokens && ru.logits_digest == rs.logits_digest;
        let per_stage: Vec<String> = rs.stage_ms.iter().map(|ms| format!("{ms:.0}")).collect();
        println!(
            "{round:>6} {:>14.2} {:>12.2} {:>7.4}   {}",
            ru.tok_per_s,
            rs.tok_per_s,
            rs.tok_per_s / ru.tok_per_s,
            per_stage.join(" / ")
        );
        rss_u = rss_u.max(ru.peak_rss_bytes.unwrap_or(0));
        rss_s = rss_s.max(rs.peak_rss_bytes.unwrap_or(0));
        u.push(ru.tok_per_s);
        s.push(rs.tok_per_s);
    }
    let (mu, ms) = (median(&mut u), median(&mut s));
    println!("{:>6} {mu:>14.2} {ms:>12.2} {:>7.4}", "median", ms / mu);
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "peak RSS: unsplit {:.1} MiB, split {:.1} MiB (all {} stages in one process), ratio {:.3}",
        mib(rss_u),
        mib(rss_s),
        a.stages,
        rss_s as f64 / rss_u.max(1) as f64
    );
    println!("tokens and logits identical: {}", if identical { "yes" } else { "NO" });
    if !identical {
        bail!("the split run's output differs from the unsplit run's");
    }
    Ok(())
}

/// Ask the kernel to forget the file's cached pages (best effort; Linux only).
fn drop_page_cache(path: &std::path::Path) {
    #[cfg(target_os = "linux")]
    if let Ok(f) = std::fs::File::open(path) {
        let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = path;
}

/// The part of `shoal run --json` / `shoal generate --json` the pipeline bench reads.
#[derive(Deserialize)]
pub(crate) struct GenOutput {
    pub tokens: Vec<i32>,
    pub tok_per_s: f64,
    pub prefill_s: f64,
    pub prompt_tokens: usize,
    pub logits_digest: String,
    #[serde(default)]
    pub decode_steps: u64,
    #[serde(default)]
    pub drafted: u64,
    #[serde(default)]
    pub accepted: u64,
}

/// Stage processes killed when the bench ends.
struct Children(Vec<std::process::Child>);
impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Stage processes of one model split on loopback, with their placement file and keys.
pub(crate) struct LoopbackPipeline {
    /// The stage processes (killed on drop, before their files go).
    children: Children,
    /// Keys and the placement file (removed on drop).
    dir: tempfile::TempDir,
    placement: PathBuf,
}

impl LoopbackPipeline {
    /// Start one `shoal serve --placement` process per stage of `model` split at
    /// `points`, each with `serve_args` added, and wait until all serve.
    pub(crate) fn start(
        model: &std::path::Path,
        points: &[u32],
        chunk: u32,
        context: usize,
        serve_args: &[&str],
    ) -> Result<LoopbackPipeline> {
        let (_, meta) = open_model(model)?;
        let exe = shoal::shoal_exe().context("locating the shoal binary")?;
        let dir = tempfile::tempdir()?;
        let key = |name: &str| -> Result<String> {
            let out = Command::new(&exe).args(["key", "--data-dir"]).arg(dir.path().join(name)).output()?;
            Ok(String::from_utf8(out.stdout)?.trim().to_string())
        };
        let mut bounds = vec![0];
        bounds.extend(points);
        bounds.push(meta.n_layer);
        let mut toml = format!(
            "model = {:?}\nchunk = {chunk}\ncontext = {context}\nsessions = 1\nclients = [\"{}\"]\n",
            std::fs::canonicalize(model)?,
            key("client")?
        );
        for i in 0..bounds.len() - 1 {
            let port = std::net::UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port();
            toml += &format!(
                "[[stage]]\nnode = \"{}\"\naddr = \"127.0.0.1:{port}\"\nlayers = [{}, {}]\n",
                key(&format!("node{i}"))?,
                bounds[i],
                bounds[i + 1]
            );
        }
        let placement = dir.path().join("placement.toml");
        std::fs::write(&placement, toml)?;
        // Stage processes: the page cache of their shards dropped first, like the unsplit runs.
        let shard_cache = ShardCache::new(shoal::run::default_cache());
        for r in split_ranges(meta.n_layer, points, meta.layer_period(), meta.arch.name())? {
            drop_page_cache(&shard_cache.shard_path(model, r)?);
        }
        let mut children = Children(Vec::new());
        for i in 0..bounds.len() - 1 {
            let mut c = Command::new(&exe);
            c.arg("serve")
                .args(if serve_args.contains(&"--threads") { &[][..] } else { &["--threads", "1"][..] })
                .args(serve_args)
                .arg("--placement")
                .arg(&placement)
                .arg("--data-dir")
                .arg(dir.path().join(format!("node{i}")));
            let (child, _) = crate::lab::spawn_ready(&mut c, &format!("stage {i}"))?;
            children.0.push(child);
        }
        Ok(LoopbackPipeline { dir, placement, children })
    }

    /// The client's data directory.
    pub(crate) fn client(&self) -> PathBuf {
        self.dir.path().join("client")
    }

    /// A greedy generation of `n` tokens (EOS ignored) through the pipeline.
    pub(crate) fn generate(&self, prompt: &str, n: usize) -> Result<GenOutput> {
        self.generate_with(prompt, n, &[])
    }

    /// [`LoopbackPipeline::generate`] with more `shoal generate` flags.
    pub(crate) fn generate_with(&self, prompt: &str, n: usize, extra: &[&str]) -> Result<GenOutput> {
        let exe = shoal::shoal_exe().context("locating the shoal binary")?;
        let mut cmd = Command::new(exe);
        cmd.args(["generate", "--placement"]).arg(&self.placement).arg("--data-dir").arg(self.client());
        cmd.args(["--raw", "--ignore-eos", "--json", "--prompt", prompt, "-n", &n.to_string()]);
        cmd.args(extra);
        json_of(cmd, "generate")
    }

    /// CPU time (user + system) the stage processes have used so far, seconds.
    pub(crate) fn cpu_seconds(&self) -> f64 {
        self.children.0.iter().map(|c| process_cpu_seconds(c.id())).sum()
    }
}

/// A UDP port `p` on 127.0.0.1 with `p + 1` free too, for a written placement's two
/// stages (`shoal plan --stage-port`): fixed ports would collide with another
/// pipeline on the same machine.
pub(crate) fn free_port_pair() -> Result<u16> {
    for _ in 0..100 {
        let a = std::net::UdpSocket::bind("127.0.0.1:0")?;
        let p = a.local_addr()?.port();
        if p < u16::MAX && std::net::UdpSocket::bind(("127.0.0.1", p + 1)).is_ok() {
            return Ok(p);
        }
    }
    bail!("no two adjacent free UDP ports on 127.0.0.1")
}

/// CPU time of process `pid`, seconds (Linux: /proc; 0 elsewhere).
fn process_cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // Fields after the command name (which may hold spaces, inside parentheses).
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { return 0.0 };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let ticks: f64 = fields.get(11..13).map_or(0.0, |f| f.iter().filter_map(|x| x.parse::<f64>().ok()).sum());
    // Linux reports them in USER_HZ, 100 on every platform Linux supports today.
    ticks / 100.0
}

fn pipeline(a: PipelineArgs) -> Result<()> {
    let (_, meta) = open_model(&a.model)?;
    let points = even_split(meta.n_layer, a.stages, meta.layer_period())?;
    let exe = shoal::shoal_exe().context("locating the shoal binary")?;
    let impair = format!("{:?}", a.impair);
    let impair_arg = if a.impair.is_none() { String::new() } else { impair_spec(&a.impair) };
    let context = (a.prompt_tokens + a.tokens + 64).max(2048);
    let lp = LoopbackPipeline::start(
        &a.model,
        &points,
        a.chunk,
        context,
        &["--impair", &impair_arg, "--keepalive", &a.keepalive],
    )?;
    let placement = lp.placement.clone();
    let long_prompt = {
        let vocab = shoal_engine::Vocab::load(&a.model)?;
        let unit = "The lighthouse keeper climbed the stairs each evening, trimmed the wick, wound the clock and watched the sea. ";
        let mut text = String::new();
        while vocab.tokenize(&text, false).len() < a.prompt_tokens {
            text.push_str(unit);
        }
        text
    };
    let unsplit = |prompt: &str, n: usize, chunk: u32| -> Result<GenOutput> {
        drop_page_cache(&a.model);
        let mut cmd = Command::new(&exe);
        cmd.arg("run").arg("--model").arg(&a.model).args(["--raw", "--ignore-eos", "--json", "--prompt", prompt]);
        cmd.args(["--threads", "1"]);
        cmd.args(["-n", &n.to_string(), "--chunk", &chunk.to_string()]);
        cmd.args(["--ctx", &(a.prompt_tokens + a.tokens + 64).max(2048).to_string()]);
        json_of(cmd, "run")
    };
    let piped = |prompt: &str, n: usize| lp.generate(prompt, n);
    piped(SHORT_PROMPT, 8).context("warm-up")?;

    println!(
        "bench pipeline: {} ({}, {} layers), {} stage processes split at {:?} on loopback, {} tokens, 1 thread per stage, chunk {}{}",
        a.model.display(),
        meta.arch.name(),
        meta.n_layer,
        a.stages,
        points,
        a.tokens,
        a.chunk,
        if a.impair.is_none() { String::new() } else { format!(", impairment on every hop: {impair}") }
    );
    println!("{:>6} {:>14} {:>15} {:>7}", "round", "unsplit tok/s", "pipeline tok/s", "ratio");
    let (mut u, mut p) = (Vec::new(), Vec::new());
    let mut identical = true;
    for round in 1..=a.rounds {
        let ru = unsplit(SHORT_PROMPT, a.tokens, a.chunk)?;
        let rp = piped(SHORT_PROMPT, a.tokens)?;
        identical &= ru.tokens == rp.tokens && ru.logits_digest == rp.logits_digest;
        println!("{round:>6} {:>14.2} {:>15.2} {:>7.4}", ru.tok_per_s, rp.tok_per_s, rp.tok_per_s / ru.tok_per_s);
        u.push(ru.tok_per_s);
        p.push(rp.tok_per_s);
    }
    let (mu, mp) = (median(&mut u), median(&mut p));
    println!("{:>6} {mu:>14.2} {mp:>15.2} {:>7.4}", "median", mp / mu);
    let overhead_ms = 1000.0 / mp - 1000.0 / mu;
    let loop_ms = a.stages as f64 * a.impair.delay.as_secs_f64() * 1000.0;
    println!(
        "per-token overhead: {overhead_ms:.2} ms (pipeline minus unsplit ms/token); one-way delays on a token's loop: {loop_ms:.2} ms ({} hops); target ≤ {:.2} ms",
        a.stages,
        1.25 * loop_ms + 0.5
    );
    probe_frames(&placement, &lp.client(), meta.n_embd)?;
    let tu = unsplit(&long_prompt, 1, a.chunk)?;
    let tp = piped(&long_prompt, 1)?;
    let t512 = unsplit(&long_prompt, 1, 512)?;
    println!(
        "time to first token, {}-token prompt: unsplit {:.3} s (chunk {}), pipeline {:.3} s, ratio {:.3}; unsplit at chunk 512: {:.3} s",
        tu.prompt_tokens,
        tu.prefill_s,
        a.chunk,
        tp.prefill_s,
        tp.prefill_s / tu.prefill_s,
        t512.prefill_s
    );
    identical &= tu.tokens == tp.tokens && tu.logits_digest == tp.logits_digest;
    print_hop_latencies(&placement, &lp.client())?;
    println!("tokens and logits identical: {}", if identical { "yes" } else { "NO" });
    if !identical {
        bail!("the pipeline's output differs from the unsplit run's");
    }
    Ok(())
}

/// Frames of 32 KB (14 tokens of SmolLM2's 576 floats; generally a 32 KB prompt) on
/// every hop: a generation of one token from a prompt that is a single such chunk, 40
/// times, so the latency table has that size class beside the decode frames.
fn probe_frames(placement: &std::path::Path, client: &std::path::Path, n_embd: u32) -> Result<()> {
    use shoal_pipeline::{GenerateRequest, Placement};
    let placement = Placement::load(placement)?;
    let identity = std::sync::Arc::new(shoal_net::Identity::load_or_create(client)?);
    let tokens = ((32 << 10) / (4 * n_embd as usize)).clamp(1, placement.chunk as usize);
    let req = GenerateRequest {
        prompt: (100..100 + tokens as i32).collect(),
        max_new: 1,
        stop: Vec::new(),
        sampling: serde_json::json!({}),
        resume: Vec::new(),
        speculative: None,
        tag: None,
    };
    shoal::pipeline::runtime()?.block_on(async {
        let node = shoal::pipeline::client_node(&placement, identity)?;
        for _ in 0..40 {
            shoal_pipeline::generate(&node, &placement.stages[0], &req, |_, _| {}).await?;
        }
        node.close();
        anyhow::Ok(())
    })
}

/// Ask every stage for the latency of the frames it received, and print them by hop.
fn print_hop_latencies(placement: &std::path::Path, client: &std::path::Path) -> Result<()> {
    let mut cmd = Command::new(shoal::shoal_exe()?);
    cmd.args(["status", "--json", "--placement"]).arg(placement).arg("--data-dir").arg(client);
    let nodes: Vec<shoal_pipeline::NodeStatus> = json_of(cmd, "status")?;
    println!("per-hop frame latency (sender's protocol core to receiver's: queues, QUIC and wire, no compute):");
    println!(
        "{:>6}  {:<16} {:>7} {:>11} {:>8} {:>8} {:>8}",
        "hop", "frames", "count", "mean bytes", "p50 ms", "p99 ms", "max ms"
    );
    let n = nodes.len();
    for (i, st) in nodes.iter().enumerate() {
        for h in &st.hop_in {
            let ms = |us: u64| us as f64 / 1000.0;
            println!(
                "{:>6}  {:<16} {:>7} {:>11} {:>8.3} {:>8.3} {:>8.3}",
                format!("{}→{i}", (i + n - 1) % n),
                h.class,
                h.frames,
                h.mean_bytes,
                ms(h.p50_us),
                ms(h.p99_us),
                ms(h.max_us)
            );
        }
    }
    for bytes in [2304, 32256] {
        for gap_ms in [0, 10] {
            let (p50, p99) = quinn_alone(bytes, std::time::Duration::from_millis(gap_ms))?;
            let what = if gap_ms == 0 { "back to back" } else { "idle 10 ms" };
            println!("{:>6}  {:<16} {:>7} {:>11} {:>8.3} {:>8.3}", "quinn", what, 360, bytes, p50, p99);
        }
    }
    println!("(quinn: the same frames between two bare QUIC endpoints, sent back to back, or after the receiver idled 10 ms as a stage does between tokens)");
    println!("targets (loopback, no impairment): p50 ≤ 0.10 ms for 2.3 KB frames, ≤ 0.20 ms for 32 KB frames");
    match shoal_pipeline::TokenBreakdown::of(&nodes) {
        Some(b) => {
            for line in b.lines() {
                println!("{line}");
            }
            println!(
                "compute {:.1}% of a step; the rest ({:.1} µs) is protocol, queues and the wire",
                100.0 * b.compute_us() / b.interval_us,
                b.interval_us - b.compute_us()
            );
        }
        None => println!("(no decode step timed at the coordinator)"),
    }
    Ok(())
}

/// The floor under the pipeline's hop latency on this machine: two threads, each with
/// its own single-threaded runtime and endpoint (like two processes); one sends a
/// `bytes`-long message stamped with its clock, the other measures its age on arrival
/// (as the pipeline does) and answers with one byte, 400 times. Between messages the
/// sender waits `gap`, during which the receiver idles as a stage does while the
/// previous one computes: waking an idle thread is most of a hop's cost. Returns the
/// one-way p50 and p99 in ms.
pub(crate) fn quinn_alone(bytes: usize, gap: std::time::Duration) -> Result<(f64, f64)> {
    use shoal_net::{alpn, wall_us, Identity, Node, TransportOptions, TrustedKeys};
    use std::sync::Arc;
    const ROUNDS: usize = 400;
    let a = Arc::new(Identity::generate()?);
    let b = Arc::new(Identity::generate()?);
    let trusted = TrustedKeys::new([a.id(), b.id()]);
    let rt = || tokio::runtime::Builder::new_current_thread().enable_all().build();
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    let (b2, t2) = (b.clone(), trusted.clone());
    let receiver = std::thread::spawn(move || -> Result<Vec<f64>> {
        rt()?.block_on(async move {
            let node = Node::bind("127.0.0.1:0".parse()?, b2, t2, &TransportOptions::default())?;
            addr_tx.send(node.local_addr()?)?;
            let acc = node.accept().await.context("no connection")?;
            let mut rx = acc.conn.accept_uni().await?;
            let mut tx = acc.conn.open_uni().await?;
            let mut buf = vec![0u8; bytes];
            let mut ages = Vec::with_capacity(ROUNDS);
            for _ in 0..ROUNDS {
                rx.read_exact(&mut buf).await?;
                let sent = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
                ages.push(f64::from(wall_us().wrapping_sub(sent)) / 1000.0);
                tx.write_all(&[1]).await?;
            }
            // Keep the endpoint until the sender has its last answer and hangs up.
            let _ = rx.read_to_end(1).await;
            anyhow::Ok(ages)
        })
    });
    let addr = addr_rx.recv_timeout(std::time::Duration::from_secs(10))?;
    rt()?.block_on(async move {
        let node = Node::bind("127.0.0.1:0".parse()?, a, trusted, &TransportOptions::default())?;
        let conn = node.connect(addr, b.id(), alpn::PIPELINE).await?;
        let mut tx = conn.open_uni().await?;
        let mut rx = None;
        let mut buf = vec![7u8; bytes];
        let mut ack = [0u8; 1];
        for _ in 0..ROUNDS {
            tokio::time::sleep(gap).await;
            buf[..4].copy_from_slice(&wall_us().to_le_bytes());
            tx.write_all(&buf).await?;
            // The receiver's stream opens with its first answer.
            if rx.is_none() {
                rx = Some(conn.accept_uni().await?);
            }
            rx.as_mut().context("answer stream")?.read_exact(&mut ack).await?;
        }
        // Every answer is in, so the receiver has read everything: hang up.
        node.close();
        node.wait_idle().await;
        anyhow::Ok(())
    })?;
    let mut ages = receiver.join().map_err(|_| anyhow::anyhow!("receiver thread panicked"))??;
    ages.drain(..ROUNDS / 10); // connection warm-up
    ages.sort_by(f64::total_cmp);
    Ok((ages[ages.len() / 2], ages[ages.len() * 99 / 100]))
}

/// The command-line form of an impairment.
pub(crate) fn impair_spec(i: &shoal_net::Impairment) -> String {
    let mut spec = format!("delay={}us,jitter={}us,loss={}", i.delay.as_micros(), i.jitter.as_micros(), i.loss);
    if i.rate_bps > 0 {
        spec += &format!(",rate={}kbit", i.rate_bps / 1000);
    }
    spec
}

/// The decode prompt of both benches.
pub(crate) const SHORT_PROMPT: &str =
    "Once upon a time, in a quiet harbour town, there lived an old lighthouse keeper who";

/// Run a `shoal … --json` child and parse what it prints.
pub(crate) fn json_of<T: serde::de::DeserializeOwned>(mut cmd: Command, what: &str) -> Result<T> {
    let out = cmd.output().with_context(|| format!("running shoal {what}"))?;
    if !out.status.success() {
        bail!("shoal {what} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    serde_json::from_slice(&out.stdout).with_context(|| format!("parsing shoal {what} --json"))
}

#[cfg(test)]
mod tests {
    use super::even_split;

    #[test]
    fn quinn_floor_is_measured() {
        let (p50, p99) = super::quinn_alone(2304, std::time::Duration::ZERO).unwrap();
        assert!(p50 > 0.0 && p50 <= p99 && p99 < 1000.0, "{p50} {p99}");
    }

    #[test]
    fn even_splits_respect_the_period() {
        assert_eq!(even_split(30, 2, 1).unwrap(), vec![15]);
        assert_eq!(even_split(30, 3, 1).unwrap(), vec![10, 20]);
        assert_eq!(even_split(18, 3, 6).unwrap(), vec![6, 12]);
        assert_eq!(even_split(18, 2, 6).unwrap(), vec![12]);
        assert!(even_split(18, 4, 6).is_err());
    }
}
