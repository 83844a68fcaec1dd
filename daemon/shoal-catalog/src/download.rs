//! Downloading a model over HTTP(S) into a folder, resumably: bytes land in
//! `<file>.part`, an interrupted download continues with a `Range` request where it
//! stopped (from 0 when the server ignores ranges or the remote file changed), and the
//! finished file is described before it takes its final name, so a file Shoal cannot
//! run never appears under it. `hf://org/repo[@rev]/path/file.gguf` names a file on
//! the Hugging Face hub.
//!
//! Blocking (ureq): a download is one long sequential copy to disk; an async caller
//! runs it on a blocking thread. Retrying is the caller's: each call makes one attempt
//! and keeps what it got, so a retry (with the caller's backoff) resumes.
//!
//! A download asked for over the network ([`Limits::for_clients`]) goes only to public
//! addresses, checked after every name resolution, redirects included (a URL from a
//! client must not reach this machine's or its LAN's services, nor a cloud metadata
//! address), and stops before it would fill the disk.

use crate::describe::{describe, CatalogError, Described};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Bytes copied per step (and between progress calls).
const COPY_CHUNK: usize = 1 << 20;
/// Where `hf://` points.
const HF_ENDPOINT: &str = "https://huggingface.co";
/// A connection that delivers nothing for this long is given up (the `.part` stays).
const STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// Why a download did not produce a catalog model.
#[derive(Debug, thiserror::Error)]
pub enum DownloadError {
    /// Not `http(s)://…/<file>` nor `hf://org/repo[@rev]/…/<file>`.
    #[error("{url:?}: {why}")]
    BadUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        why: String,
    },
    /// The destination already holds a file of that name; it is never overwritten.
    #[error("{0}: already exists; add it to the catalog as it is, or move it away to download again")]
    Exists(PathBuf),
    /// The server answered with a status other than 200/206 (404: no such file; 401/403:
    /// a gated or private repository).
    #[error("{url}: the server answered HTTP {status}")]
    Status {
        /// The URL requested.
        url: String,
        /// The HTTP status.
        status: u16,
    },
    /// The request could not be made or answered (DNS, connection, TLS, timeout).
    #[error("{url}: {source}")]
    Transport {
        /// The URL requested.
        url: String,
        /// What failed.
        source: Box<ureq::Error>,
    },
    /// The transfer stopped before the end; the bytes so far are kept in `part`, and
    /// calling [`download`] again resumes from them.
    #[error("{url}: download interrupted after {have} bytes ({why}); run it again to resume")]
    Interrupted {
        /// The URL requested.
        url: String,
        /// The partial file kept for resuming.
        part: PathBuf,
        /// Bytes it holds.
        have: u64,
        /// What stopped it.
        why: String,
    },
    /// A local file could not be written or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// The file is larger than the room it may take (the disk's free space less a
    /// reserve); what arrived of it was deleted.
    #[error("{url}: {size} bytes would not fit: {room} bytes may be used on this disk (free space less 1 GiB)")]
    TooLarge {
        /// The URL requested.
        url: String,
        /// Its size, or what had arrived when it passed the room.
        size: u64,
        /// The room it had.
        room: u64,
    },
    /// The whole file arrived but is not a model Shoal can run; it was deleted (it
    /// could never be served, and resuming it would only fetch the same bytes).
    #[error("the downloaded file is not a model Shoal can run, so it was deleted: {0}")]
    Refused(#[source] CatalogError),
}

/// How far a download is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Bytes of the file on disk so far (resumed bytes included).
    pub done: u64,
    /// The file's size, when the server said.
    pub total: Option<u64>,
    /// Bytes that were already there when this call started (0 for a fresh start).
    pub resumed_from: u64,
}

/// A finished download.
#[derive(Clone, Debug)]
pub struct Downloaded {
    /// The file, under its final name.
    pub path: PathBuf,
    /// It, described for the catalog; for `hf://` its name is `org/repo/path/file`
    /// (as a Hugging Face cache scan would name it), otherwise the file's name.
    pub described: Described,
}

/// Where a URL points: the `http(s)` URL to fetch, the local file name, the suggested
/// catalog name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    /// What is fetched.
    pub url: String,
    /// The file's name in the destination folder.
    pub file_name: String,
    /// The catalog name it is suggested under.
    pub name: String,
}

/// Map `hf://org/repo[@rev]/path/file` to
/// `https://huggingface.co/org/repo/resolve/<rev or main>/path/file`; take `http(s)`
/// URLs as they are. The file name is the URL path's last segment.
pub fn resolve_url(url: &str) -> Result<Resolved, DownloadError> {
    let bad = |why: &str| DownloadError::BadUrl { url: url.chars().take(300).collect(), why: why.to_owned() };
    if let Some(rest) = url.strip_prefix("hf://") {
        let mut parts = rest.split('/');
        let (Some(org), Some(repo_rev)) = (parts.next(), parts.next()) else {
            return Err(bad("expected hf://org/repo[@revision]/path/file.gguf"));
        };
        let file_path: Vec<&str> = parts.collect();
        let (repo, rev) = repo_rev.split_once('@').unwrap_or((repo_rev, "main"));
        let segments = [org, repo, rev].into_iter().chain(file_path.iter().copied());
        if file_path.is_empty() || segments.clone().any(|s| s.is_empty() || s == "." || s == "..") {
            return Err(bad("expected hf://org/repo[@revision]/path/file.gguf (no empty, . or .. parts)"));
        }
        let path = file_path.join("/");
        let file_name =
            file_name_of(file_path.last().copied().unwrap_or_default()).ok_or_else(|| bad("bad file name"))?;
        let name = if rev == "main" { format!("{org}/{repo}/{path}") } else { format!("{org}/{repo}@{rev}/{path}") };
        return Ok(Resolved { url: format!("{HF_ENDPOINT}/{org}/{repo}/resolve/{rev}/{path}"), file_name, name });
    }
    let Some(after_scheme) = url.strip_prefix("https://").or_else(|| url.strip_prefix("http://")) else {
        return Err(bad("only http://, https:// and hf:// URLs are downloaded"));
    };
    let path = after_scheme.split(['?', '#']).next().unwrap_or_default();
    let (_host, path) = path.split_once('/').ok_or_else(|| bad("the URL names no file"))?;
    let last = path.rsplit('/').next().unwrap_or_default();
    let file_name = file_name_of(last).ok_or_else(|| bad("the URL's last path segment is not a usable file name"))?;
    Ok(Resolved { url: url.to_owned(), file_name: file_name.clone(), name: file_name })
}

/// `segment` if it is safe as a file name on every platform we run on.
fn file_name_of(segment: &str) -> Option<String> {
    let ok = !segment.is_empty()
        && segment != "."
        && segment != ".."
        && segment.len() <= 255
        && !segment
            .chars()
            .any(|c| c.is_control() || matches!(c, '/' | '\\' | ':' | '*' | '?' | '"' | '<' | '>' | '|'));
    ok.then(|| segment.to_owned())
}

/// What a download may reach and take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Whether it may connect to loopback, private, link-local, CGNAT, ULA and other
    /// non-public addresses (a model server on the LAN).
    pub private_addresses: bool,
    /// Whether it must leave the disk this much free space ([`RESERVE`]); a file that
    /// would not fit is refused (from its announced size) or stopped.
    pub keep_free: bool,
}

/// Space a client's download leaves free on its disk: the node's state and logs.
pub const RESERVE: u64 = 1 << 30;

impl Limits {
    /// The owner's own download (the CLI, the admin page): anywhere.
    pub const OWNER: Limits = Limits { private_addresses: true, keep_free: true };

    /// One a client asked for (`/api/pull`): public addresses only unless the node
    /// allows private ones (`--allow-private-downloads`).
    pub fn for_clients(allow_private: bool) -> Limits {
        Limits { private_addresses: allow_private, keep_free: true }
    }
}

/// Download `url` into `dest_dir`, resuming a `.part` left by an earlier call, then
/// describe the file (see [`crate::describe()`]): a file Shoal cannot run is deleted and
/// refused. `progress` is called as bytes arrive. The owner's: see [`download_within`].
pub fn download(url: &str, dest_dir: &Path, progress: &mut dyn FnMut(Progress)) -> Result<Downloaded, DownloadError> {
    download_within(url, dest_dir, progress, Limits::OWNER)
}

/// [`download`] within `limits`.
pub fn download_within(
    url: &str,
    dest_dir: &Path,
    progress: &mut dyn FnMut(Progress),
    limits: Limits,
) -> Result<Downloaded, DownloadError> {
    let resolved = resolve_url(url)?;
    let io_err = |path: &Path| {
        let path = path.to_owned();
        move |source| DownloadError::Io { path, source }
    };
    fs::create_dir_all(dest_dir).map_err(io_err(dest_dir))?;
    let dest = dest_dir.join(&resolved.file_name);
    if dest.exists() {
        return Err(DownloadError::Exists(dest));
    }
    let part = dest_dir.join(format!("{}.part", resolved.file_name));
    // The remote file's validator (ETag or Last-Modified) when the .part was started, so
    // a resume of a file that changed upstream (a repo's `main` moved) starts over
    // rather than splice two versions together.
    let validator_path = dest_dir.join(format!("{}.part.validator", resolved.file_name));

    let room = limits.keep_free.then(|| free_space(dest_dir).map(|f| f.saturating_sub(RESERVE))).flatten();
    if let Err(e) = fetch(&resolved.url, (&part, &validator_path), progress, (limits, room)) {
        // Nothing to resume from (refused before a byte came): nothing left behind.
        let empty = fs::metadata(&part).is_ok_and(|m| m.len() == 0);
        if empty || matches!(e, DownloadError::TooLarge { .. }) {
            let _ = fs::remove_file(&part);
            let _ = fs::remove_file(&validator_path);
        }
        return Err(e);
    }

    let mut described = match describe(&part) {
        Ok(d) => d,
        // Not the bytes' fault: keep them, another call finishes the check.
        Err(CatalogError::Unreadable { path, source }) => return Err(DownloadError::Io { path, source }),
        Err(CatalogError::ChangedWhileReading { path }) => {
            let have = fs::metadata(&path).map_or(0, |m| m.len());
            let why = "the file changed while it was being checked (another download of it?)".to_owned();
            return Err(DownloadError::Interrupted { url: resolved.url, part: path, have, why });
        }
        Err(e) => {
            let _ = fs::remove_file(&part);
            let _ = fs::remove_file(&validator_path);
            return Err(DownloadError::Refused(e));
        }
    };
    fs::rename(&part, &dest).map_err(io_err(&dest))?;
    let _ = fs::remove_file(&validator_path);
    let abs = std::path::absolute(&dest).map_err(io_err(&dest))?;
    // describe() accepted the .part's path as UTF-8 and the final one only drops a
    // suffix; checked all the same rather than assumed.
    let not_utf8 = || io::Error::new(io::ErrorKind::InvalidData, "the path is not UTF-8");
    described.holder.path = abs.to_str().ok_or_else(not_utf8).map_err(io_err(&abs))?.to_owned();
    described.entry.name = resolved.name;
    Ok(Downloaded { path: abs, described })
}

/// Fetch `url` into `part`, resuming from its current length; returns once `part`
/// holds the whole file. Within `limits`; `room`: the bytes the file may take.
fn fetch(
    url: &str,
    (part, validator_path): (&Path, &Path),
    progress: &mut dyn FnMut(Progress),
    (limits, room): (Limits, Option<u64>),
) -> Result<(), DownloadError> {
    let io_err = |source| DownloadError::Io { path: part.to_owned(), source };
    let config = ureq::Agent::config_builder()
        // Statuses are ours to read: 206, 200 and 416 each mean something here.
        .http_status_as_error(false)
        .timeout_connect(Some(Duration::from_secs(30)))
        .timeout_recv_response(Some(STALL_TIMEOUT))
        .timeout_per_read(Some(STALL_TIMEOUT))
        .user_agent(concat!("shoal/", env!("CARGO_PKG_VERSION")))
        .build();
    let agent = if limits.private_addresses {
        ureq::Agent::new_with_config(config)
    } else {
        // Every connection, redirects' too, resolves through it.
        ureq::Agent::with_parts(config, ureq::unversioned::transport::DefaultConnector::new(), PublicOnly::default())
    };
    let too_large = |size: u64, room: u64| DownloadError::TooLarge { url: url.to_owned(), size, room };
    let mut file = OpenOptions::new().create(true).read(true).write(true).truncate(false).open(part).map_err(io_err)?;
    let mut have = file.metadata().map_err(io_err)?.len();
    let validator = if have > 0 { fs::read_to_string(validator_path).ok() } else { None };

    // At most two requests: a resume, and a restart from 0 if the resume cannot be used.
    let mut may_restart = have > 0;
    loop {
        let mut req = agent.get(url);
        if have > 0 {
            req = req.header("Range", format!("bytes={have}-"));
            if let Some(v) = &validator {
                // Ranges only if the file is still the one we started; else a 200.
                req = req.header("If-Range", v.trim());
            }
        }
        let mut resp = req.call().map_err(|e| DownloadError::Transport { url: url.to_owned(), source: Box::new(e) })?;
        let status = resp.status().as_u16();
        let header = |name: &str| resp.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let total = match status {
            206 if have > 0 => match header("content-range").as_deref().and_then(parse_content_range) {
                Some((start, total)) if start == have => total,
                // A range that does not start where we are: start over rather than guess.
                _ if may_restart => {
                    may_restart = false;
                    have = restart(&mut file, validator_path).map_err(io_err)?;
                    continue;
                }
                _ => return Err(DownloadError::Status { url: url.to_owned(), status }),
            },
            200 => {
                // The whole file: the server ignored the range (or the file changed, or
                // this is a fresh start). Begin again at 0 and remember what it was.
                have = restart(&mut file, validator_path).map_err(io_err)?;
                if let Some(v) = strong_validator(header("etag"), header("last-modified")) {
                    fs::write(validator_path, v)
                        .map_err(|source| DownloadError::Io { path: validator_path.to_owned(), source })?;
                }
                header("content-length").and_then(|v| v.parse().ok())
            }
            416 if have > 0 => {
                // Nothing at or past our offset: complete if the file is exactly that long.
                match header("content-range").as_deref().and_then(parse_unsatisfied_range) {
                    Some(total) if total == have => return Ok(()),
                    _ if may_restart => {
                        may_restart = false;
                        have = restart(&mut file, validator_path).map_err(io_err)?;
                        continue;
                    }
                    _ => return Err(DownloadError::Status { url: url.to_owned(), status }),
                }
            }
            _ => return Err(DownloadError::Status { url: url.to_owned(), status }),
        };
        if let (Some(t), Some(room)) = (total, room) {
            if t > room {
                return Err(too_large(t, room));
            }
        }
        file.seek(SeekFrom::Start(have)).map_err(io_err)?;
        let resumed_from = have;
        progress(Progress { done: have, total, resumed_from });
        let mut body = resp.body_mut().as_reader();
        let mut buf = vec![0u8; COPY_CHUNK];
        let interrupted = |have: u64, why: String| DownloadError::Interrupted {
            url: url.to_owned(),
            part: part.to_owned(),
            have,
            why,
        };
        loop {
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    file.sync_all().map_err(io_err)?;
                    return Err(interrupted(have, e.to_string()));
                }
            };
            if let Some(room) = room.filter(|r| have + n as u64 > *r) {
                return Err(too_large(have + n as u64, room));
            }
            file.write_all(&buf[..n]).map_err(io_err)?;
            have += n as u64;
            progress(Progress { done: have, total, resumed_from });
        }
        file.sync_all().map_err(io_err)?;
        return match total {
            Some(t) if t != have => Err(interrupted(have, format!("the body ended at {have} of {t} bytes"))),
            _ => Ok(()),
        };
    }
}

/// A resolver that keeps public addresses only: what a client's download may reach.
#[derive(Debug, Default)]
struct PublicOnly(ureq::unversioned::resolver::DefaultResolver);

impl ureq::unversioned::resolver::Resolver for PublicOnly {
    fn resolve(
        &self,
        uri: &ureq::http::Uri,
        config: &ureq::config::Config,
        timeout: ureq::unversioned::transport::NextTimeout,
    ) -> Result<ureq::unversioned::resolver::ResolvedSocketAddrs, ureq::Error> {
        let all = self.0.resolve(uri, config, timeout)?;
        let mut public = self.empty();
        for a in all.iter().filter(|a| is_public(a.ip())) {
            public.push(*a);
        }
        if public.is_empty() {
            let host = uri.host().unwrap_or_default();
            let first = all.first().map_or_else(String::new, |a| format!(" ({})", a.ip()));
            return Err(ureq::Error::Io(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{host}{first} is not a public address: downloads asked over the API go to the Internet only \
                     (a model server on the LAN: shoal serve --allow-private-downloads)"
                ),
            )));
        }
        Ok(public)
    }
}

/// Whether `ip` is a public unicast address: not loopback, private (10/8, 172.16/12,
/// 192.168/16), link-local (169.254/16: cloud metadata too), CGNAT (100.64/10), this
/// network (0/8), benchmarking (198.18/15), reserved (240/4), broadcast or multicast;
/// for IPv6 not loopback, unspecified, unique local (fc00::/7), link-local (fe80::/10),
/// multicast, nor an IPv4 address in an IPv6 one (mapped, NAT64 64:ff9b::/96) that is
/// not public itself.
pub fn is_public(ip: std::net::IpAddr) -> bool {
    use std::net::IpAddr;
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 198 && (b == 18 || b == 19))
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let s = v6.segments();
            if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0, 0, 0, 0] {
                let [.., a, b, c, d] = v6.octets();
                return is_public(IpAddr::V4(std::net::Ipv4Addr::new(a, b, c, d)));
            }
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || s[0..6] == [0, 0, 0, 0, 0, 0])
        }
    }
}

/// Free bytes on the disk holding `dir` (the mount whose path is its longest prefix);
/// none where it cannot be told.
fn free_space(dir: &Path) -> Option<u64> {
    let dir = std::path::absolute(dir).ok()?;
    let disks = sysinfo::Disks::new_with_refreshed_list();
    disks
        .list()
        .iter()
        .filter(|d| dir.starts_with(d.mount_point()))
        .max_by_key(|d| d.mount_point().as_os_str().len())
        .map(sysinfo::Disk::available_space)
}

/// Empty the `.part` (and forget its validator); returns the new length, 0.
fn restart(file: &mut File, validator_path: &Path) -> io::Result<u64> {
    file.set_len(0)?;
    file.seek(SeekFrom::Start(0))?;
    let _ = fs::remove_file(validator_path);
    Ok(0)
}

/// A validator usable in `If-Range`: a strong ETag (weak ones are not allowed there),
/// else Last-Modified.
fn strong_validator(etag: Option<String>, last_modified: Option<String>) -> Option<String> {
    etag.filter(|e| !e.starts_with("W/")).or(last_modified).filter(|v| !v.contains(['\r', '\n']))
}

/// `bytes START-END/TOTAL` → (START, TOTAL if not `*`).
fn parse_content_range(v: &str) -> Option<(u64, Option<u64>)> {
    let rest = v.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (start, _end) = range.split_once('-')?;
    let total = if total == "*" { None } else { Some(total.trim().parse().ok()?) };
    Some((start.trim().parse().ok()?, total))
}

/// `bytes */TOTAL` (a 416's Content-Range) → TOTAL.
fn parse_unsatisfied_range(v: &str) -> Option<u64> {
    v.trim().strip_prefix("bytes */")?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_public_unicast_addresses_are_public() {
        for ip in ["8.8.8.8", "1.1.1.1", "2606:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808", "100.128.0.1"] {
            assert!(is_public(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.20",
            "169.254.169.254",
            "100.64.0.1",
            "100.127.255.255",
            "0.0.0.0",
            "0.1.2.3",
            "255.255.255.255",
            "224.0.0.251",
            "198.18.0.1",
            "240.0.0.1",
            "::1",
            "::",
            "fc00::1",
            "fd00:ec2::254",
            "fe80::1",
            "ff02::fb",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "64:ff9b::a00:1",
            "::127.0.0.1",
        ] {
            assert!(!is_public(ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn hf_urls_map_to_the_resolve_endpoint_with_main_or_the_revision() {
        let r = resolve_url("hf://bartowski/Llama-3.2-1B-Instruct-GGUF/Llama-3.2-1B-Instruct-Q4_K_M.gguf").unwrap();
        assert_eq!(
            r.url,
            "https://huggingface.co/bartowski/Llama-3.2-1B-Instruct-GGUF/resolve/main/Llama-3.2-1B-Instruct-Q4_K_M.gguf"
        );
        assert_eq!(r.file_name, "Llama-3.2-1B-Instruct-Q4_K_M.gguf");
        assert_eq!(r.name, "bartowski/Llama-3.2-1B-Instruct-GGUF/Llama-3.2-1B-Instruct-Q4_K_M.gguf");
        let r = resolve_url("hf://org/repo@abc123/sub/dir/m.gguf").unwrap();
        assert_eq!(r.url, "https://huggingface.co/org/repo/resolve/abc123/sub/dir/m.gguf");
        assert_eq!((r.file_name.as_str(), r.name.as_str()), ("m.gguf", "org/repo@abc123/sub/dir/m.gguf"));
    }

    #[test]
    fn bad_urls_are_refused_before_any_request() {
        for url in [
            "hf://org",
            "hf://org/repo",
            "hf://org/repo/../x.gguf",
            "hf://org//x.gguf",
            "ftp://h/x.gguf",
            "https://host",
            "https://host/dir/",
            "http://h/a:b",
        ] {
            assert!(matches!(resolve_url(url), Err(DownloadError::BadUrl { .. })), "{url}");
        }
        let r = resolve_url("https://example.com/m/x.gguf?download=true").unwrap();
        assert_eq!(r.file_name, "x.gguf");
    }

    #[test]
    fn content_ranges_parse_and_weak_etags_are_not_validators() {
        assert_eq!(parse_content_range("bytes 100-199/200"), Some((100, Some(200))));
        assert_eq!(parse_content_range("bytes 100-199/*"), Some((100, None)));
        assert_eq!(parse_content_range("items 1-2/3"), None);
        assert_eq!(parse_unsatisfied_range("bytes */200"), Some(200));
        assert_eq!(strong_validator(Some("W/\"x\"".into()), None), None);
        assert_eq!(strong_validator(Some("\"x\"".into()), Some("d".into())), Some("\"x\"".into()));
        assert_eq!(strong_validator(None, Some("Tue, 01 Jan 2030".into())), Some("Tue, 01 Jan 2030".into()));
    }
}
