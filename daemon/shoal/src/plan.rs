//! `shoal plan`: the planner's answer for a model on a described cluster (a profile
//! file: what-if), on the live cluster the local node belongs to, or on this machine
//! alone; or its prediction for a given placement. On the live cluster it can write
//! the plan as a placement file for `shoal serve --placement`. The planner itself is
//! pure (`shoal-planner`); this file reads files, the machine and the local node.

use anyhow::{bail, Context, Result};
use clap::Args;
use shoal_engine::open_model;
use shoal_membership::node;
use shoal_membership::wire::{AdminRequest, AdminResponse, ClusterStatus, MemberStatus};
use shoal_planner::plan::parse_stages;
use shoal_planner::{predict, Cluster, Device, Link, ModelProfile, ModelSpec, Options, Plan, Profile};
use shoal_types::{fmt_size, NodeId};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// The GGUF model (or give it in the profile's [model]).
    #[arg(long, short)]
    model: Option<PathBuf>,
    /// A cluster profile (TOML: [model], [[device]], [[link]]; see docs/planning.md). Without
    /// it, Shoal plans on the live cluster of the local node (`shoal serve` running
    /// with --data-dir), or on this machine alone when there is none.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// The local node's data directory, to find the live cluster [default: $SHOAL_DATA_DIR, else ~/.local/share/shoal, else the service's /var/lib/shoal].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Write the chosen placement to this file, for `shoal serve --placement` on each
    /// node and `shoal generate --placement` here (live cluster only: it needs node ids).
    #[arg(long)]
    write_placement: Option<PathBuf>,
    /// Before planning on the live cluster, measure what is not measured yet: each live
    /// member without a profile for this model calibrates (it needs the model at the
    /// same path) and each member without link measurements probes its links. On by
    /// default with --write-placement (placing a model), off otherwise.
    #[arg(long, overrides_with = "no_calibrate")]
    calibrate: bool,
    /// Plan with what is measured so far (estimates elsewhere), even when placing.
    #[arg(long)]
    no_calibrate: bool,
    /// Port the stage processes of a written placement listen on.
    #[arg(long, default_value_t = 7101)]
    stage_port: u16,
    /// Predict this placement instead of choosing one: "0-16:host/dev,16-30:host2/dev".
    #[arg(long)]
    placement: Option<String>,
    /// Positions per session [default: the profile's, else 4096].
    #[arg(long)]
    context: Option<u32>,
    /// Sessions held at once.
    #[arg(long, default_value_t = 1)]
    sessions: u32,
    /// Prefill chunk size C.
    #[arg(long, default_value_t = 128)]
    chunk: u32,
    /// Prompt length of the time-to-first-token prediction.
    #[arg(long, default_value_t = 1000)]
    prompt_tokens: u32,
    /// Memory kept free on every device, MiB.
    #[arg(long, default_value_t = shoal_planner::plan::DEFAULT_RESERVE >> 20)]
    reserve_mib: u64,
    /// Layers that must go on a device, e.g. "0-20:desktop/gpu0" (repeatable or comma-separated).
    #[arg(long)]
    pin: Vec<String>,
    /// A device id or host name not to use (repeatable).
    #[arg(long)]
    exclude: Vec<String>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Where the plan's devices came from.
enum Source {
    Profile,
    ThisMachine,
    /// The live cluster, as the local node sees it, and what was measured.
    Live(Box<ClusterStatus>, Measured),
}

pub fn plan(a: PlanArgs) -> Result<()> {
    let (model, cluster, profile_context, source) = inputs(&a)?;
    let mut opts = Options {
        prompt_tokens: a.prompt_tokens,
        reserve_bytes: a.reserve_mib << 20,
        exclude: a.exclude.clone(),
        ..Options::default()
    };
    opts.sizing.context = a.context.or(profile_context).unwrap_or(opts.sizing.context);
    opts.sizing.sessions = a.sessions.max(1);
    opts.sizing.chunk = a.chunk.max(1);
    for p in &a.pin {
        opts.pins.extend(parse_stages(p)?);
    }
    let mut result = match &a.placement {
        Some(s) => predict(&model, &cluster, &parse_stages(s)?, &opts)?,
        None => shoal_planner::plan(&model, &cluster, &opts)?,
    };
    match &source {
        Source::ThisMachine => result.explanation.insert(
            0,
            "Planned for this machine alone, its speed estimated from an assumed memory bandwidth (no cluster node runs here; pass --profile to plan a described cluster).".into(),
        ),
        Source::Live(st, measured) => {
            let devices = if measured.hosts.is_empty() {
                "speeds estimated from an assumed memory bandwidth (`--calibrate`, or `shoal calibrate --model …` on each node, measures them)".to_string()
            } else {
                format!(
                    "speeds measured on {}{}",
                    measured.hosts.join(", "),
                    if measured.hosts.len() < st.members.len() { ", estimated on the others" } else { "" }
                )
            };
            let links = if measured.links == 0 {
                "links assumed (nothing measured)".to_string()
            } else {
                format!("{} link(s) measured", measured.links)
            };
            result.explanation.insert(
                0,
                format!(
                    "Planned on the live cluster ({} members, CPU memory as advertised); {devices}; {links}.",
                    st.members.len()
                ),
            );
            for line in measured.notes.iter().rev() {
                result.explanation.insert(1, line.clone());
            }
        }
        Source::Profile => {}
    }
    if let Some(path) = &a.write_placement {
        let Source::Live(st, _) = &source else {
            bail!("--write-placement needs the live cluster (node ids and addresses); a profile or this machine alone has none");
        };
        let Some(model_path) = &a.model else {
            bail!("--write-placement needs --model (the path every node has a copy at)")
        };
        if !result.fits {
            bail!("the placement does not fit; not writing it");
        }
        write_placement(path, model_path, &result, st, &opts, a.stage_port)?;
        result.explanation.push(format!("Placement written to {}.", path.display()));
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        print_plan(&result);
    }
    Ok(())
}

/// The model's sizes and the cluster: from the profile, else the live cluster, else
/// this machine.
fn inputs(a: &PlanArgs) -> Result<(ModelProfile, Cluster, Option<u32>, Source)> {
    let from_gguf = |p: &std::path::Path| -> Result<ModelProfile> {
        let (_, meta) = open_model(p)?;
        Ok(ModelProfile::from_meta(&meta))
    };
    match &a.profile {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            let profile = Profile::parse(&text).with_context(|| path.display().to_string())?;
            let model = match (&a.model, profile.model) {
                (Some(m), _) => from_gguf(m)?,
                (None, ModelSpec::Given(m)) => m,
                (None, ModelSpec::Path(p)) => {
                    // Relative to the profile file.
                    let base = path.parent().unwrap_or(std::path::Path::new("."));
                    from_gguf(&base.join(p))?
                }
            };
            if profile.cluster.devices.is_empty() {
                bail!("{} lists no [[device]]", path.display());
            }
            Ok((model, profile.cluster, profile.context, Source::Profile))
        }
        None => {
            let Some(m) = &a.model else { bail!("give --model (or a --profile with a [model])") };
            let model = from_gguf(m)?;
            match live_cluster(&a.data_dir) {
                Some(mut live) => {
                    let mut notes = Vec::new();
                    if a.calibrate || (a.write_placement.is_some() && !a.no_calibrate) {
                        notes = measure_missing(&mut live, &model, m);
                    }
                    let Live { status: st, entries, .. } = live;
                    let (cluster, mut measured) = cluster_of(&st, &entries, &model, m);
                    measured.notes = notes;
                    if cluster.devices.is_empty() {
                        bail!("the local node's cluster reports no member memory yet; try again in a few seconds");
                    }
                    Ok((model, cluster, None, Source::Live(Box::new(st), measured)))
                }
                None => Ok((model.clone(), this_machine(&model), None, Source::ThisMachine)),
            }
        }
    }
}

/// The local node's cluster as it answered.
struct Live {
    /// Its status (members, addresses, liveness).
    status: ClusterStatus,
    /// The measurements in the cluster state: `profile/…` and `links/…` entries.
    entries: BTreeMap<String, serde_json::Value>,
    /// The local node's key (to ask members to measure).
    identity: Arc<shoal_net::Identity>,
    /// The local node's data directory.
    dir: PathBuf,
    /// The runtime the admin requests run on.
    rt: tokio::runtime::Runtime,
}

/// What the live plan's inputs rest on.
#[derive(Default)]
struct Measured {
    /// Hosts whose speed was measured for this model.
    hosts: Vec<String>,
    /// Links between the planned hosts with measurements.
    links: usize,
    /// What measuring before the plan did (or failed to do).
    notes: Vec<String>,
}

/// The status of the local node's cluster, if a node runs here and belongs to one,
/// with the measurements kept in the cluster state.
fn live_cluster(dir: &Option<PathBuf>) -> Option<Live> {
    let dir = crate::pipeline::data_dir(dir);
    // No endpoint file: no node was ever started here (and no key is created for asking).
    if !dir.join(node::ENDPOINT_FILE).exists() {
        return None;
    }
    let identity = Arc::new(shoal_net::Identity::load_or_create(&dir).ok()?);
    let rt = crate::pipeline::runtime().ok()?;
    let status = match ask_local(&rt, &dir, &identity, AdminRequest::Status) {
        Some(AdminResponse::Status(st)) if st.cluster.is_some() => *st,
        _ => return None,
    };
    let entries = measurements(&rt, &dir, &identity);
    Some(Live { status, entries, identity, dir, rt })
}

/// Ask the local node, giving up after 3 s.
fn ask_local(
    rt: &tokio::runtime::Runtime,
    dir: &std::path::Path,
    identity: &Arc<shoal_net::Identity>,
    req: AdminRequest,
) -> Option<AdminResponse> {
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(3), node::admin(dir, identity.clone(), &req)).await })
        .ok()?
        .ok()
}

/// The `profile/` and `links/` entries of the cluster state.
fn measurements(
    rt: &tokio::runtime::Runtime,
    dir: &std::path::Path,
    identity: &Arc<shoal_net::Identity>,
) -> BTreeMap<String, serde_json::Value> {
    let mut all = BTreeMap::new();
    for prefix in ["profile/", node::LinksEntry::KEY_PREFIX] {
        if let Some(AdminResponse::Entries(e)) =
            ask_local(rt, dir, identity, AdminRequest::Entries { prefix: prefix.into() })
        {
            all.extend(e);
        }
    }
    all
}

/// Have every live member measure what the plan lacks: its speed on this model (a
/// quick calibration, all members at once, each on its own machine; not where the
/// model would not fit the member's free memory) and its links to the others (one
/// member at a time, so that probes do not time each other). Then read the
/// measurements again. Returns a line per member that could not measure (the plan goes
/// on with estimates for it).
fn measure_missing(live: &mut Live, model: &ModelProfile, model_path: &std::path::Path) -> Vec<String> {
    // Absolute, but not resolved: the profile is keyed by the file name given here,
    // which a symbolic link's target may not share.
    let path = std::path::absolute(model_path).unwrap_or_else(|_| model_path.to_path_buf());
    let frame_bytes = model.n_embd * 4;
    let model_bytes = model.layer_bytes.iter().sum::<u64>() + model.embed_bytes + model.head_bytes;
    let st = &live.status;
    let alive: Vec<&MemberStatus> =
        st.members.iter().filter(|m| m.state == shoal_membership::Liveness::Alive).collect();
    let mut notes = Vec::new();
    let (mut calibrations, mut probes) = (Vec::new(), Vec::new());
    for m in &alive {
        let Some(addr) = member_addr(st, m) else {
            notes.push(format!("{}: not measured: no known address", m.name));
            continue;
        };
        let key = crate::calibrate::profile_key(&m.node, model_path);
        if !live.entries.contains_key(&key) {
            // Calibrating loads the whole model there; a member it does not fit would
            // swap (or fail) for minutes.
            match m.ram_available {
                Some(free) if free < model_bytes + model_bytes / 10 => notes.push(format!(
                    "{}: not calibrated: the model ({}) does not fit its free memory ({}); its speed is estimated",
                    m.name,
                    fmt_size(model_bytes),
                    fmt_size(free)
                )),
                _ => {
                    let req = AdminRequest::Calibrate {
                        model: path.display().to_string(),
                        tokens: crate::calibrate::DEFAULT_TOKENS,
                        // As many as the member's stages use (its own setting).
                        threads: 0,
                    };
                    calibrations.push((m.name.clone(), m.node, addr, req, key));
                }
            }
        }
        let key = node::LinksEntry::key(&m.node);
        let probed = live
            .entries
            .get(&key)
            .and_then(|v| serde_json::from_value::<node::LinksEntry>(v.clone()).ok())
            .is_some_and(|l| {
                l.frame_bytes == frame_bytes
                    && alive.iter().all(|o| o.node == m.node || l.peers.contains_key(&o.node.to_string()))
            });
        if !probed && alive.len() > 1 {
            probes.push((m.name.clone(), m.node, addr, AdminRequest::ProbeLinks { frame_bytes }, key));
        }
    }
    if calibrations.is_empty() && probes.is_empty() {
        return notes;
    }
    eprintln!(
        "[shoal] measuring before planning: {} calibration(s), {} link probe(s)",
        calibrations.len(),
        probes.len()
    );
    let rt = &live.rt;
    let ask = |(name, id, addr, req, key): (String, NodeId, std::net::SocketAddr, AdminRequest, String)| {
        let identity = live.identity.clone();
        async move {
            let what = if matches!(req, AdminRequest::Calibrate { .. }) { "calibration" } else { "link probe" };
            (name, what, key, node::admin_at(addr, id, identity, &req).await)
        }
    };
    let answers = rt.block_on(async {
        // Calibrations first and together, then the probes one by one, so that no
        // probe times a link next to a busy calibration or another probe.
        let mut answers = Vec::new();
        let mut set = tokio::task::JoinSet::new();
        for job in calibrations {
            set.spawn(ask(job));
        }
        while let Some(done) = set.join_next().await {
            match done {
                Ok(a) => answers.push(a),
                Err(e) => notes.push(format!("a calibration request failed: {e}")),
            }
        }
        for job in probes {
            answers.push(ask(job).await);
        }
        answers
    });
    let before = std::mem::take(&mut live.entries);
    let mut expect = Vec::new();
    for (name, what, key, answer) in answers {
        match answer {
            Ok(AdminResponse::Ok(_)) => expect.push(key),
            Ok(AdminResponse::Error(e)) => notes.push(format!("{name}: {what} failed: {e}")),
            Ok(other) => notes.push(format!("{name}: {what}: unexpected answer {other:?}")),
            Err(e) => notes.push(format!("{name}: {what} failed: {e}")),
        }
    }
    // A measurement is committed when its answer comes; the local node may apply it a
    // heartbeat later. Wait (briefly) until it holds every new value.
    let t0 = std::time::Instant::now();
    loop {
        live.entries = measurements(rt, &live.dir, &live.identity);
        let fresh = |k: &String| live.entries.get(k).is_some_and(|v| before.get(k) != Some(v));
        if expect.iter().all(fresh) || t0.elapsed() > Duration::from_secs(5) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    notes
}

/// Where member `m` is reached (this node's own endpoint for itself).
fn member_addr(st: &ClusterStatus, m: &MemberStatus) -> Option<std::net::SocketAddr> {
    let text = if m.node == st.node { Some(st.addr.as_str()) } else { m.addr.as_deref() };
    let mut addr: std::net::SocketAddr = text?.parse().ok()?;
    if addr.ip().is_unspecified() {
        addr.set_ip(std::net::IpAddr::from([127, 0, 0, 1]));
    }
    Some(addr)
}

/// The live cluster's members as planner devices: each live member's CPU with the
/// RAM it advertises; its speed measured (calibrated for this model file) or else
/// estimated from memory bandwidth; the links between them as the members measured
/// them (the mean of both directions). Host names are member names (made unique with
/// an id prefix when two members share one).
fn cluster_of(
    st: &ClusterStatus,
    entries: &BTreeMap<String, serde_json::Value>,
    model: &ModelProfile,
    model_path: &std::path::Path,
) -> (Cluster, Measured) {
    let mut devices = Vec::new();
    let mut measured = Measured::default();
    for m in &st.members {
        let Some(ram) = m.ram_available else { continue };
        if m.state != shoal_membership::Liveness::Alive {
            continue;
        }
        let mut cpu = Device::estimated_cpu(host_name(st, m), ram, model);
        let key = crate::calibrate::profile_key(&m.node, model_path);
        if let Some(p) =
            entries.get(&key).and_then(|v| serde_json::from_value::<crate::calibrate::MeasuredProfile>(v.clone()).ok())
        {
            cpu.ms_per_layer = p.ms_per_layer;
            cpu.prefill_ms_per_layer_token = Some(p.prefill_ms_per_layer_token);
            cpu.head_ms = p.head_ms;
            cpu.wake_ms = p.wake_ms;
            cpu.keepalive = p.keepalive;
            cpu.estimated = false;
            measured.hosts.push(cpu.host.clone());
        }
        devices.push(cpu);
    }
    let (links, wake) = links_of(st, entries, &devices);
    // Waking a receiver's network thread is the receiver's cost, like its compute's.
    for d in &mut devices {
        d.wake_ms += wake.get(&d.host).copied().unwrap_or(0.0);
    }
    measured.links = links.len();
    measured.hosts.sort();
    (Cluster { devices, links }, measured)
}

/// The measured links between the planned members' hosts, and what waking each adds
/// (`shoal_node::schedule::measured_links`, which the leader plans with too).
fn links_of(
    st: &ClusterStatus,
    entries: &BTreeMap<String, serde_json::Value>,
    devices: &[Device],
) -> (Vec<Link>, BTreeMap<String, f64>) {
    let probes: BTreeMap<NodeId, node::LinksEntry> = st
        .members
        .iter()
        .filter_map(|m| {
            let v = entries.get(&node::LinksEntry::key(&m.node))?;
            Some((m.node, serde_json::from_value(v.clone()).ok()?))
        })
        .collect();
    let hosts: Vec<(NodeId, String)> = st
        .members
        .iter()
        .map(|m| (m.node, host_name(st, m)))
        .filter(|(_, h)| devices.iter().any(|d| d.host == *h))
        .collect();
    shoal_node::schedule::measured_links(&probes, &hosts)
}

/// A member's host name in plans: its name, unless another member has the same one.
fn host_name(st: &ClusterStatus, m: &MemberStatus) -> String {
    if st.members.iter().filter(|o| o.name == m.name).count() > 1 {
        format!("{}-{}", m.name, &m.node.to_string()[..6])
    } else {
        m.name.clone()
    }
}

/// Write `plan` as a placement file: each stage on the member whose host it names,
/// listening on `port` at the address the member is reached at; this node may ask.
fn write_placement(
    path: &std::path::Path,
    model: &std::path::Path,
    plan: &Plan,
    st: &ClusterStatus,
    opts: &Options,
    port: u16,
) -> Result<()> {
    let model = std::fs::canonicalize(model).unwrap_or_else(|_| model.to_path_buf());
    let mut stages = Vec::new();
    for stage in &plan.stages {
        let m = st
            .members
            .iter()
            .find(|m| host_name(st, m) == stage.host)
            .with_context(|| format!("no member named {}", stage.host))?;
        let addr: std::net::SocketAddr = m
            .addr
            .as_deref()
            .with_context(|| format!("no known address for {}", stage.host))?
            .parse()
            .context("member address")?;
        let ip = if addr.ip().is_unspecified() { std::net::IpAddr::from([127, 0, 0, 1]) } else { addr.ip() };
        // Several nodes on one address (a test on one machine) need a port each.
        let mut stage_addr = std::net::SocketAddr::new(ip, port);
        while stages.iter().any(|s: &shoal_pipeline::StagePlace| s.addr == stage_addr) {
            stage_addr.set_port(stage_addr.port() + 1);
        }
        stages.push(shoal_pipeline::StagePlace {
            node: m.node,
            addr: stage_addr,
            layers: shoal_types::LayerRange::new(stage.first, stage.last),
        });
    }
    let placement = shoal_pipeline::Placement {
        model,
        context: opts.sizing.context,
        chunk: opts.sizing.chunk,
        sessions: opts.sizing.sessions,
        stages,
        clients: vec![st.node],
    };
    let devices: Vec<&str> = plan.stages.iter().map(|s| s.device.as_str()).collect();
    let text = format!(
        "# Written by `shoal plan`: {:.1} tok/s predicted on {}. Every node needs the model at this path.\n{}",
        plan.predicted_tok_s,
        devices.join(", "),
        placement.to_toml()
    );
    std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
    // What serve will read: check it now rather than on every node later.
    shoal_pipeline::Placement::load(path).with_context(|| format!("the written placement {}", path.display()))?;
    Ok(())
}

/// This machine as one CPU device: its available memory, and decode speed estimated
/// from memory bandwidth (each token reads every weight once).
fn this_machine(model: &ModelProfile) -> Cluster {
    let inv = crate::inventory::collect();
    let host = if inv.hostname.is_empty() { "this-host".to_string() } else { inv.hostname.clone() };
    Cluster { devices: vec![Device::estimated_cpu(host, inv.ram_available_bytes, model)], links: Vec::new() }
}

fn print_plan(p: &Plan) {
    println!("{:>5}  {:<24} {:>7} {:>12} {:>13}", "stage", "device", "layers", "memory", "ms per token");
    for (i, s) in p.stages.iter().enumerate() {
        println!(
            "{i:>5}  {:<24} {:>7} {:>12} {:>13.2}",
            s.device,
            format!("{}-{}", s.first, s.last),
            fmt_size(s.memory_bytes),
            s.ms_per_token
        );
    }
    println!(
        "predicted: {:.1} tok/s decode, {:.2} s to first token for a {}-token prompt{}",
        p.predicted_tok_s,
        p.predicted_ttft_s,
        p.prompt_tokens,
        if p.fits { "" } else { " (DOES NOT FIT)" }
    );
    for line in &p.explanation {
        println!("- {line}");
    }
    for r in &p.replicas {
        let devs: Vec<&str> = r.stages.iter().map(|s| s.device.as_str()).collect();
        println!("replica on {}: {} ({:.1} tok/s)", r.host, devs.join(" → "), r.predicted_tok_s);
    }
}
