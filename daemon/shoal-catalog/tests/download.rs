//! download() against a local HTTP server (127.0.0.1, port chosen by the OS): a whole
//! file, a transfer cut mid-way then resumed where it stopped, a server that ignores
//! ranges, a remote file that changed between attempts, and files that must be refused.

mod common;

use common::{real_model, Served, Server, SMOL};
use shoal_catalog::{download, hash_file, CatalogError, DownloadError, Progress};
use std::fs;
use std::path::Path;

fn model_len() -> u64 {
    fs::metadata(real_model()).unwrap().len()
}

/// Names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    v.sort();
    v
}

#[test]
fn download_fetches_the_whole_file_and_describes_it() {
    let server = Server::start(real_model());
    let dest = tempfile::tempdir().unwrap();
    let mut last = None;
    let got = download(&server.url(SMOL), dest.path(), &mut |p| last = Some(p)).unwrap();
    assert_eq!(got.path, dest.path().join(SMOL));
    assert_eq!(got.described.entry.content_hash, hash_file(&real_model()).unwrap());
    assert_eq!(got.described.entry.name, SMOL);
    assert_eq!(got.described.holder.path, got.path.to_str().unwrap());
    assert_eq!(last, Some(Progress { done: model_len(), total: Some(model_len()), resumed_from: 0 }));
    // No .part or validator left behind.
    assert_eq!(listing(dest.path()), [SMOL]);
    assert_eq!(server.log(), [Served { range_from: None, if_range: None, status: 200, body_bytes: model_len() }]);
}

#[test]
fn a_download_cut_mid_way_resumes_where_it_stopped() {
    let server = Server::start(real_model());
    let cut = 10 << 20;
    server.behaviour.lock().unwrap().cut_next_after = Some(cut);
    let dest = tempfile::tempdir().unwrap();
    let url = server.url(SMOL);

    let err = download(&url, dest.path(), &mut |_| {}).unwrap_err();
    let DownloadError::Interrupted { part, have, .. } = err else { panic!("expected an interruption: {err:?}") };
    assert!(have > 0 && have <= cut, "{have}");
    assert_eq!(fs::metadata(&part).unwrap().len(), have);
    assert!(!dest.path().join(SMOL).exists(), "an incomplete file never takes the final name");

    let mut first = None;
    let got = download(&url, dest.path(), &mut |p| {
        first.get_or_insert(p);
    })
    .unwrap();
    assert_eq!(first.unwrap().resumed_from, have);
    assert_eq!(got.described.entry.content_hash, hash_file(&real_model()).unwrap());
    let log = server.log();
    assert_eq!(log.len(), 2);
    // The second request asked for the rest only, tied to the first answer's ETag, and
    // only the remainder was sent again.
    assert_eq!(
        log[1],
        Served { range_from: Some(have), if_range: Some("\"v1\"".into()), status: 206, body_bytes: model_len() - have }
    );
    assert_eq!(listing(dest.path()), [SMOL]);
}

#[test]
fn a_server_that_ignores_range_makes_the_download_start_over() {
    let server = Server::start(real_model());
    {
        let mut b = server.behaviour.lock().unwrap();
        b.cut_next_after = Some(1 << 20);
        b.ignore_range = true;
    }
    let dest = tempfile::tempdir().unwrap();
    let url = server.url(SMOL);
    assert!(matches!(download(&url, dest.path(), &mut |_| {}), Err(DownloadError::Interrupted { .. })));
    let mut first = None;
    let got = download(&url, dest.path(), &mut |p| {
        first.get_or_insert(p);
    })
    .unwrap();
    // The whole body came back (200), and the file was rewritten from byte 0, not
    // appended to what was there.
    assert_eq!(first.unwrap().resumed_from, 0);
    assert_eq!(server.log()[1].status, 200);
    assert!(server.log()[1].range_from.is_some());
    assert_eq!(fs::metadata(&got.path).unwrap().len(), model_len());
    assert_eq!(got.described.entry.content_hash, hash_file(&real_model()).unwrap());
}

#[test]
fn a_remote_file_that_changed_between_attempts_is_fetched_again_whole() {
    let server = Server::start(real_model());
    server.behaviour.lock().unwrap().cut_next_after = Some(1 << 20);
    let dest = tempfile::tempdir().unwrap();
    let url = server.url(SMOL);
    assert!(download(&url, dest.path(), &mut |_| {}).is_err());
    // Upstream publishes a new version: the old bytes must not be spliced onto it.
    server.behaviour.lock().unwrap().etag = "\"v2\"".into();
    download(&url, dest.path(), &mut |_| {}).unwrap();
    let second = &server.log()[1];
    assert_eq!((second.if_range.as_deref(), second.status, second.body_bytes), (Some("\"v1\""), 200, model_len()));
}

#[test]
fn a_complete_part_file_is_finished_without_fetching_the_body_again() {
    let server = Server::start(real_model());
    let dest = tempfile::tempdir().unwrap();
    fs::copy(real_model(), dest.path().join(format!("{SMOL}.part"))).unwrap();
    let got = download(&server.url(SMOL), dest.path(), &mut |_| {}).unwrap();
    assert_eq!(got.described.entry.size, model_len());
    assert_eq!(server.log()[0].status, 416);
    assert_eq!(listing(dest.path()), [SMOL]);
}

#[test]
fn a_downloaded_non_gguf_file_is_refused_and_deleted() {
    let src = tempfile::tempdir().unwrap();
    let page = src.path().join("page.html");
    fs::write(&page, "<html>Access denied</html>").unwrap();
    let server = Server::start(page);
    let dest = tempfile::tempdir().unwrap();
    let err = download(&server.url("model.gguf"), dest.path(), &mut |_| {}).unwrap_err();
    assert!(matches!(err, DownloadError::Refused(CatalogError::NotGguf { .. })), "{err:?}");
    assert!(listing(dest.path()).is_empty(), "{:?}", listing(dest.path()));
}

#[test]
fn a_missing_remote_file_reports_the_http_status() {
    let server = Server::start(real_model());
    server.behaviour.lock().unwrap().not_found = true;
    let dest = tempfile::tempdir().unwrap();
    let err = download(&server.url(SMOL), dest.path(), &mut |_| {}).unwrap_err();
    assert!(matches!(err, DownloadError::Status { status: 404, .. }), "{err:?}");
    assert!(!dest.path().join(SMOL).exists());
}

#[test]
fn download_never_overwrites_an_existing_file() {
    let server = Server::start(real_model());
    let dest = tempfile::tempdir().unwrap();
    fs::write(dest.path().join(SMOL), "mine").unwrap();
    let err = download(&server.url(SMOL), dest.path(), &mut |_| {}).unwrap_err();
    assert!(matches!(err, DownloadError::Exists(_)), "{err:?}");
    assert_eq!(fs::read(dest.path().join(SMOL)).unwrap(), b"mine");
    assert!(server.log().is_empty(), "refused before any request");
}

/// Security review F6: a download a client asked for (`Limits::for_clients`) reaches
/// public addresses only, whatever the URL names (an address, a name that resolves to
/// loopback); the owner's reaches the LAN; and a file larger than the disk's room is
/// refused from its announced size, leaving nothing behind.
#[test]
fn a_clients_download_reaches_public_addresses_only_and_fits_the_disk() {
    use shoal_catalog::{download_within, Limits};
    let server = Server::start(real_model());
    let dest = tempfile::tempdir().unwrap();
    let port = server.addr.port();
    for url in [server.url(SMOL), format!("http://localhost:{port}/{SMOL}"), format!("http://[::1]:{port}/{SMOL}")] {
        let err = download_within(&url, dest.path(), &mut |_| {}, Limits::for_clients(false)).unwrap_err();
        assert!(err.to_string().contains("not a public address"), "{url}: {err}");
    }
    assert!(server.log().is_empty(), "a request reached the private server");
    assert!(listing(dest.path()).is_empty(), "{:?}", listing(dest.path()));
    // The node's setting for a LAN model server, and the owner's own downloads, reach it.
    download_within(&server.url(SMOL), dest.path(), &mut |_| {}, Limits::for_clients(true)).unwrap();
    assert_eq!(listing(dest.path()), [SMOL]);

    // A server announcing a petabyte.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        if let Ok((mut s, _)) = listener.accept() {
            let mut buf = [0u8; 4096];
            let _ = std::io::Read::read(&mut s, &mut buf);
            let _ = std::io::Write::write_all(&mut s, b"HTTP/1.1 200 OK\r\nContent-Length: 1125899906842624\r\n\r\n");
        }
    });
    let other = tempfile::tempdir().unwrap();
    let err = download(&format!("http://{addr}/huge.gguf"), other.path(), &mut |_| {}).unwrap_err();
    assert!(matches!(err, DownloadError::TooLarge { size: 1125899906842624, .. }), "{err}");
    assert!(listing(other.path()).is_empty(), "{:?}", listing(other.path()));
}
