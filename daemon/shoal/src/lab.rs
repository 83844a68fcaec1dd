//! A pipeline on several hosts of one machine, for the benchmarks that need real
//! network stacks between stages: one Linux network namespace per host on a bridge
//! (`shoal-testnet`), a `shoal serve` process in each, `shoal generate` run from the
//! coordinator's host. Removed, processes and namespaces, when dropped.

use anyhow::{bail, Context, Result};
use shoal_net::Impairment;
use shoal_testnet::Net;
use shoal_types::LayerRange;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

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
}

/// Read a `shoal serve --placement` process's stderr until it says it serves, then
/// keep draining it on a thread (a full pipe would block the stage). Returns the
/// lines before that one; fails with them if the process ended first.
pub(crate) fn until_serving(stderr: std::process::ChildStderr, what: &str) -> Result<Vec<String>> {
    let mut lines = BufReader::new(stderr).lines();
    let mut seen = Vec::new();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.contains("[shoal] serving") => break,
            Some(Ok(l)) => seen.push(l),
            _ => bail!("{what} exited before serving: {}", seen.join("\n")),
        }
    }
    std::thread::spawn(move || lines.for_each(drop));
    Ok(seen)
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
        let exe = std::env::current_exe().context("locating the shoal binary")?;
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
        let mut lab = Lab { net, placement, dir, exe };
        let impair_arg = if impair.is_none() {
            String::new()
        } else {
            format!("delay={}us,jitter={}us,loss={}", impair.delay.as_micros(), impair.jitter.as_micros(), impair.loss)
        };
        // Downstream stages first, so each link finds its next stage listening.
        for k in (0..stages.len()).rev() {
            let mut child = lab
                .net
                .command(k, &lab.exe)
                .args(["serve", "--impair", &impair_arg])
                .args(serve_args)
                .arg("--placement")
                .arg(&lab.placement)
                .arg("--data-dir")
                .arg(lab.dir.path().join(format!("node{k}")))
                .stderr(Stdio::piped())
                .spawn()?;
            let stderr = child.stderr.take().context("stage stderr")?;
            lab.net.adopt(child);
            let seen = until_serving(stderr, &format!("stage {k}"))?;
            if !impair.is_none() && !seen.iter().any(|l| l.contains("impairing")) {
                bail!("stage {k} did not apply the impairment: {}", seen.join("\n"));
            }
        }
        Ok(lab)
    }

    /// Every node's status (`shoal status --json` from the coordinator's host).
    pub fn status(&self) -> Result<Vec<shoal_pipeline::NodeStatus>> {
        let mut c = self.net.command(0, &self.exe);
        c.args(["status", "--json", "--placement"]).arg(&self.placement);
        c.arg("--data-dir").arg(self.dir.path().join("client"));
        crate::bench::json_of(c, "status")
    }

    /// `shoal generate` on the coordinator's host, as this lab's client.
    pub fn generate(&self) -> Command {
        let mut c = self.net.command(0, &self.exe);
        c.args(["generate", "--placement"]).arg(&self.placement);
        c.arg("--data-dir").arg(self.dir.path().join("client"));
        c
    }
}
