//! `shoal-lab bench cluster`: N cluster nodes on namespace hosts (real mDNS over the
//! bridge, real QUIC). Measures the time until the first node has discovered and
//! verified all others, forms the cluster (half approved from the CLI, half with
//! pairing codes), times a cold election (every node restarted at once), the failover
//! after SIGKILLing the leader (repeated), a graceful stop of the leader (SIGTERM, as a
//! service manager sends: how long until it exits, and until the others agree on a new
//! leader), heartbeat traffic per node, and a partition
//! with the leader on the minority side: only the majority may have a leader, and
//! after healing all nodes agree again.

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use shoal_membership::wire::ClusterStatus;
use shoal_membership::Liveness;
use shoal_testnet::Net;
use shoal_types::NodeId;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct ClusterBenchArgs {
    /// Nodes, one per namespace host.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Times the leader is killed.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Skip the partition check.
    #[arg(long)]
    no_partition: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// What the bench measured.
#[derive(Debug, Serialize)]
struct Figures {
    nodes: usize,
    /// Start → the first node lists every other node as pending (discovered, key verified).
    discover_s: f64,
    /// Approvals and pairings → every node agrees on members and leader.
    form_s: f64,
    /// Every node restarted at once → all agree on a leader.
    cold_elect_s: f64,
    /// Leader SIGKILLed → the others agree on a new leader, per repeat.
    failover_ms: Vec<f64>,
    failover_p50_ms: f64,
    failover_max_ms: f64,
    /// Leader SIGTERMed → its process exited, per repeat.
    stop_exit_ms: Vec<f64>,
    /// The stopped leader exited → the others agree on a new leader, per repeat.
    stop_elect_ms: Vec<f64>,
    /// A follower SIGTERMed → its process exited.
    follower_exit_ms: f64,
    /// Membership traffic each node sends in a steady cluster (mean over nodes).
    heartbeat_bytes_per_s: f64,
    heartbeat_msgs_per_s: f64,
    partition: Option<PartitionFigures>,
}

#[derive(Debug, Serialize)]
struct PartitionFigures {
    majority: Vec<usize>,
    minority: Vec<usize>,
    /// Cut → the majority agrees on a leader and the minority has none.
    settle_s: f64,
    /// Whether the minority stayed leaderless over the checks that followed.
    minority_leaderless: bool,
    /// Heal → all nodes agree on one leader and one state version.
    heal_s: f64,
}

/// Nodes on namespace hosts. Children are killed before the namespaces go.
pub(crate) struct Cluster {
    children: Vec<Option<Child>>,
    net: Net,
    dir: tempfile::TempDir,
    exe: PathBuf,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in self.children.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub(crate) const WAIT: Duration = Duration::from_secs(30);

impl Cluster {
    /// `n` namespace hosts (named after `tag`), no node started yet.
    pub(crate) fn new(tag: &str, n: usize) -> Result<Cluster> {
        let net = Net::new(tag, n).context("network namespaces unavailable here (they need root and iproute2)")?;
        Ok(Cluster {
            children: (0..n).map(|_| None).collect(),
            net,
            dir: tempfile::tempdir()?,
            exe: shoal::shoal_exe().context("locating the shoal binary")?,
        })
    }

    /// The namespace hosts.
    pub(crate) fn net(&self) -> &Net {
        &self.net
    }

    fn data(&self, k: usize) -> PathBuf {
        self.dir.path().join(format!("node{k}"))
    }

    pub(crate) fn start(&mut self, k: usize, flags: &[&str]) -> Result<()> {
        let log =
            std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join(format!("node{k}.log")))?;
        let child = self
            .net
            .command(k, &self.exe)
            .args(["serve", "--listen", "0.0.0.0:47070", "--join-listen", "0.0.0.0:47071", "--mdns-allow", "v*"])
            .args(["--name", &format!("node{k}"), "--data-dir"])
            .arg(self.data(k))
            .args(flags)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        self.children[k] = Some(child);
        Ok(())
    }

    pub(crate) fn kill(&mut self, k: usize, hard: bool) -> Result<()> {
        if let Some(mut c) = self.children[k].take() {
            if hard {
                c.kill()?;
            } else {
                Command::new("kill").args(["-TERM", &c.id().to_string()]).status()?;
            }
            c.wait()?;
        }
        Ok(())
    }

    pub(crate) fn cli(&self, k: usize, args: &[&str]) -> Result<String> {
        let out = self.net.command(k, &self.exe).args(args).arg("--data-dir").arg(self.data(k)).output()?;
        if !out.status.success() {
            bail!("node{k}: shoal {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8(out.stdout)?.trim().to_string())
    }

    pub(crate) fn status(&self, k: usize) -> Option<ClusterStatus> {
        self.children[k].as_ref()?;
        serde_json::from_str(&self.cli(k, &["status", "--json"]).ok()?).ok()
    }

    pub(crate) fn id(&self, k: usize) -> Result<NodeId> {
        Ok(self.cli(k, &["key"])?.parse()?)
    }

    /// The leader every node of `ks` agrees on, with one state version, every member
    /// of `ks` seen alive by all of them; `None` until then.
    fn agreed(&self, ks: &[usize], members: usize) -> Option<NodeId> {
        let mut seen: Option<(NodeId, String)> = None;
        for k in ks {
            let s = self.status(*k)?;
            let leader = s.leader?;
            let alive = s.members.iter().filter(|m| m.state == Liveness::Alive).count();
            if s.members.len() != members || alive < ks.len() {
                return None;
            }
            match &seen {
                None => seen = Some((leader, s.version)),
                Some((l, v)) if *l == leader && *v == s.version => {}
                Some(_) => return None,
            }
        }
        seen.map(|(l, _)| l)
    }

    /// Wait until every node of `rest` follows one leader other than `old`.
    fn wait_new_leader(&self, rest: &[usize], old: NodeId, what: &str) -> Result<NodeId> {
        let t = Instant::now();
        loop {
            let s: Option<Vec<Option<NodeId>>> = rest.iter().map(|i| self.status(*i).map(|s| s.leader)).collect();
            if let Some(Some(Some(l))) = s.as_ref().map(|s| s.first()) {
                if *l != old && s.iter().flatten().all(|x| *x == Some(*l)) {
                    return Ok(*l);
                }
            }
            if t.elapsed() > WAIT {
                bail!("no new leader {} s after {what}{}", WAIT.as_secs(), self.describe());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait_agreed(&self, ks: &[usize], members: usize, what: &str) -> Result<(NodeId, Duration)> {
        let t0 = Instant::now();
        loop {
            if let Some(l) = self.agreed(ks, members) {
                return Ok((l, t0.elapsed()));
            }
            if t0.elapsed() > WAIT {
                bail!("{what}: nodes {ks:?} did not agree on a leader within {} s{}", WAIT.as_secs(), self.describe());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn describe(&self) -> String {
        let mut out = String::new();
        for k in 0..self.children.len() {
            match self.status(k) {
                Some(s) => {
                    out += &format!(
                        "\n  node{k}: {} term {} leader {:?} version {} members {}",
                        s.role,
                        s.term,
                        s.leader,
                        s.version,
                        s.members.len()
                    )
                }
                None => out += &format!("\n  node{k}: no answer"),
            }
        }
        out
    }
}

pub fn cluster(a: ClusterBenchArgs) -> Result<()> {
    if a.nodes < 2 {
        bail!("a cluster benchmark needs at least 2 nodes");
    }
    let n = a.nodes;
    let mut c = Cluster::new("cl", n)?;
    let ids: Vec<NodeId> = (0..n).map(|k| c.id(k)).collect::<Result<_>>()?;
    let index = |id: NodeId| ids.iter().position(|i| *i == id);

    // Discovery: node 0 creates the cluster, the others wait to be let in.
    let t0 = Instant::now();
    c.start(0, &["--create-cluster"])?;
    for k in 1..n {
        c.start(k, &["--no-create"])?;
    }
    loop {
        if c.status(0).is_some_and(|s| s.pending.len() == n - 1) {
            break;
        }
        if t0.elapsed() > WAIT {
            bail!("node0 did not see every other node within {} s{}", WAIT.as_secs(), c.describe());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let discover = t0.elapsed();
    eprintln!("[bench] node0 discovered and verified {} nodes in {:.2} s", n - 1, discover.as_secs_f64());

    // Forming: odd nodes approved from node0's CLI (once their owner agreed to an
    // approval from node0), even ones join with a code.
    let t1 = Instant::now();
    c.status(0).and_then(|s| s.cluster).context("node0 has no cluster")?;
    let approver = ids[0].to_string();
    for (k, id) in ids.iter().enumerate().skip(1) {
        if k % 2 == 1 {
            c.cli(k, &["join", "--accept", &approver[..16]])?;
            c.cli(0, &["nodes", "approve", &id.to_string()[..16]])?;
        } else {
            let code = c.cli(0, &["nodes", "pair"])?;
            c.cli(k, &["join", &code])?;
        }
    }
    let all: Vec<usize> = (0..n).collect();
    c.wait_agreed(&all, n, "forming")?;
    let form = t1.elapsed();
    eprintln!("[bench] formed a cluster of {n} in {:.2} s", form.as_secs_f64());

    // Heartbeat traffic over 5 s of a steady cluster.
    let sample = |c: &Cluster| -> Result<Vec<ClusterStatus>> {
        all.iter().map(|k| c.status(*k).with_context(|| format!("node{k} did not answer"))).collect()
    };
    let before = sample(&c)?;
    std::thread::sleep(Duration::from_secs(5));
    let after = sample(&c)?;
    let (mut bytes, mut msgs) = (0.0, 0.0);
    for (b, a) in before.iter().zip(&after) {
        let dt = a.uptime_s - b.uptime_s;
        bytes += a.sent_bytes.saturating_sub(b.sent_bytes) as f64 / dt;
        msgs += a.sent_msgs.saturating_sub(b.sent_msgs) as f64 / dt;
    }
    let (bytes, msgs) = (bytes / after.len() as f64, msgs / after.len() as f64);

    // Cold election: everyone restarts at once from what they stored.
    for k in 0..n {
        c.kill(k, false)?;
    }
    for k in 0..n {
        c.start(k, &[])?;
    }
    let (_, cold) = c.wait_agreed(&all, n, "cold election")?;
    eprintln!("[bench] cold start: a leader all agree on after {:.2} s", cold.as_secs_f64());

    // Failover: SIGKILL the leader, time until the rest agree on another.
    let mut failover = Vec::new();
    for r in 0..a.repeats {
        let (leader, _) = c.wait_agreed(&all, n, "before failover")?;
        let k = index(leader).context("the leader is not one of ours")?;
        let t = Instant::now();
        c.kill(k, true)?;
        let rest: Vec<usize> = all.iter().copied().filter(|i| *i != k).collect();
        let new = c.wait_new_leader(&rest, leader, "killing the leader")?;
        let took = t.elapsed();
        eprintln!(
            "[bench] failover {r}: node{k} killed, node{} leads after {} ms",
            index(new).unwrap_or(99),
            took.as_millis()
        );
        failover.push(took.as_secs_f64() * 1000.0);
        c.start(k, &[])?;
        c.wait_agreed(&all, n, "rejoining")?;
    }
    let mut sorted = failover.clone();
    let p50 = if sorted.is_empty() { 0.0 } else { super::median(&mut sorted) };
    let max = failover.iter().copied().fold(0.0, f64::max);

    // Graceful stop: SIGTERM the leader (systemd's stop, an upgrade). It hands over
    // before it exits, so the others need not wait out an election timeout.
    let (mut stop_exit, mut stop_elect) = (Vec::new(), Vec::new());
    for r in 0..a.repeats.max(1) {
        let (leader, _) = c.wait_agreed(&all, n, "before stopping the leader")?;
        let k = index(leader).context("the leader is not one of ours")?;
        let t = Instant::now();
        c.kill(k, false)?;
        let exit = t.elapsed();
        let rest: Vec<usize> = all.iter().copied().filter(|i| *i != k).collect();
        let new = c.wait_new_leader(&rest, leader, "stopping the leader")?;
        let elect = t.elapsed() - exit;
        eprintln!(
            "[bench] stop {r}: node{k} (leader) exited {} ms after SIGTERM, node{} leads {} ms after that",
            exit.as_millis(),
            index(new).unwrap_or(99),
            elect.as_millis()
        );
        stop_exit.push(exit.as_secs_f64() * 1000.0);
        stop_elect.push(elect.as_secs_f64() * 1000.0);
        c.start(k, &[])?;
        c.wait_agreed(&all, n, "rejoining")?;
    }
    let follower_exit = {
        let (leader, _) = c.wait_agreed(&all, n, "before stopping a follower")?;
        let k = all.iter().copied().find(|k| Some(*k) != index(leader)).context("no follower")?;
        let t = Instant::now();
        c.kill(k, false)?;
        let exit = t.elapsed();
        eprintln!("[bench] node{k} (follower) exited {} ms after SIGTERM", exit.as_millis());
        c.start(k, &[])?;
        c.wait_agreed(&all, n, "rejoining")?;
        exit.as_secs_f64() * 1000.0
    };

    // Partition with the leader on the minority side.
    let partition = if a.no_partition || n < 3 {
        None
    } else {
        let (leader, _) = c.wait_agreed(&all, n, "before the partition")?;
        let l = index(leader).context("the leader is not one of ours")?;
        let minority_size = (n - 1) / 2;
        let mut minority = vec![l];
        minority.extend(all.iter().copied().filter(|k| *k != l).take(minority_size - 1));
        let majority: Vec<usize> = all.iter().copied().filter(|k| !minority.contains(k)).collect();
        let t = Instant::now();
        c.net.partition(&[&majority, &minority])?;
        let leaderless = |c: &Cluster| minority.iter().all(|k| c.status(*k).is_some_and(|s| s.leader.is_none()));
        let settle = loop {
            let maj_leader = majority_leader(&c, &majority);
            if maj_leader.is_some_and(|m| m != leader) && leaderless(&c) {
                break t.elapsed();
            }
            if t.elapsed() > WAIT {
                bail!("the partition did not settle within {} s{}", WAIT.as_secs(), c.describe());
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        // The minority must stay leaderless while cut off.
        let mut stayed = true;
        for _ in 0..10 {
            std::thread::sleep(Duration::from_millis(300));
            stayed &= leaderless(&c) && majority_leader(&c, &majority).is_some();
        }
        eprintln!("[bench] partition {majority:?} | {minority:?}: settled in {:.2} s", settle.as_secs_f64());
        c.net.heal()?;
        let (_, heal) = c.wait_agreed(&all, n, "healing")?;
        eprintln!("[bench] healed: one leader, one state after {:.2} s", heal.as_secs_f64());
        Some(PartitionFigures {
            majority,
            minority,
            settle_s: settle.as_secs_f64(),
            minority_leaderless: stayed,
            heal_s: heal.as_secs_f64(),
        })
    };

    let f = Figures {
        nodes: n,
        discover_s: discover.as_secs_f64(),
        form_s: form.as_secs_f64(),
        cold_elect_s: cold.as_secs_f64(),
        failover_ms: failover,
        failover_p50_ms: p50,
        failover_max_ms: max,
        stop_exit_ms: stop_exit,
        stop_elect_ms: stop_elect,
        follower_exit_ms: follower_exit,
        heartbeat_bytes_per_s: bytes,
        heartbeat_msgs_per_s: msgs,
        partition,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&f)?);
    } else {
        println!("cluster of {n} nodes on namespace hosts (real mDNS, real QUIC)");
        println!("  discover all peers (node0, keys verified)   {:>8.2} s", f.discover_s);
        println!("  form (approvals + pairing codes, agreed)     {:>8.2} s", f.form_s);
        println!("  elect from a cold start (all restarted)      {:>8.2} s", f.cold_elect_s);
        println!(
            "  failover after SIGKILL of the leader         p50 {:>7.0} ms   max {:>7.0} ms   ({} repeats)",
            f.failover_p50_ms,
            f.failover_max_ms,
            f.failover_ms.len()
        );
        let most = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
        println!(
            "  SIGTERM to the leader: exits after max {:>5.0} ms, a new leader max {:>5.0} ms later   ({} repeats)",
            most(&f.stop_exit_ms),
            most(&f.stop_elect_ms),
            f.stop_exit_ms.len()
        );
        println!("  SIGTERM to a follower: exits after {:>5.0} ms", f.follower_exit_ms);
        println!("  heartbeat traffic per node                   {:>8.0} B/s   {:.1} msgs/s", bytes, msgs);
        if let Some(p) = &f.partition {
            println!(
                "  partition {:?} | {:?} (leader in the minority): settled {:.2} s, minority leaderless: {}, healed {:.2} s",
                p.majority, p.minority, p.settle_s, p.minority_leaderless, p.heal_s
            );
        }
    }
    Ok(())
}

/// The leader all of `ks` agree on, if any.
fn majority_leader(c: &Cluster, ks: &[usize]) -> Option<NodeId> {
    let leaders: Option<Vec<Option<NodeId>>> = ks.iter().map(|k| c.status(*k).map(|s| s.leader)).collect();
    let leaders = leaders?;
    let first = (*leaders.first()?)?;
    leaders.iter().all(|l| *l == Some(first)).then_some(first)
}
