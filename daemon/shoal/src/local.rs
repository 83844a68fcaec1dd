//! A local cluster: `shoal serve` processes on loopback, each with its own data
//! directory, mDNS on `lo` only, joined with pairing codes. The demo runs Shoal's main
//! job on it; the node benches measure on it, on loopback or with each node on a
//! namespace host of its own ([`Lab::start_on_hosts`]).

use anyhow::{bail, Context, Result};
use shoal_membership::wire::{AdminRequest, AdminResponse};
use shoal_node::api::{NodeRequest, NodeResponse, StageState, StageStatus};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Node processes on loopback, each in its own data directory; killed on drop.
pub struct Lab {
    /// The `shoal` binary the nodes run.
    pub exe: PathBuf,
    /// Holds every node's data directory.
    dir: tempfile::TempDir,
    /// The node processes by name.
    nodes: Vec<(String, Child)>,
    /// The namespace hosts, node `n<k>` on host `k`, when the nodes do not share
    /// loopback (dropped after the nodes are killed: fields drop after `drop`).
    net: Option<shoal_testnet::Net>,
    /// Memory each node offers, MiB: a restarted node offers the same.
    max_memory_mib: u64,
    /// Where `n1` serves its API, if the caller chose.
    api: Option<std::net::SocketAddr>,
    /// Further `shoal serve` arguments of every node.
    extra: Vec<String>,
}

impl Drop for Lab {
    fn drop(&mut self) {
        for (_, c) in &mut self.nodes {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Lab {
    pub fn start(n: usize, max_memory_mib: u64) -> Result<Lab> {
        Lab::start_with_api(n, max_memory_mib, None)
    }

    /// [`Lab::start`], node `n1` (if any) serving the HTTP API at `api` (the others,
    /// and `n1` without one, at a port the system picks).
    pub fn start_with_api(n: usize, max_memory_mib: u64, api: Option<std::net::SocketAddr>) -> Result<Lab> {
        Lab::start_with(n, max_memory_mib, api, &[])
    }

    /// [`Lab::start_with_api`], every node's `shoal serve` also given `extra`
    /// (e.g. `--impair rate=100mbit`).
    pub fn start_with(
        n: usize,
        max_memory_mib: u64,
        api: Option<std::net::SocketAddr>,
        extra: &[String],
    ) -> Result<Lab> {
        Lab::launch(n, max_memory_mib, api, extra, None)
    }

    /// `n` nodes, each on a network namespace host of its own on one bridge, started
    /// as a user would (default ports, mDNS on every interface) but for `--max-memory`,
    /// one thread and `extra`. Needs root and iproute2.
    pub fn start_on_hosts(n: usize, max_memory_mib: u64, extra: &[String]) -> Result<Lab> {
        let net = shoal_testnet::Net::new("lab", n).context("network namespaces (they need root and iproute2)")?;
        Lab::launch(n, max_memory_mib, None, extra, Some(net))
    }

    fn launch(
        n: usize,
        max_memory_mib: u64,
        api: Option<std::net::SocketAddr>,
        extra: &[String],
        net: Option<shoal_testnet::Net>,
    ) -> Result<Lab> {
        let exe = crate::shoal_exe().context("locating the shoal binary")?;
        let mut lab =
            Lab { exe, dir: tempfile::tempdir()?, nodes: Vec::new(), net, max_memory_mib, api, extra: extra.to_vec() };
        for i in 0..n {
            let name = format!("n{i}");
            let child = lab.spawn(i, if i == 0 { "--create-cluster" } else { "--no-create" })?;
            lab.nodes.push((name.clone(), child));
            wait("the node up", 60, || Ok(lab.admin(&name, AdminRequest::Status).ok()))?;
            if i == 0 {
                wait("the cluster", 30, || {
                    Ok(match lab.admin(&name, AdminRequest::Status)? {
                        AdminResponse::Status(s) if s.cluster.is_some() => Some(()),
                        _ => None,
                    })
                })?;
            } else {
                wait("joined", 60, || {
                    let AdminResponse::Code { code, .. } = lab.admin("n0", AdminRequest::Pair)? else {
                        return Ok(None);
                    };
                    Ok(matches!(lab.admin(&name, AdminRequest::Join { code }), Ok(AdminResponse::Ok(_))).then_some(()))
                })?;
            }
        }
        wait("every member", 60, || {
            Ok(match lab.admin("n0", AdminRequest::Status)? {
                AdminResponse::Status(s) if s.members.len() == n => Some(()),
                _ => None,
            })
        })?;
        Ok(lab)
    }

    /// Start node `n<i>`'s `shoal serve` (`create` says whether it makes a cluster);
    /// its log goes to `$SHOAL_BENCH_LOGS/n<i>.log` when set, appended across restarts.
    fn spawn(&self, i: usize, create: &str) -> Result<Child> {
        let name = format!("n{i}");
        let mut serve = self.command(&name);
        serve.arg("serve");
        if self.net.is_none() {
            serve
                .args(["--listen", "127.0.0.1:0", "--join-listen", "127.0.0.1:0", "--mdns-allow", "lo"])
                .arg("--http-listen")
                .arg(self.api.filter(|_| i == 1).map_or("127.0.0.1:0".to_string(), |a| a.to_string()));
        }
        let log = match std::env::var_os("SHOAL_BENCH_LOGS") {
            // Each node's log in that folder (RUST_LOG sets what it holds).
            Some(d) => Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(PathBuf::from(d).join(format!("{name}.log")))?,
            ),
            None => Stdio::null(),
        };
        Ok(serve
            .args(["--name", &name, "--max-memory", &format!("{}M", self.max_memory_mib)])
            // Several nodes share this machine: one thread each, as every bench's
            // unsplit reference run uses.
            .args(["--threads", "1"])
            .args(&self.extra)
            .arg(create)
            .arg("--data-dir")
            .arg(self.dir(&name))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?)
    }

    /// Start node `name` again (after [`Lab::kill`]) from its data directory, as a
    /// machine that rebooted does: it rejoins its cluster and its stages start again.
    pub fn restart(&mut self, name: &str) -> Result<()> {
        if self.nodes.iter().any(|(n, _)| n == name) {
            bail!("{name} still runs");
        }
        let child = self.spawn(host_of(name), "--no-create")?;
        self.nodes.push((name.to_string(), child));
        Ok(())
    }

    /// Stop (`frozen`) or continue node `name`'s process (SIGSTOP/SIGCONT), as a laptop
    /// lid does: its sockets and timers are stale when it wakes.
    pub fn freeze(&self, name: &str, frozen: bool) -> Result<()> {
        let pid = self.pid_of(name).with_context(|| format!("{name} does not run"))?;
        let sig = if frozen { libc::SIGSTOP } else { libc::SIGCONT };
        // SAFETY: kill(2) with a pid this lab spawned and has not reaped.
        if unsafe { libc::kill(pid as libc::pid_t, sig) } != 0 {
            bail!("signalling {name}: {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// The namespace hosts, on a lab of hosts.
    pub fn net(&self) -> Option<&shoal_testnet::Net> {
        self.net.as_ref()
    }

    /// [`Lab::net`], to change it (renumber a host).
    pub fn net_mut(&mut self) -> Option<&mut shoal_testnet::Net> {
        self.net.as_mut()
    }

    pub fn dir(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn identity(&self, name: &str) -> Result<Arc<shoal_net::Identity>> {
        Ok(Arc::new(shoal_net::Identity::load_or_create(&self.dir(name))?))
    }

    /// A command running the `shoal` CLI where node `name` runs (its host, if any).
    pub fn command(&self, name: &str) -> Command {
        match &self.net {
            Some(net) => net.command(host_of(name), &self.exe),
            None => Command::new(&self.exe),
        }
    }

    /// The base URL of node `name`'s HTTP API as another host reaches it: its
    /// namespace host's address on a lab of hosts, else the address it listens on.
    pub fn api_url(&self, name: &str) -> Result<String> {
        let listen: std::net::SocketAddr = std::fs::read_to_string(self.dir(name).join("http"))?.trim().parse()?;
        Ok(match &self.net {
            Some(net) => format!("http://{}:{}", net.addr(host_of(name)), listen.port()),
            None => format!("http://{listen}"),
        })
    }

    /// Run `f` where node `name` runs: its local addresses are then the node's (on a
    /// lab of hosts, a thread inside its namespace; the threads `f` starts are there
    /// too).
    pub fn near<T: Send>(&self, name: &str, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
        match &self.net {
            Some(net) => net.within(host_of(name), f)?,
            None => f(),
        }
    }

    pub fn admin(&self, name: &str, req: AdminRequest) -> Result<AdminResponse> {
        let (dir, id) = (self.dir(name), self.identity(name)?);
        self.near(name, || Ok(crate::pipeline::runtime()?.block_on(shoal_membership::node::admin(&dir, id, &req))?))
    }

    pub fn ask(&self, name: &str, req: NodeRequest) -> Result<NodeResponse> {
        let (dir, id) = (self.dir(name), self.identity(name)?);
        match self.near(name, || Ok(crate::pipeline::runtime()?.block_on(shoal_node::api::request(&dir, id, &req))?))? {
            NodeResponse::Error(e) => bail!("{e}"),
            r => Ok(r),
        }
    }

    pub fn names(&self) -> Vec<String> {
        self.nodes.iter().map(|(n, _)| n.clone()).collect()
    }

    pub fn id_of(&self, name: &str) -> Result<String> {
        Ok(self.identity(name)?.id().to_string())
    }

    pub fn pid_of(&self, name: &str) -> Option<u32> {
        self.nodes.iter().find(|(n, _)| n == name).map(|(_, c)| c.id())
    }

    pub fn kill(&mut self, name: &str) {
        if let Some(i) = self.nodes.iter().position(|(n, _)| n == name) {
            let (_, mut c) = self.nodes.remove(i);
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The committed placement of `model` (JSON), once it has stages.
    pub fn placement(&self, model: &str) -> Result<Option<shoal_types::ModelPlacement>> {
        Ok(match self.ask("n0", NodeRequest::ModelPlan { model: model.into() })? {
            NodeResponse::Placement { placement, committed: true, .. }
                if !placement.stages.is_empty() || placement.error.is_some() =>
            {
                Some(placement)
            }
            _ => None,
        })
    }

    /// Each stage's status once every stage of the placement (of a generation other
    /// than `not`) runs.
    pub fn running(&self, model: &str, not: u64) -> Result<(shoal_types::ModelPlacement, Vec<(String, StageStatus)>)> {
        wait("every stage running", 600, || {
            let Some(p) = self.placement(model)? else { return Ok(None) };
            if let Some(e) = &p.error {
                return Err(Fatal(format!("the model cannot be placed: {e}")).into());
            }
            if p.generation == not {
                return Ok(None);
            }
            let mut out = Vec::new();
            for s in &p.stages {
                let Some(name) = self.names().into_iter().find(|n| self.id_of(n).ok() == Some(s.node.to_string()))
                else {
                    return Ok(None);
                };
                let NodeResponse::Stages(st) = self.ask(&name, NodeRequest::Stages)? else { return Ok(None) };
                let Some(st) = st.into_iter().find(|st| st.generation == p.generation) else { return Ok(None) };
                if let StageState::Failed(why) = &st.state {
                    bail!("the stage on {name} failed: {why}");
                }
                if st.state != StageState::Running {
                    return Ok(None);
                }
                out.push((name, st));
            }
            Ok(Some((p.clone(), out)))
        })
    }
}

/// The host of node `n<k>`: `k`.
fn host_of(name: &str) -> usize {
    // Invariant: every node of a lab is named `n<k>` by `Lab::launch`.
    name.strip_prefix('n').and_then(|k| k.parse().ok()).expect("a lab node's name")
}

/// An error that waiting longer cannot cure (a model that does not fit).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Fatal(pub String);

/// Poll `f` until it returns `Some`, at most `secs` (errors are retried, the last one reported).
pub fn wait<T>(what: &str, secs: u64, mut f: impl FnMut() -> Result<Option<T>>) -> Result<T> {
    let t0 = Instant::now();
    let mut last = String::new();
    loop {
        match f() {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) if e.downcast_ref::<Fatal>().is_some() => return Err(e),
            Err(e) => last = format!(" (last: {e:#})"),
        }
        if t0.elapsed() > Duration::from_secs(secs) {
            bail!("{what}: not within {secs} s{last}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Generations the demo's model runs at once (each with its own KV cache on every
/// stage; 512 positions each fit the nodes' 90 MiB twice).
const DEMO_SESSIONS: u32 = 2;

/// `shoal demo`: a local cluster of three nodes on loopback, each offering little
/// memory; the test model is added on one, loaded (the leader splits it over the
/// three, the other two receive only their shards) and asked `prompt` through another
/// node's HTTP API (OpenAI's chat route, streamed); then it serves until Ctrl-C
/// (or stops at once with `once`).
pub fn demo(prompt: &str, max_tokens: usize, once: bool, mut phases: Vec<(String, f64)>) -> Result<()> {
    let model = shoal_gguf::models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if !model.exists() {
        bail!("{} is missing: run scripts/setup.sh --demo first (scripts/demo.sh does)", model.display());
    }
    let name = "SmolLM2-135M-Instruct.Q4_1.gguf";
    eprintln!("[demo] starting three nodes on loopback, each offering 90 MiB to models …");
    let t0 = Instant::now();
    // The API on Ollama's port when it is free (tools find it there), else any port.
    let default = std::net::SocketAddr::from(([127, 0, 0, 1], shoal_api::DEFAULT_PORT));
    let api = std::net::TcpListener::bind(default).is_ok().then_some(default);
    let lab = Lab::start_with_api(3, 90, api)?;
    phases.push(("cluster formed".into(), t0.elapsed().as_secs_f64()));
    eprintln!(
        "[demo] cluster formed in {:.1} s (discovered over mDNS, joined with pairing codes)",
        t0.elapsed().as_secs_f64()
    );
    lab.ask("n0", NodeRequest::ModelAdd { path: model.display().to_string(), name: None })?;
    eprintln!("[demo] added {name} on n0 (the only node with the file); loading it from n2 …");
    let t1 = Instant::now();
    // Two sessions: two clients (a chat page and a curl) are answered side by side
    // rather than one after the other.
    lab.ask(
        "n2",
        NodeRequest::ModelLoad { model: name.into(), context: 512, sessions: DEMO_SESSIONS, exclude: vec![] },
    )?;
    let (placement, stages) = lab.running(name, 0)?;
    phases.push(("model placed and loaded".into(), t1.elapsed().as_secs_f64()));
    eprintln!(
        "[demo] the leader placed it in {} stages, {DEMO_SESSIONS} sessions at once; every stage runs {:.1} s after the load:",
        placement.stages.len(),
        t1.elapsed().as_secs_f64()
    );
    for (node, st) in &stages {
        eprintln!(
            "[demo]   {node}: layers {:<7} shard {} ({:.1} MB received)",
            st.layers.to_string(),
            st.shard_origin.as_deref().unwrap_or("?"),
            st.shard_bytes_received as f64 / 1e6
        );
    }
    let http = lab.dir("n1").join(shoal_node::http::HTTP_FILE);
    let api = std::fs::read_to_string(&http).with_context(|| format!("n1 serves no API ({})", http.display()))?;
    let api = api.trim();
    eprintln!("[demo] API: http://{api}  (OpenAI routes under /v1, Ollama's under /api)");
    eprintln!("[demo] asking n1 through it: {prompt}");
    let first_token = chat_stream(api, name, prompt, max_tokens)?;
    phases.push(("first token".into(), first_token.as_secs_f64()));
    eprintln!("[demo] what each phase took:");
    for (phase, secs) in &phases {
        eprintln!("[demo]   {phase:<24} {secs:>7.1} s");
    }
    if once {
        eprintln!("[demo] stopping the nodes");
        return Ok(());
    }
    eprintln!(
        "[demo] serving until Ctrl-C; try:\n  curl http://{api}/v1/chat/completions -H 'content-type: application/json' \\\n    \
         -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'"
    );
    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(crate::pipeline::shutdown_signal());
    eprintln!("[demo] stopping the nodes");
    Ok(())
}

/// Ask `prompt` of `model` at the API `api` (OpenAI's chat route, streamed): the
/// answer goes to stdout as it comes, then the speed to stderr. Returns the time from
/// the request to its first piece of text.
fn chat_stream(api: &str, model: &str, prompt: &str, max_tokens: usize) -> Result<Duration> {
    use std::io::{BufRead, Write};
    let body = serde_json::json!({"model": model, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let t0 = Instant::now();
    let mut r = agent
        .post(&format!("http://{api}/v1/chat/completions"))
        .header("content-type", "application/json")
        .send(body.to_string())
        .context("asking the API")?;
    if r.status() != 200 {
        bail!("the API answered {}: {}", r.status(), r.body_mut().read_to_string().unwrap_or_default());
    }
    let mut out = std::io::stdout().lock();
    let mut completion = 0;
    let mut first_text = None;
    for line in std::io::BufReader::new(r.body_mut().as_reader()).lines() {
        let Some(data) = line?.strip_prefix("data: ").map(str::to_string) else { continue };
        if data == "[DONE]" {
            break;
        }
        let v: serde_json::Value = serde_json::from_str(&data).context("a malformed chunk")?;
        if let Some(e) = v.get("error") {
            bail!("the generation failed: {e}");
        }
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            first_text.get_or_insert_with(|| t0.elapsed());
            write!(out, "{t}")?;
            out.flush()?;
        }
        completion = v["usage"]["completion_tokens"].as_u64().unwrap_or(completion);
    }
    writeln!(out)?;
    eprintln!("[demo] {completion} tokens in {:.1} s, through n1's API", t0.elapsed().as_secs_f64());
    first_text.context("the answer held no text")
}
