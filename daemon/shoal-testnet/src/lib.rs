//! Several hosts on one Linux machine, for multi-node tests and benchmarks: a bridge
//! namespace with one veth per host namespace, addresses 10.x.y.k/24, links that can
//! be taken down and up. Everything is created under unique names and removed when
//! the [`Net`] is dropped (also on panic), together with the processes it was given.
//! Needs root and iproute2; [`Net::new`] says why when it cannot.

pub mod flood;
pub mod fuzz_inputs;
pub mod precondition;
pub mod rng;
pub use rng::Rng;

use std::ffi::OsStr;
use std::net::Ipv4Addr;
use std::process::{Child, Command};

/// Why the namespaces could not be made or changed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NetnsError(String);

/// A set of hosts on one bridge.
pub struct Net {
    /// Namespace holding the bridge `br0` and the hosts' peer ends `b<k>`.
    bridge: String,
    /// One namespace per host; host `k` has `v<k>` with address `subnet.octets[k]`.
    hosts: Vec<String>,
    /// First three octets of the hosts' /24.
    subnet: [u8; 3],
    /// Each host's last octet: `k + 1`, until [`Net::renumber`] changes it.
    octets: Vec<u8>,
    /// Processes killed (and reaped) before the namespaces go.
    children: Vec<Child>,
    /// The last octet [`Net::renumber`] gave (100: none yet).
    last_given: u8,
}

/// Run `ip ARGS`.
fn ip(args: &[&str]) -> Result<(), NetnsError> {
    let out = Command::new("ip").args(args).output().map_err(|e| NetnsError(format!("cannot run ip: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NetnsError(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim())))
    }
}

impl Net {
    /// Create `n` hosts on a bridge. `tag` (a few letters) says who made them; the
    /// process id and a per-process count make names unique.
    pub fn new(tag: &str, n: usize) -> Result<Net, NetnsError> {
        static MADE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let id = std::process::id() % 60000;
        let name = format!("shoal-{tag}-{id}-{}", MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        let mut net = Net {
            bridge: format!("{name}-br"),
            hosts: Vec::new(),
            subnet: [10, 200 + (id % 50) as u8, ((id / 50) % 250) as u8],
            octets: (1..=n as u8).collect(),
            children: Vec::new(),
            last_given: 100,
        };
        // From here on, `net` removes whatever was made if a later step fails.
        ip(&["netns", "add", &net.bridge])?;
        let br = net.bridge.clone();
        let in_bridge = |args: &[&str]| ip(&[&["netns", "exec", &br, "ip"], args].concat());
        in_bridge(&["link", "add", "br0", "type", "bridge"])?;
        in_bridge(&["link", "set", "br0", "up"])?;
        for k in 0..n {
            let host = format!("{name}-h{k}");
            ip(&["netns", "add", &host])?;
            net.hosts.push(host.clone());
            let (b, v) = (format!("b{k}"), format!("v{k}"));
            in_bridge(&["link", "add", &b, "type", "veth", "peer", "name", &v, "netns", &host])?;
            in_bridge(&["link", "set", &b, "master", "br0", "up"])?;
            let in_host = |args: &[&str]| ip(&[&["netns", "exec", &host, "ip"], args].concat());
            in_host(&["addr", "add", &format!("{}/24", net.addr(k)), "dev", &v])?;
            in_host(&["link", "set", &v, "up"])?;
            in_host(&["link", "set", "lo", "up"])?;
            // Multicast (mDNS) leaves through the bridge link.
            in_host(&["route", "add", "224.0.0.0/4", "dev", &v])?;
        }
        Ok(net)
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Whether there are no hosts.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// Host `k`'s address.
    pub fn addr(&self, k: usize) -> Ipv4Addr {
        let [a, b, c] = self.subnet;
        Ipv4Addr::new(a, b, c, self.octets[k])
    }

    /// Give host `k` a new address on the same /24, as a DHCP server does to a machine
    /// that comes back from sleep: the old one is gone at once (sockets bound to any
    /// address stay open and send from the new one). Returns it.
    pub fn renumber(&mut self, k: usize) -> Result<Ipv4Addr, NetnsError> {
        // The next free octet after the last one given (101 to 254, round): a long
        // soak renumbers hundreds of times and reuses what earlier renumbers gave up,
        // the longest ago first, as a DHCP server does (an address freed a moment ago
        // is still in the other hosts' neighbour caches).
        let next = (0..154u16)
            .map(|i| 101 + ((u16::from(self.last_given - 100) + i) % 154) as u8)
            .find(|o| !self.octets.contains(o))
            .ok_or_else(|| NetnsError("no free address left on the /24".into()))?;
        self.last_given = next;
        let (old, v, host) = (self.addr(k), format!("v{k}"), self.hosts[k].clone());
        let in_host = |args: &[&str]| ip(&[&["netns", "exec", &host, "ip"], args].concat());
        self.octets[k] = next;
        // Removed first: deleting a primary address deletes the secondaries of its
        // subnet too (unless the host promotes them).
        in_host(&["addr", "del", &format!("{old}/24"), "dev", &v])?;
        in_host(&["addr", "add", &format!("{}/24", self.addr(k)), "dev", &v])?;
        // The multicast route goes with the address that held the subnet route.
        let _ = in_host(&["route", "add", "224.0.0.0/4", "dev", &v]);
        Ok(self.addr(k))
    }

    /// Host `k`'s namespace name (for `ip netns exec`).
    pub fn namespace(&self, k: usize) -> &str {
        &self.hosts[k]
    }

    /// A command that runs `program` inside host `k`.
    pub fn command(&self, k: usize, program: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.hosts[k]]).arg(program);
        c
    }

    /// Run `f` on a thread of its own inside host `k`'s network namespace: the sockets
    /// it opens (and the threads it starts) are that host's, as for a process started
    /// with [`Net::command`]; the calling thread stays where it was.
    #[cfg(target_os = "linux")]
    pub fn within<T: Send>(&self, k: usize, f: impl FnOnce() -> T + Send) -> Result<T, NetnsError> {
        use std::os::fd::AsFd;
        let path = format!("/run/netns/{}", self.hosts[k]);
        let ns = std::fs::File::open(&path).map_err(|e| NetnsError(format!("{path}: {e}")))?;
        std::thread::scope(|scope| {
            let inside = scope.spawn(|| {
                // setns on a network namespace moves only the calling thread, which ends after `f`.
                rustix::thread::move_into_link_name_space(ns.as_fd(), Some(rustix::thread::LinkNameSpaceType::Network))
                    .map_err(|e| NetnsError(format!("entering {path}: {e}")))?;
                Ok(f())
            });
            inside.join().unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }

    /// Network namespaces are Linux's: elsewhere `f` cannot run inside one.
    #[cfg(not(target_os = "linux"))]
    pub fn within<T: Send>(&self, _: usize, _: impl FnOnce() -> T + Send) -> Result<T, NetnsError> {
        Err(NetnsError("network namespaces exist on Linux only".into()))
    }

    /// Take host `k`'s link to the bridge down or up.
    pub fn link(&self, k: usize, up: bool) -> Result<(), NetnsError> {
        ip(&["netns", "exec", &self.hosts[k], "ip", "link", "set", &format!("v{k}"), if up { "up" } else { "down" }])
    }

    /// Drop `percent`% of the UDP packets host `k` sends, at random (nftables in its
    /// namespace: this kernel has no netem); 0 removes the rule. Needs `nft`.
    pub fn loss(&self, k: usize, percent: u32) -> Result<(), NetnsError> {
        let nft = |args: &str| -> Result<(), NetnsError> {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &self.hosts[k], "nft"]).args(args.split(' '));
            let out = c.output().map_err(|e| NetnsError(format!("cannot run nft: {e}")))?;
            match out.status.success() {
                true => Ok(()),
                false => Err(NetnsError(format!("nft {args}: {}", String::from_utf8_lossy(&out.stderr).trim()))),
            }
        };
        // Deleting a table that is not there fails, harmlessly.
        let _ = nft("delete table inet shoal_loss");
        if percent == 0 {
            return Ok(());
        }
        nft("add table inet shoal_loss")?;
        nft("add chain inet shoal_loss out { type filter hook output priority 0 ; }")?;
        nft(&format!("add rule inet shoal_loss out meta l4proto udp numgen random mod 100 < {} drop", percent.min(100)))
    }

    /// Split the hosts into groups that reach only each other: group 0 stays on the
    /// bridge, each further group gets a bridge of its own (hosts not named stay on
    /// the first). Multicast (mDNS) follows the same cut. [`Net::heal`] undoes it.
    pub fn partition(&self, groups: &[&[usize]]) -> Result<(), NetnsError> {
        self.heal()?;
        let in_bridge = |args: &[&str]| ip(&[&["netns", "exec", &self.bridge, "ip"], args].concat());
        for (g, hosts) in groups.iter().enumerate().skip(1) {
            let br = format!("br{g}");
            in_bridge(&["link", "add", &br, "type", "bridge"])?;
            in_bridge(&["link", "set", &br, "up"])?;
            for k in hosts.iter() {
                in_bridge(&["link", "set", &format!("b{k}"), "master", &br])?;
            }
        }
        Ok(())
    }

    /// Put every host back on one bridge.
    pub fn heal(&self) -> Result<(), NetnsError> {
        let in_bridge = |args: &[&str]| ip(&[&["netns", "exec", &self.bridge, "ip"], args].concat());
        for k in 0..self.hosts.len() {
            in_bridge(&["link", "set", &format!("b{k}"), "master", "br0"])?;
        }
        for g in 1..self.hosts.len() {
            // Only bridges an earlier partition made exist; the others fail to delete, harmlessly.
            let _ = in_bridge(&["link", "del", &format!("br{g}")]);
        }
        Ok(())
    }

    /// Kill `child` when this net is dropped (before its namespaces are removed).
    pub fn adopt(&mut self, child: Child) {
        self.children.push(child);
    }

    /// The adopted processes, in order of adoption.
    pub fn children(&mut self) -> &mut [Child] {
        &mut self.children
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in self.hosts.iter().chain(std::iter::once(&self.bridge)) {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_are_made_flapped_and_removed() {
        // The partition is checked by ping from one host to the other.
        if !precondition::tool("ping", "-V", "iputils-ping; scripts/setup.sh installs it") {
            return;
        }
        let Some(net) = precondition::namespaces("selftest", 2) else { return };
        let names: Vec<String> = (0..2).map(|k| net.namespace(k).to_string()).collect();
        assert_eq!(net.addr(1).octets()[3], 2);
        let listed = String::from_utf8(Command::new("ip").args(["netns", "list"]).output().unwrap().stdout).unwrap();
        assert!(names.iter().all(|n| listed.contains(n.as_str())), "{listed}");
        net.link(1, false).unwrap();
        net.link(1, true).unwrap();
        // A partition cuts host 1 off from host 0; healing joins them again.
        let ping = |from: usize, to: usize| {
            net.command(from, "ping")
                .args(["-c", "1", "-W", "1", &net.addr(to).to_string()])
                .output()
                .is_ok_and(|o| o.status.success())
        };
        assert!(ping(0, 1));
        net.partition(&[&[0], &[1]]).unwrap();
        assert!(!ping(0, 1), "the partition let a packet through");
        net.heal().unwrap();
        assert!(ping(0, 1), "healing did not reconnect the hosts");
        drop(net);
        let listed = String::from_utf8(Command::new("ip").args(["netns", "list"]).output().unwrap().stdout).unwrap();
        assert!(names.iter().all(|n| !listed.contains(n.as_str())), "left behind: {listed}");
    }
}
