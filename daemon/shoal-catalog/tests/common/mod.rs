//! Test fixtures: the cached real model, a copy of it in a temp folder, and a tiny
//! HTTP/1.1 file server on 127.0.0.1 that can honour or ignore `Range`, check
//! `If-Range`, and cut a response short, logging what it meant to send.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The cached test model (scripts/setup.sh); fails with instructions when missing.
pub fn real_model() -> PathBuf {
    let p = shoal_gguf::models_dir().join(SMOL);
    assert!(p.exists(), "test model {} is missing: run scripts/setup.sh (or set SHOAL_MODELS)", p.display());
    p
}

/// Put the real model at `dest`: a hard link where the file system allows (no 98 MB
/// copy), else a copy. Only for tests that never write to `dest`.
pub fn link_model(dest: &Path) {
    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
    if std::fs::hard_link(real_model(), dest).is_err() {
        std::fs::copy(real_model(), dest).unwrap();
    }
}

/// A private, writable copy of the real model.
pub fn copy_model(dest: &Path) {
    std::fs::copy(real_model(), dest).unwrap();
}

/// What the server did with one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Served {
    /// The `Range: bytes=N-` start the client asked for.
    pub range_from: Option<u64>,
    /// The `If-Range` it sent.
    pub if_range: Option<String>,
    /// The status answered.
    pub status: u16,
    /// Body bytes the server set out to send (all of them unless cut).
    pub body_bytes: u64,
}

/// How the server behaves; tests change it between requests.
#[derive(Clone, Debug, Default)]
pub struct Behaviour {
    /// Close the connection after this many body bytes, on the next request only.
    pub cut_next_after: Option<u64>,
    /// Answer 200 with the whole file whatever `Range` says.
    pub ignore_range: bool,
    /// The file's ETag (sent with every answer, compared with `If-Range`).
    pub etag: String,
    /// Answer 404 to everything.
    pub not_found: bool,
}

pub struct Server {
    pub addr: SocketAddr,
    pub behaviour: Arc<Mutex<Behaviour>>,
    pub log: Arc<Mutex<Vec<Served>>>,
}

impl Server {
    /// Serve `file` at every path. The accept thread lives until the test process ends
    /// (a blocked `accept` cannot be interrupted portably; tests are short).
    pub fn start(file: PathBuf) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let behaviour = Arc::new(Mutex::new(Behaviour { etag: "\"v1\"".into(), ..Behaviour::default() }));
        let log = Arc::new(Mutex::new(Vec::new()));
        let (b, l) = (behaviour.clone(), log.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                // One connection at a time: the client makes one request at a time.
                let _ = serve(stream, &file, &b, &l);
            }
        });
        Server { addr, behaviour, log }
    }

    pub fn url(&self, name: &str) -> String {
        format!("http://{}/models/{name}", self.addr)
    }

    pub fn log(&self) -> Vec<Served> {
        self.log.lock().unwrap().clone()
    }
}

fn serve(
    stream: TcpStream,
    file: &Path,
    behaviour: &Mutex<Behaviour>,
    log: &Mutex<Vec<Served>>,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut range_from = None;
    let mut if_range = None;
    let mut line = String::new();
    reader.read_line(&mut line)?; // request line; every path serves the file
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        let (name, value) = line.split_once(':').unwrap_or((&line, ""));
        let value = value.trim().to_owned();
        match name.to_ascii_lowercase().as_str() {
            "range" => {
                range_from = value.strip_prefix("bytes=").and_then(|r| r.strip_suffix('-')).and_then(|n| n.parse().ok())
            }
            "if-range" => if_range = Some(value),
            _ => {}
        }
    }
    let (cut, b) = {
        let mut b = behaviour.lock().unwrap();
        (b.cut_next_after.take(), b.clone())
    };
    let len = std::fs::metadata(file)?.len();
    let mut out = stream;
    let honour = range_from.is_some() && !b.ignore_range && if_range.as_deref().is_none_or(|v| v == b.etag);
    let (status, head, start) = if b.not_found {
        (404, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n".to_owned(), len)
    } else if let (true, Some(from)) = (honour, range_from) {
        if from >= len {
            let head =
                format!("HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */{len}\r\nContent-Length: 0\r\n");
            (416, head, len)
        } else {
            let head = format!(
                "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {from}-{}/{len}\r\nContent-Length: {}\r\nETag: {}\r\n",
                len - 1,
                len - from,
                b.etag
            );
            (206, head, from)
        }
    } else {
        (200, format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nETag: {}\r\n", b.etag), 0)
    };
    let body_bytes = cut.map_or(len - start, |c| c.min(len - start));
    // Logged before the body goes out: the client may finish reading before this
    // thread returns from its last write.
    log.lock().unwrap().push(Served { range_from, if_range, status, body_bytes });
    out.write_all(format!("{head}Connection: close\r\n\r\n").as_bytes())?;
    let mut f = std::fs::File::open(file)?;
    f.seek(SeekFrom::Start(start))?;
    std::io::copy(&mut f.take(body_bytes), &mut out)?;
    out.flush()?;
    out.shutdown(Shutdown::Both)
}
