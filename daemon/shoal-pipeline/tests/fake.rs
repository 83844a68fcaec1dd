//! The pipeline on a deterministic fake engine, three nodes on 127.0.0.1 in one
//! process: the tokens and logits digest equal those of the same stages run in order
//! in-process; a stage refuses what it cannot run and the client gets the error; a
//! client that stops reading is cut off without slowing anyone else.

use shoal_net::{Identity, Node, TransportOptions, TrustedKeys};
use shoal_pipeline::{generate, serve, GenerateRequest, Placement, SamplerFactory, ServiceConfig, StagePlace};
mod common;
use common::*;
use shoal_types::{LayerRange, TokenId, TokenSampler};
use std::sync::Arc;

/// Start one node per range; returns the placement, a client node and the nodes' identities.
async fn start_with_ids(ranges: &[LayerRange]) -> (Placement, Node, Vec<Arc<Identity>>) {
    start_full(ranges, None).await
}

/// [`start_with_ids`] with every node's keep-alive set to `keepalive`.
async fn start_full(
    ranges: &[LayerRange],
    keepalive: Option<std::time::Duration>,
) -> (Placement, Node, Vec<Arc<Identity>>) {
    start_custom(ranges, keepalive, 256, &[]).await
}

/// [`start_full`] with `n_ctx` positions per session, also trusting the `extra` keys.
async fn start_custom(
    ranges: &[LayerRange],
    keepalive: Option<std::time::Duration>,
    n_ctx: u32,
    extra: &[shoal_net::NodeId],
) -> (Placement, Node, Vec<Arc<Identity>>) {
    let ids: Vec<Arc<Identity>> = ranges.iter().map(|_| Arc::new(Identity::generate().unwrap())).collect();
    let client = Identity::generate().unwrap();
    let mut trusted: Vec<_> = ids.iter().map(|i| i.id()).collect();
    trusted.push(client.id());
    trusted.extend_from_slice(extra);
    let nodes: Vec<Arc<Node>> = ids
        .iter()
        .map(|i| {
            Arc::new(
                Node::bind(
                    "127.0.0.1:0".parse().unwrap(),
                    i.clone(),
                    TrustedKeys::new(trusted.clone()),
                    &TransportOptions::default(),
                )
                .unwrap(),
            )
        })
        .collect();
    let placement = Placement {
        model: "unused.gguf".into(),
        context: 256,
        chunk: CHUNK,
        sessions: 4,
        stages: ranges
            .iter()
            .zip(&nodes)
            .map(|(r, n)| StagePlace { node: n.id(), addr: n.local_addr().unwrap(), layers: *r })
            .collect(),
        clients: vec![client.id()],
    };
    let samplers: SamplerFactory = Arc::new(|_: &serde_json::Value| Ok(Box::new(Greedy) as Box<dyn TokenSampler>));
    for (i, node) in nodes.into_iter().enumerate() {
        let cfg = ServiceConfig {
            placement: placement.clone(),
            index: i,
            stage: Box::new(FakeStage::with_context(ranges[i], n_ctx)),
            samplers: samplers.clone(),
            dtype: shoal_net::Dtype::F32,
            retry: shoal_pipeline::RetryPolicy::default(),
            drafts: None,
            keepalive,
            addresses: None,
        };
        tokio::spawn(serve(node, cfg));
    }
    let client = Node::bind(
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(client),
        TrustedKeys::new(trusted),
        &TransportOptions::default(),
    )
    .unwrap();
    (placement, client, ids)
}

/// Waits until every stage's start has been taken in by its neighbours
/// (`NodeStatus::start_announced`). Until then a start announcement may still renew a
/// link or re-drive a generation already running, which passes its current step
/// round the ring again: harmless, but a test that counts frames must not see it.
async fn settled(client: &Node, placement: &Placement) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    for place in &placement.stages {
        loop {
            if shoal_pipeline::status(client, place).await.is_ok_and(|st| st.start_announced) {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "stage {} never announced its start", place.node);
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
}

async fn start(ranges: &[LayerRange]) -> (Placement, Node) {
    let (p, c, _) = start_with_ids(ranges).await;
    (p, c)
}

fn request(prompt: &[TokenId], max_new: u32) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.to_vec(),
        max_new,
        stop: vec![],
        sampling: serde_json::json!({}),
        resume: vec![],
        speculative: None,
        tag: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_match_in_process_stages() {
    let ranges = [LayerRange::new(0, 2), LayerRange::new(2, 4), LayerRange::new(4, 6)];
    let (placement, client) = start(&ranges).await;
    let prompt: Vec<TokenId> = (0..11).map(|i| (i * 7 % 50) as TokenId).collect();
    let (want_tokens, want_digest) = reference(&ranges, &prompt, 40);
    let mut streamed = Vec::new();
    let report = generate(&client, &placement.stages[0], &request(&prompt, 40), |t, _| streamed.push(t)).await.unwrap();
    assert_eq!(report.tokens, want_tokens);
    assert_eq!(streamed, want_tokens);
    assert_eq!(report.logits_digest, want_digest);

    // Two generations at once on the same nodes: each still matches.
    let other: Vec<TokenId> = (0..6).map(|i| (i * 3 % 50) as TokenId).collect();
    let (ra, rb) = (request(&prompt, 20), request(&other, 20));
    let (a, b) = tokio::join!(
        generate(&client, &placement.stages[0], &ra, |_, _| {}),
        generate(&client, &placement.stages[0], &rb, |_, _| {})
    );
    assert_eq!(a.unwrap().tokens, reference(&ranges, &prompt, 20).0);
    assert_eq!(b.unwrap().tokens, reference(&ranges, &other, 20).0);
}

/// Every node times its share of each decode step and the coordinator the step
/// interval; `TokenBreakdown` adds them up round the ring. Counts are exact (one
/// generation, no faults); times only have to be there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_steps_time_is_broken_down_round_the_ring() {
    let ranges = [LayerRange::new(0, 2), LayerRange::new(2, 4), LayerRange::new(4, 6)];
    let (placement, client) = start(&ranges).await;
    // The counts below are exact: no start announcement may re-drive the generation.
    settled(&client, &placement).await;
    let prompt: Vec<TokenId> = (0..11).map(|i| (i * 7 % 50) as TokenId).collect();
    let report = generate(&client, &placement.stages[0], &request(&prompt, 40), |_, _| {}).await.unwrap();
    assert_eq!(report.tokens.len(), 40);
    let mut ring = Vec::new();
    for place in &placement.stages {
        ring.push(shoal_pipeline::status(&client, place).await.unwrap());
    }
    // The prompt's last chunk gives the first token; 39 decode steps the others.
    for (i, st) in ring.iter().enumerate() {
        let d = &st.decode_times;
        assert_eq!((d.compute.n, d.core_out.n), (39, 39), "stage {i}: {d:?}");
        // Each step's compute is also timed on the thread's CPU clock (Unix).
        assert_eq!(d.compute_cpu.n, if cfg!(unix) { 39 } else { 0 }, "stage {i}: {d:?}");
        let tail = i == ring.len() - 1;
        // Steps' frames in: hidden states of each step, or at the coordinator the
        // tail's tokens (the prompt's first one too); as many sent on.
        let (frames_in, frames_out) = match i {
            0 => (40, 39),
            _ if tail => (39, 40),
            _ => (39, 39),
        };
        assert_eq!((d.hop_in.n, d.receive_wait.n, d.core_in.n), (frames_in, frames_in, frames_in), "stage {i}: {d:?}");
        assert_eq!((d.send_wait.n, d.write.n), (frames_out, frames_out), "stage {i}: {d:?}");
        assert!(d.compute.mean_us > 0.0 && d.hop_in.mean_us > 0.0, "stage {i}: {d:?}");
        // The admin page's figure for the stage (compute per decode step) is the
        // breakdown's compute per step, in ms: the same 39 steps, timed around the same
        // call (a figure divided by the steps again, or in µs, is 39 or 1000 times off).
        let page = st.compute_ms_per_step().expect("steps were timed");
        let breakdown = d.compute.mean_us / 1000.0;
        assert!((page - breakdown).abs() <= 0.05 * breakdown, "stage {i}: page {page} ms, breakdown {breakdown} ms");
    }
    let coordinator = &ring[0].decode_times;
    assert_eq!((coordinator.interval.n, coordinator.client_write.n), (38, 40), "{coordinator:?}");
    let b = shoal_pipeline::TokenBreakdown::of(&ring).unwrap();
    assert_eq!(b.steps, 38);
    // Four parts per stage (five where compute splits into its thread on and off the
    // CPU), four per hop.
    let per_stage = if cfg!(unix) { 5 } else { 4 };
    assert_eq!(b.parts.len(), per_stage * 3 + 4 * 3, "{b:?}");
    assert!(b.parts.iter().all(|p| p.us >= 0.0 && p.us.is_finite()), "{b:?}");
    assert!(b.interval_us > b.compute_us() && b.compute_us() > 0.0 && b.unexplained_us.is_finite(), "{b:?}");
    assert_eq!(b.lines().len(), 3 + b.parts.len() + 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_the_sessions_queue_in_order_and_past_the_queue_are_refused_as_busy() {
    let ranges = [LayerRange::new(0, 2), LayerRange::new(2, 4), LayerRange::new(4, 6)];
    // Each stage holds 4 sessions (FakeStage), so the coordinator admits 4 at once and
    // queues QUEUE_PER_SESSION × 4 more.
    let (placement, client, _) = start_custom(&ranges, None, 4096, &[]).await;
    let client = Arc::new(client);
    let coord = placement.stages[0].clone();
    let queue = shoal_pipeline::QUEUE_PER_SESSION * 4;
    let prompt = |i: usize| -> Vec<TokenId> { (0..5 + i).map(|k| ((k * 7 + i * 3) % 50) as TokenId).collect() };
    // Four long generations hold every session …
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel();
    let mut long = Vec::new();
    for i in 0..4 {
        let (client, coord, started_tx) = (client.clone(), coord.clone(), started_tx.clone());
        long.push(tokio::spawn(async move {
            let mut first = true;
            generate(&client, &coord, &request(&prompt(i), 4000), |_, _| {
                if std::mem::take(&mut first) {
                    let _ = started_tx.send(());
                }
            })
            .await
        }));
    }
    for _ in 0..4 {
        started.recv().await.unwrap();
    }
    // … the next ones wait for one …
    let mut queued = Vec::new();
    for i in 4..4 + queue {
        let (client, coord) = (client.clone(), coord.clone());
        queued.push(tokio::spawn(async move { generate(&client, &coord, &request(&prompt(i), 20), |_, _| {}).await }));
    }
    let t0 = std::time::Instant::now();
    loop {
        let st = shoal_pipeline::status(&client, &coord).await.unwrap();
        assert_eq!(st.sessions, 4, "the long generations hold every session: {st:?}");
        if st.waiting == queue {
            break;
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(20), "the queue did not fill: {st:?}");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // … and one more is refused at once, saying why.
    match generate(&client, &coord, &request(&prompt(99), 20), |_, _| {}).await {
        Err(shoal_pipeline::PipelineError::Busy(why)) => assert!(why.contains("busy"), "{why}"),
        other => panic!("past the queue: {other:?}"),
    }
    // Everyone admitted gets exactly its solo answer.
    for (i, h) in long.into_iter().enumerate() {
        assert_eq!(h.await.unwrap().unwrap().tokens, reference(&ranges, &prompt(i), 4000).0, "long {i}");
    }
    for (i, h) in queued.into_iter().enumerate() {
        assert_eq!(h.await.unwrap().unwrap().tokens, reference(&ranges, &prompt(i + 4), 20).0, "queued {i}");
    }
    let st = shoal_pipeline::status(&client, &coord).await.unwrap();
    assert_eq!((st.sessions, st.waiting), (0, 0), "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keepalive_spins_while_generating_then_stops_and_changes_no_output() {
    let ranges = [LayerRange::new(0, 2), LayerRange::new(2, 4), LayerRange::new(4, 6)];
    // Long enough that the status calls right after the generation fall inside it even
    // on two cores the rest of the suite keeps busy (1.5 s was not).
    let window = std::time::Duration::from_secs(8);
    let (placement, client, _) = start_full(&ranges, Some(window)).await;
    let prompt: Vec<TokenId> = (0..11).map(|i| (i * 5 % 50) as TokenId).collect();
    let report = generate(&client, &placement.stages[0], &request(&prompt, 30), |_, _| {}).await.unwrap();
    assert_eq!((report.tokens, report.logits_digest), reference(&ranges, &prompt, 30));
    // Every node reports keep-alive on and spins right after the generation; none
    // spins once the window after its last frame has passed (status requests do not
    // count as activity).
    for place in &placement.stages {
        let st = shoal_pipeline::status(&client, place).await.unwrap();
        assert!(st.keepalive && st.keepalive_spinning, "{st:?}");
    }
    for place in &placement.stages {
        let mut st = shoal_pipeline::status(&client, place).await.unwrap();
        // Awaited, not slept for: polled until it stops, for up to ten windows.
        for _ in 0..400 {
            if !st.keepalive_spinning {
                break;
            }
            tokio::time::sleep(window / 40).await;
            st = shoal_pipeline::status(&client, place).await.unwrap();
        }
        assert!(!st.keepalive_spinning, "still spinning long after the generation: {st:?}");
    }
    // Without keep-alive, nodes say so.
    let (placement, client, _) = start_full(&ranges[..1], None).await;
    assert!(!shoal_pipeline::status(&client, &placement.stages[0]).await.unwrap().keepalive);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_placement_works() {
    let ranges = [LayerRange::new(0, 6)];
    let (placement, client) = start(&ranges).await;
    let prompt: Vec<TokenId> = (0..9).collect();
    let report = generate(&client, &placement.stages[0], &request(&prompt, 12), |_, _| {}).await.unwrap();
    assert_eq!((report.tokens, report.logits_digest), reference(&ranges, &prompt, 12));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_cannot_run_fail_clearly() {
    let ranges = [LayerRange::new(0, 3), LayerRange::new(3, 6)];
    let (placement, client) = start(&ranges).await;
    let e = generate(&client, &placement.stages[0], &request(&[1; 250], 10), |_, _| {}).await.unwrap_err();
    assert!(e.to_string().contains("exceeds the context"), "{e}");
    let e = generate(&client, &placement.stages[0], &request(&[], 10), |_, _| {}).await.unwrap_err();
    assert!(e.to_string().contains("empty prompt"), "{e}");
    // A client whose key is not in the placement cannot connect at all.
    let stranger = Node::bind(
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(Identity::generate().unwrap()),
        TrustedKeys::new(placement.trusted()),
        &TransportOptions::default(),
    )
    .unwrap();
    let r = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        generate(&stranger, &placement.stages[0], &request(&[1, 2], 2), |_, _| {}),
    )
    .await;
    assert!(matches!(r, Ok(Err(_))), "an unknown key got an answer: {r:?}");
    // The pipeline still works for trusted clients afterwards.
    assert!(generate(&client, &placement.stages[0], &request(&[1, 2, 3], 3), |_, _| {}).await.is_ok());
}

/// Sampling parameters come from the network: a huge `repeat_last_n` (which would make
/// llama.cpp's penalties sampler allocate gigabytes) and other out-of-range values are
/// refused at the coordinator, and the client reads why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_repeat_last_n_is_refused_and_the_client_is_told() {
    let ranges = [LayerRange::new(0, 3), LayerRange::new(3, 6)];
    let (placement, client) = start(&ranges).await;
    let mut req = request(&[1, 2, 3], 4);
    req.sampling = serde_json::json!({"repeat_penalty": 1.1, "repeat_last_n": i32::MAX});
    let e = generate(&client, &placement.stages[0], &req, |_, _| {}).await.unwrap_err();
    assert!(e.to_string().contains("repeat_last_n 2147483647 is outside 0 (off) ..= 65536"), "{e}");
    req.sampling = serde_json::json!({"top_p": 2.0});
    let e = generate(&client, &placement.stages[0], &req, |_, _| {}).await.unwrap_err();
    assert!(e.to_string().contains("top_p 2 is outside [0, 1]"), "{e}");
    // The pipeline still serves sane requests afterwards.
    req.sampling = serde_json::json!({"repeat_penalty": 1.1, "repeat_last_n": 65536});
    assert!(generate(&client, &placement.stages[0], &req, |_, _| {}).await.is_ok());
}

/// Even the previous stage's own key cannot derail a session: malformed frames (bad
/// length, bad dtype, garbage), frames for unknown sessions and stale epochs are
/// dropped or answered, and the generation running meanwhile is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_bad_frames_do_not_disturb_a_session() {
    use shoal_net::{alpn, Dtype, Frame, FrameKind};
    let ranges = [LayerRange::new(0, 2), LayerRange::new(2, 4), LayerRange::new(4, 6)];
    let (placement, client, ids) = start_with_ids(&ranges).await;
    // An injector holding stage 0's key, talking to stage 1 as stage 0 does.
    let injector = Node::bind(
        "127.0.0.1:0".parse().unwrap(),
        ids[0].clone(),
        TrustedKeys::new(placement.trusted()),
        &TransportOptions::default(),
    )
    .unwrap();
    let conn = injector.connect(placement.stages[1].addr, placement.stages[1].node, alpn::PIPELINE).await.unwrap();
    let mut tx = conn.open_uni().await.unwrap();
    let send = |bytes: Vec<u8>| {
        let mut b = (bytes.len() as u32).to_le_bytes().to_vec();
        b.extend(bytes);
        b
    };
    let prompt: Vec<TokenId> = (0..23).map(|i| (i * 5 % 50) as TokenId).collect();
    let (want, digest) = reference(&ranges, &prompt, 60);
    let req = request(&prompt, 60);
    let gen = generate(&client, &placement.stages[0], &req, |_, _| {});
    let inject = async {
        for i in 0..200u32 {
            let good = Frame::hidden(u64::from(i), 0, 0, 0, &[0.5; N_EMBD as usize], N_EMBD, Dtype::F32);
            let mut wrong_len = good.encode();
            wrong_len.truncate(wrong_len.len() - 4);
            let mut bad_dtype = good.encode();
            bad_dtype[28] = 9;
            let garbage: Vec<u8> = (0..64).map(|b| (b * 37 + i) as u8).collect();
            // An unknown session, and a stale epoch for whatever session is running.
            let unknown =
                Frame::hidden(u64::MAX - u64::from(i), 3, 0, 0, &[0.1; N_EMBD as usize], N_EMBD, Dtype::F32).encode();
            let stale = Frame::message(FrameKind::Close, 1 << 32 | 1, 0, 0, vec![]).encode();
            for bytes in [wrong_len, bad_dtype, garbage, unknown, stale] {
                if tx.write_all(&send(bytes)).await.is_err() {
                    return;
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    };
    let (report, ()) = tokio::join!(gen, inject);
    let report = report.unwrap();
    assert_eq!(report.tokens, want);
    assert_eq!(report.logits_digest, digest);
    // The sender is told: refusals come back on the same connection (the first 16).
    let mut refusal = conn.accept_uni().await.expect("a refusal stream");
    let bytes = refusal.read_to_end(1 << 16).await.unwrap();
    let f =
        Frame::decode(&bytes[4..], &shoal_net::FrameLimits { n_embd: 1, max_tokens: 1, max_message: 1 << 16 }).unwrap();
    assert_eq!(f.kind, FrameKind::Error);
    assert!(String::from_utf8_lossy(&f.payload).contains("malformed frame rejected"), "{f:?}");
    // The refusals are counted where they happened.
    let st = shoal_pipeline::status(&client, &placement.stages[1]).await.unwrap();
    assert_eq!(st.malformed_frames, 600, "{st:?}"); // wrong length, bad dtype, garbage: 3 × 200
    assert!(st.counters.lost_reported >= 200, "{st:?}");
    let coordinator = shoal_pipeline::status(&client, &placement.stages[0]).await.unwrap();
    assert_eq!(coordinator.sessions, 0, "finished sessions are freed: {coordinator:?}");
}

/// A control client with a QUIC stack of its own whose stream receive window is 64
/// bytes: what the coordinator writes to it blocks after a few events unless it reads,
/// as with any client that stops reading (a default window would take ~100k events).
mod raw_client {
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
    use rustls::{DigitallySignedStruct, SignatureScheme};
    use shoal_net::NodeId;
    use std::sync::Arc;

    /// Accepts whichever coordinator answers: this test is about the coordinator.
    #[derive(Debug)]
    struct AnyServer;
    impl ServerCertVerifier for AnyServer {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            Ok(HandshakeSignatureValid::assertion())
        }
        fn verify_tls13_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            Ok(HandshakeSignatureValid::assertion())
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            vec![SignatureScheme::ED25519]
        }
    }

    /// A client key (to be trusted by the nodes) and an endpoint presenting it.
    pub fn tiny_window_client() -> (NodeId, quinn::Endpoint) {
        let kp = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
        let id = NodeId(kp.public_key_raw().try_into().unwrap());
        let cert = rcgen::CertificateParams::new(vec!["shoal".to_string()]).unwrap().self_signed(&kp).unwrap();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(kp.serialize_der()));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyServer))
            .with_client_auth_cert(vec![cert.der().clone()], key)
            .unwrap();
        tls.alpn_protocols = vec![shoal_net::alpn::CONTROL.to_vec()];
        let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
        let mut config = quinn::ClientConfig::new(Arc::new(quic));
        let mut transport = quinn::TransportConfig::default();
        transport.stream_receive_window(quinn::VarInt::from_u32(64));
        config.transport_config(Arc::new(transport));
        let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        endpoint.set_default_client_config(config);
        (id, endpoint)
    }
}

/// Client A asks for a long generation and never reads its stream; client B generates
/// meanwhile. The coordinator must never wait for A: B completes with exactly its
/// tokens, A is cut off (its stream reset) and its session freed on every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_cannot_stall_other_generations() {
    use std::time::Duration;
    let ranges = [LayerRange::new(0, 2), LayerRange::new(2, 4), LayerRange::new(4, 6)];
    let (a_id, a_endpoint) = raw_client::tiny_window_client();
    let (placement, client, _) = start_custom(&ranges, None, 2048, &[a_id]).await;
    let coordinator = &placement.stages[0];

    // A: 1,500 tokens asked for, none read.
    let a_conn = a_endpoint.connect(coordinator.addr, "shoal").unwrap().await.unwrap();
    let (mut a_send, mut a_recv) = a_conn.open_bi().await.unwrap();
    let body = serde_json::to_vec(&shoal_pipeline::ControlRequest::Generate(request(&[1, 2, 3, 4], 1500))).unwrap();
    a_send.write_all(&body).await.unwrap();
    a_send.finish().unwrap();

    // B: a generation that outlasts the point where A's queue is full.
    let prompt: Vec<TokenId> = (0..9).map(|i| (i * 4 % 50) as TokenId).collect();
    let mut streamed = Vec::new();
    let b_request = request(&prompt, 300);
    let b = generate(&client, coordinator, &b_request, |t, _| streamed.push(t));
    // A generous bound: this guards a deadlock, not a speed.
    let report = tokio::time::timeout(Duration::from_secs(120), b)
        .await
        .expect("B's generation stalled behind a client that does not read")
        .unwrap();
    let (want, digest) = reference(&ranges, &prompt, 300);
    assert_eq!((report.tokens, report.logits_digest), (want.clone(), digest));
    assert_eq!(streamed, want, "B missed tokens");

    // A was cut off: its stream is reset, not finished with a result.
    let read = tokio::time::timeout(Duration::from_secs(60), a_recv.read_to_end(1 << 20)).await;
    assert!(matches!(read, Ok(Err(_))), "A's stream was not reset: {read:?}");
    let st = shoal_pipeline::status(&client, coordinator).await.unwrap();
    assert_eq!((st.slow_clients_dropped, st.counters.cancelled), (1, 1), "{st:?}");
    // Its session is freed along the ring (the Close travels it).
    for place in &placement.stages {
        let mut st = shoal_pipeline::status(&client, place).await.unwrap();
        for _ in 0..100 {
            if st.sessions == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            st = shoal_pipeline::status(&client, place).await.unwrap();
        }
        assert_eq!(st.sessions, 0, "a node still holds A's session: {st:?}");
    }
}

/// In a one-stage ring every decode step runs inline on the node's thread; a long
/// generation must still let its client's writer drain its queue, so a client that
/// reads is never taken for one that does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_generation_on_one_node_does_not_cut_off_its_reading_client() {
    let ranges = [LayerRange::new(0, 6)];
    let (placement, client, _) = start_custom(&ranges, None, 2048, &[]).await;
    let prompt: Vec<TokenId> = (0..5).collect();
    let report = generate(&client, &placement.stages[0], &request(&prompt, 1000), |_, _| {}).await.unwrap();
    assert_eq!((report.tokens, report.logits_digest), reference(&ranges, &prompt, 1000));
    let st = shoal_pipeline::status(&client, &placement.stages[0]).await.unwrap();
    assert_eq!(st.slow_clients_dropped, 0, "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_generation_streams_only_what_follows_and_ends_as_the_uninterrupted_one() {
    let ranges = [LayerRange::new(0, 3), LayerRange::new(3, 6)];
    let (placement, client) = start(&ranges).await;
    let prompt: Vec<TokenId> = (0..11).map(|i| (i * 7 % 50) as TokenId).collect();
    let (want, digest) = reference(&ranges, &prompt, 30);
    // The first 12 tokens were made before (on a placement that is gone).
    let mut req = request(&prompt, 30);
    req.resume = want[..12].to_vec();
    let mut streamed = Vec::new();
    let report = generate(&client, &placement.stages[0], &req, |t, _| streamed.push(t)).await.unwrap();
    assert_eq!(streamed, want[12..], "only the tokens after the resumed ones are streamed");
    assert_eq!(report.tokens, want);
    assert_eq!(report.logits_digest, digest, "the tail's digest covers every step, as uninterrupted");
    // A resume that leaves nothing to make, or holds a stop token, is refused.
    let mut done = request(&prompt, 12);
    done.resume = want[..12].to_vec();
    let e = generate(&client, &placement.stages[0], &done, |_, _| {}).await.unwrap_err().to_string();
    assert!(e.contains("tokens left to make"), "{e}");
    let mut stopped = request(&prompt, 30);
    stopped.resume = want[..3].to_vec();
    stopped.stop = vec![want[1]];
    let e = generate(&client, &placement.stages[0], &stopped, |_, _| {}).await.unwrap_err().to_string();
    assert!(e.contains("stop token"), "{e}");
}

/// A client that lost its stream resumes at once, while the coordinator may take the
/// old stream for alive until QUIC's idle timeout: the resumption (same tag, same
/// node) ends the old attempt and takes its session, instead of queueing behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumption_ends_its_earlier_attempt_and_takes_its_session() {
    let ranges = [LayerRange::new(0, 2), LayerRange::new(2, 4), LayerRange::new(4, 6)];
    let (placement, client, _) = start_custom(&ranges, None, 8192, &[]).await;
    let client = Arc::new(client);
    let coord = placement.stages[0].clone();
    let prompt = |i: usize| -> Vec<TokenId> { (0..5 + i).map(|k| ((k * 5 + i * 3) % 50) as TokenId).collect() };
    // Four long generations hold every session; the last is tagged.
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel();
    let mut long = Vec::new();
    for i in 0..4 {
        let (client, coord, started_tx) = (client.clone(), coord.clone(), started_tx.clone());
        let mut req = request(&prompt(i), 6000);
        req.tag = (i == 3).then_some(42);
        long.push(tokio::spawn(async move {
            let mut first = true;
            generate(&client, &coord, &req, |_, _| {
                if std::mem::take(&mut first) {
                    let _ = started_tx.send(());
                }
            })
            .await
        }));
    }
    for _ in 0..4 {
        started.recv().await.unwrap();
    }
    // The tagged one's client comes back with a resumption (here a short one).
    let mut again = request(&prompt(3), 20);
    again.tag = Some(42);
    let report = tokio::time::timeout(std::time::Duration::from_secs(60), generate(&client, &coord, &again, |_, _| {}))
        .await
        .expect("the resumption waited for a session")
        .unwrap();
    assert_eq!(report.tokens, reference(&ranges, &prompt(3), 20).0);
    // It did not wait for a long one to end: the untagged ones still run.
    assert!(long[..3].iter().all(|h| !h.is_finished()), "a long generation ended first");
    // The old attempt ended, without a result.
    let old = long.pop().unwrap().await.unwrap();
    assert!(old.is_err(), "the superseded attempt finished: {old:?}");
    let st = shoal_pipeline::status(&client, &coord).await.unwrap();
    assert!(st.sessions <= 3, "the old attempt still holds its session: {st:?}");
    for h in long {
        h.abort();
    }
}
