//! A pipeline on several hosts of one machine, for the benchmarks that need real
//! network stacks between stages: one Linux network namespace per host on a bridge
//! (`shoal-testnet`), a `shoal serve` process in each, `shoal generate` run from the
//! coordinator's host. Removed, processes and namespaces, when dropped.

use anyhow::{bail, Context, Result};
use shoal_net::Impairment;
use shoal_testnet::Net;
use shoal_types::LayerRange;
use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// A `shoal generate` under way ([`Lab::spawn_generation`]).
pub struct Generation {
    /// The process; its stdout holds the JSON report.
    pub child: Child,
    /// Each token's number and arrival time, as they come.
    pub tokens: mpsc::Receiver<(usize, Instant)>,
    /// Returns the process's other stderr lines once it has ended.
    pub errors: std::thread::JoinHandle<String>,
}

/// Port every stage listens on (each host has its own address).
const PORT: u16 = 7300;

/// Stages running on namespace hosts.
pub struct Lab {
    /// The hosts; host `k` runs stage `k`. Dropped before `dir`.
    pub net: Net,
    /// The placement every stage and the client read.
    pub placement: PathBuf,
    /// Keys and the placement file.
    dir: tempfile::TempDir,
    /// This `shoal` binary, run inside the hosts.
    exe: PathBuf,
    /// What each `shoal serve` is started with besides its placement and data
    /// directory (a restarted stage gets the same).
    serve_args: Vec<String>,
}

/// Waits for a child's readiness the way systemd does: the child finds a datagram
/// socket in `NOTIFY_SOCKET` and sends `READY=1` (with a `STATUS=` line) when it
/// serves. One watch per child, so that a message names its sender.
pub(crate) struct ReadyWatch {
    /// The socket's path, in `_dir` (a path, not an abstract name: namespace hosts
    /// share the file system, not abstract sockets).
    path: PathBuf,
    sock: UnixDatagram,
    /// Removed with the watch.
    _dir: tempfile::TempDir,
}

impl ReadyWatch {
    pub(crate) fn new() -> Result<ReadyWatch> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("notify");
        let sock = UnixDatagram::bind(&path).context("binding a notify socket")?;
        sock.set_read_timeout(Some(Duration::from_millis(200)))?;
        Ok(ReadyWatch { path, sock, _dir: dir })
    }

    /// Point `cmd`'s `NOTIFY_SOCKET` at this watch.
    pub(crate) fn arm<'c>(&self, cmd: &'c mut Command) -> &'c mut Command {
        cmd.env("NOTIFY_SOCKET", &self.path)
    }

    /// Wait (up to two minutes) until `child` says it is ready; returns its status line.
    /// Its stderr, when piped, is drained on a thread (a full pipe would block it) and
    /// its last lines explain a child that exits first; such a child is killed.
    pub(crate) fn wait(&self, child: &mut Child, what: &str) -> Result<String> {
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        if let Some(stderr) = child.stderr.take() {
            let tail = tail.clone();
            // For a look at what happened: every line, appended to a file per process.
            let mut log = std::env::var_os("SHOAL_BENCH_LOGS").and_then(|d| {
                let name = format!("{}.log", what.replace(' ', "-"));
                std::fs::OpenOptions::new().create(true).append(true).open(Path::new(&d).join(name)).ok()
            });
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    if let Some(f) = log.as_mut() {
                        use std::io::Write;
                        let _ = writeln!(f, "{line}");
                    }
                    let mut t = tail.lock().unwrap_or_else(|e| e.into_inner());
                    if t.len() == 40 {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
            });
        }
        let told = |tail: &Mutex<VecDeque<String>>| {
            let t = tail.lock().unwrap_or_else(|e| e.into_inner());
            t.iter().cloned().collect::<Vec<_>>().join("\n")
        };
        let t0 = Instant::now();
        let mut buf = [0u8; 4096];
        loop {
            if let Ok(n) = self.sock.recv(&mut buf) {
                let msg = String::from_utf8_lossy(&buf[..n]);
                if msg.lines().any(|l| l == "READY=1") {
                    let status = msg.lines().find_map(|l| l.strip_prefix("STATUS=")).unwrap_or_default();
                    return Ok(status.to_string());
                }
            }
            if let Some(status) = child.try_wait()? {
                // Let the drain thread take the last lines.
                std::thread::sleep(Duration::from_millis(100));
                bail!("{what} exited ({status}) before it was ready: {}", told(&tail));
            }
            if t0.elapsed() > Duration::from_secs(120) {
                let _ = child.kill();
                let _ = child.wait();
                bail!("{what} was not ready within 120 s: {}", told(&tail));
            }
        }
    }
}

/// Start `cmd` and wait until it is ready (see [`ReadyWatch`]); returns the child and
/// its status line.
pub(crate) fn spawn_ready(cmd: &mut Command, what: &str) -> Result<(Child, String)> {
    let watch = ReadyWatch::new()?;
    let mut child = watch.arm(cmd).stderr(Stdio::piped()).spawn()?;
    let status = watch.wait(&mut child, what)?;
    Ok((child, status))
}

impl Lab {
    /// Start one stage per entry of `stages` on its own host, with `impair` on every
    /// host's outgoing packets and `serve_args` added to each `shoal serve`; returns
    /// once all of them serve.
    pub fn start(
        tag: &str,
        model: &Path,
        stages: &[LayerRange],
        chunk: u32,
        context: u32,
        impair: &Impairment,
        serve_args: &[&str],
    ) -> Result<Lab> {
        let net =
            Net::new(tag, stages.len()).context("network namespaces unavailable here (they need root and iproute2)")?;
        let dir = tempfile::tempdir()?;
        let exe = shoal::shoal_exe().context("locating the shoal binary")?;
        let key = |name: &str| -> Result<String> {
            let out = Command::new(&exe).args(["key", "--data-dir"]).arg(dir.path().join(name)).output()?;
            Ok(String::from_utf8(out.stdout)?.trim().to_string())
        };
        let mut toml = format!(
            "model = {:?}\nchunk = {chunk}\ncontext = {context}\nsessions = 2\nclients = [\"{}\"]\n",
            std::fs::canonicalize(model)?,
            key("client")?
        );
        for (k, r) in stages.iter().enumerate() {
            toml += &format!(
                "[[stage]]\nnode = \"{}\"\naddr = \"{}:{PORT}\"\nlayers = [{}, {}]\n",
                key(&format!("node{k}"))?,
                net.addr(k),
                r.start,
                r.end
            );
        }
        let placement = dir.path().join("placement.toml");
        std::fs::write(&placement, toml)?;
        let impair_arg = if impair.is_none() {
            String::new()
        } else {
            format!("delay={}us,jitter={}us,loss={}", impair.delay.as_micros(), impair.jitter.as_micros(), impair.loss)
        };
        let serve_args = ["--impair", &impair_arg, "--threads", "1"].into_iter().chain(serve_args.iter().copied());
        let serve_args = serve_args.map(str::to_string).collect();
        let mut lab = Lab { net, placement, dir, exe, serve_args };
        // Downstream stages first, so each link finds its next stage listening.
        for k in (0..stages.len()).rev() {
            let (child, status) = spawn_ready(&mut lab.serve_command(k), &format!("stage {k}"))?;
            lab.net.adopt(child);
            if !impair.is_none() && !status.contains("impairing") {
                bail!("stage {k} did not apply the impairment: {status}");
            }
        }
        Ok(lab)
    }

    /// `shoal serve` of stage `k` on its host.
    fn serve_command(&self, k: usize) -> Command {
        let mut cmd = self.net.command(k, &self.exe);
        cmd.arg("serve").args(&self.serve_args).arg("--placement").arg(&self.placement);
        cmd.arg("--data-dir").arg(self.dir.path().join(format!("node{k}")));
        cmd
    }

    /// SIGKILL stage `k`'s process (a crash, a power cut); [`Lab::start_stage`] starts
    /// it again.
    pub fn kill_stage(&mut self, k: usize) -> Result<()> {
        // Invariant: `start` adopted one child per stage, the last stage first.
        let i = self.net.len() - 1 - k;
        let child = &mut self.net.children()[i];
        child.kill().context("killing the stage")?;
        child.wait()?;
        Ok(())
    }

    /// Stop (`true`: SIGSTOP, a laptop's lid closed) or continue (`false`: SIGCONT, the
    /// lid opened, with every socket and timer of the process stale) stage `k`'s process.
    pub fn freeze_stage(&mut self, k: usize, frozen: bool) -> Result<()> {
        // Invariant: `start` adopted one child per stage, the last stage first.
        let i = self.net.len() - 1 - k;
        let pid = self.net.children()[i].id() as libc::pid_t;
        let signal = if frozen { libc::SIGSTOP } else { libc::SIGCONT };
        // SAFETY: kill(2) with a pid of our own child and a valid signal number.
        if unsafe { libc::kill(pid, signal) } != 0 {
            bail!("signalling stage {k}: {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Start stage `k` again (after [`Lab::kill_stage`]) and wait until it serves.
    pub fn start_stage(&mut self, k: usize) -> Result<()> {
        let (child, _) = spawn_ready(&mut self.serve_command(k), &format!("stage {k}"))?;
        let i = self.net.len() - 1 - k;
        self.net.children()[i] = child;
        Ok(())
    }

    /// Every node's status (`shoal status --json` from the coordinator's host).
    pub fn status(&self) -> Result<Vec<shoal_pipeline::NodeStatus>> {
        let mut c = self.net.command(0, &self.exe);
        c.args(["status", "--json", "--placement"]).arg(&self.placement);
        c.arg("--data-dir").arg(self.dir.path().join("client"));
        crate::bench::json_of(c, "status")
    }

    /// Start `shoal generate --progress ARGS` on the coordinator's host: the child (its
    /// JSON on stdout), each token's number and arrival time as it comes, and a thread
    /// that returns the rest of its stderr (why it failed) once it ends.
    pub fn spawn_generation(&self, args: &[&str]) -> Result<Generation> {
        let mut child = self
            .generate()
            .arg("--progress")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting shoal generate")?;
        let (tx, tokens) = mpsc::channel::<(usize, Instant)>();
        let progress = BufReader::new(child.stderr.take().context("generate stderr")?);
        let errors = std::thread::spawn(move || {
            let mut other = Vec::new();
            for line in progress.lines().map_while(Result::ok) {
                match line.strip_prefix("token ").and_then(|n| n.parse().ok()) {
                    Some(n) => {
                        let _ = tx.send((n, Instant::now()));
                    }
                    None => other.push(line),
                }
            }
            other.join("\n")
        });
        Ok(Generation { child, tokens, errors })
    }

    /// `shoal generate` on the coordinator's host, as this lab's client.
    pub fn generate(&self) -> Command {
        let mut c = self.net.command(0, &self.exe);
        c.args(["generate", "--placement"]).arg(&self.placement);
        c.arg("--data-dir").arg(self.dir.path().join("client"));
        c
    }
}
