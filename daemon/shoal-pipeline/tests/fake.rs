//! The pipeline on a deterministic fake engine, three nodes on 127.0.0.1 in one
//! process: the tokens and logits digest equal those of the same stages run in order
//! in-process; a stage refuses what it cannot run and the client gets the error.

use shoal_net::{Identity, Node, TransportOptions, TrustedKeys};
use shoal_pipeline::{generate, serve, GenerateRequest, Placement, SamplerFactory, ServiceConfig, StagePlace};
use shoal_types::{
    LayerRange, SessionId, Stage, StageError, StageInfo, StageInput, StageMemory, StageOutput, TokenId, TokenSampler,
};
use std::collections::HashMap;
use std::sync::Arc;

const N_EMBD: u32 = 8;
const N_VOCAB: u32 = 50;
const N_LAYER: u32 = 6;
const CHUNK: u32 = 4;

/// Output depends on the input and on everything the session saw before (like a KV
/// cache), so reordering, loss or a bad rollback changes the numbers.
struct FakeStage {
    info: StageInfo,
    seen: HashMap<SessionId, Vec<f32>>,
}

impl FakeStage {
    fn new(layers: LayerRange) -> Self {
        let info = StageInfo {
            layers,
            n_layer_total: N_LAYER,
            n_embd: N_EMBD,
            n_vocab: N_VOCAB,
            chunk: CHUNK,
            n_ctx_per_session: 256,
            max_sessions: 4,
        };
        Self { info, seen: HashMap::new() }
    }
}

impl Stage for FakeStage {
    fn info(&self) -> &StageInfo {
        &self.info
    }

    fn forward(
        &mut self,
        session: SessionId,
        first_pos: u32,
        input: StageInput<'_>,
    ) -> Result<StageOutput, StageError> {
        let rows: Vec<Vec<f32>> = match input {
            StageInput::Tokens(t) => {
                t.iter().map(|&t| (0..N_EMBD).map(|j| (t as f32 + j as f32) * 0.01).collect()).collect()
            }
            StageInput::Hidden(h) => h.chunks(N_EMBD as usize).map(<[f32]>::to_vec).collect(),
        };
        let seen = self.seen.entry(session).or_default();
        if first_pos as usize > seen.len() {
            return Err(StageError::PositionGap { session, first_pos, have: seen.len() as u32 });
        }
        seen.truncate(first_pos as usize);
        let mut out = Vec::new();
        for row in rows {
            let history: f32 = seen.iter().sum::<f32>() * 1e-3;
            let next: Vec<f32> = row
                .iter()
                .enumerate()
                .map(|(j, v)| (v * 1.1 + self.info.layers.start as f32 * 0.1 + history + j as f32 * 1e-4).sin())
                .collect();
            seen.push(next.iter().sum());
            out.extend(next);
        }
        if self.info.is_tail() {
            let last = &out[out.len() - N_EMBD as usize..];
            let logits = (0..N_VOCAB)
                .map(|i| last.iter().enumerate().map(|(j, v)| (v * (i + j as u32) as f32).cos()).sum())
                .collect();
            Ok(StageOutput::Logits(logits))
        } else {
            Ok(StageOutput::Hidden(out))
        }
    }

    fn free_session(&mut self, session: SessionId) {
        self.seen.remove(&session);
    }

    fn memory(&self) -> StageMemory {
        StageMemory::default()
    }
}

struct Greedy;
impl TokenSampler for Greedy {
    fn sample(&mut self, logits: &[f32]) -> TokenId {
        logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i as TokenId)
    }
}

/// The same stages run in order in-process, on the canonical schedule.
fn reference(ranges: &[LayerRange], prompt: &[TokenId], max_new: usize) -> (Vec<TokenId>, String) {
    let mut stages: Vec<FakeStage> = ranges.iter().map(|r| FakeStage::new(*r)).collect();
    let s = SessionId(1);
    let mut step = |first_pos: u32, tokens: &[TokenId]| {
        let mut out = stages[0].forward(s, first_pos, StageInput::Tokens(tokens)).unwrap();
        for st in stages.iter_mut().skip(1) {
            let StageOutput::Hidden(h) = out else { unreachable!() };
            out = st.forward(s, first_pos, StageInput::Hidden(&h)).unwrap();
        }
        let StageOutput::Logits(l) = out else { unreachable!() };
        l
    };
    let mut pos = 0;
    let mut logits = Vec::new();
    for c in prompt.chunks(CHUNK as usize) {
        logits = step(pos, c);
        pos += c.len() as u32;
    }
    let mut digest = blake3::Hasher::new();
    let mut tokens = Vec::new();
    loop {
        digest.update(&logits.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
        let t = Greedy.sample(&logits);
        tokens.push(t);
        if tokens.len() == max_new {
            break;
        }
        logits = step(pos, &[t]);
        pos += 1;
    }
    (tokens, digest.finalize().to_hex().to_string())
}

/// Start one node per range; returns the placement and a client node.
async fn start(ranges: &[LayerRange]) -> (Placement, Node) {
    let ids: Vec<Arc<Identity>> = ranges.iter().map(|_| Arc::new(Identity::generate().unwrap())).collect();
    let client = Identity::generate().unwrap();
    let mut trusted: Vec<_> = ids.iter().map(|i| i.id()).collect();
    trusted.push(client.id());
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
            stage: Box::new(FakeStage::new(ranges[i])),
            samplers: samplers.clone(),
            dtype: shoal_net::Dtype::F32,
            retry: shoal_pipeline::RetryPolicy::default(),
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
    (placement, client)
}

fn request(prompt: &[TokenId], max_new: u32) -> GenerateRequest {
    GenerateRequest { prompt: prompt.to_vec(), max_new, stop: vec![], sampling: serde_json::json!({}) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_match_in_process_stages() {
    let ranges = [LayerRange::new(0, 2), LayerRange::new(2, 4), LayerRange::new(4, 6)];
    let (placement, client) = start(&ranges).await;
    let prompt: Vec<TokenId> = (0..11).map(|i| (i * 7 % 50) as TokenId).collect();
    let (want_tokens, want_digest) = reference(&ranges, &prompt, 40);
    let mut streamed = Vec::new();
    let report = generate(&client, &placement.stages[0], &request(&prompt, 40), |t| streamed.push(t)).await.unwrap();
    assert_eq!(report.tokens, want_tokens);
    assert_eq!(streamed, want_tokens);
    assert_eq!(report.logits_digest, want_digest);

    // Two generations at once on the same nodes: each still matches.
    let other: Vec<TokenId> = (0..6).map(|i| (i * 3 % 50) as TokenId).collect();
    let (ra, rb) = (request(&prompt, 20), request(&other, 20));
    let (a, b) = tokio::join!(
        generate(&client, &placement.stages[0], &ra, |_| {}),
        generate(&client, &placement.stages[0], &rb, |_| {})
    );
    assert_eq!(a.unwrap().tokens, reference(&ranges, &prompt, 20).0);
    assert_eq!(b.unwrap().tokens, reference(&ranges, &other, 20).0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_placement_works() {
    let ranges = [LayerRange::new(0, 6)];
    let (placement, client) = start(&ranges).await;
    let prompt: Vec<TokenId> = (0..9).collect();
    let report = generate(&client, &placement.stages[0], &request(&prompt, 12), |_| {}).await.unwrap();
    assert_eq!((report.tokens, report.logits_digest), reference(&ranges, &prompt, 12));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_cannot_run_fail_clearly() {
    let ranges = [LayerRange::new(0, 3), LayerRange::new(3, 6)];
    let (placement, client) = start(&ranges).await;
    let e = generate(&client, &placement.stages[0], &request(&[1; 250], 10), |_| {}).await.unwrap_err();
    assert!(e.to_string().contains("exceeds the context"), "{e}");
    let e = generate(&client, &placement.stages[0], &request(&[], 10), |_| {}).await.unwrap_err();
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
        generate(&stranger, &placement.stages[0], &request(&[1, 2], 2), |_| {}),
    )
    .await;
    assert!(matches!(r, Ok(Err(_))), "an unknown key got an answer: {r:?}");
    // The pipeline still works for trusted clients afterwards.
    assert!(generate(&client, &placement.stages[0], &request(&[1, 2, 3], 3), |_| {}).await.is_ok());
}
