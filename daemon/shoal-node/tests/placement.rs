//! Four node processes in this process on 127.0.0.1 (real QUIC, real mDNS on `lo`, the
//! real test model and real shard transfers; a fake engine computes, so that the test
//! needs no llama.cpp): a model added on one node and loaded is placed by the leader
//! over three nodes whose offers force the split, the nodes without the file receive
//! only their shards, a generation through any node runs, a stopped stage node is
//! replaced by the spare, and unloading stops every stage.

mod common;
use common::*;
use shoal_membership::node::CreatePolicy;
use shoal_node::api::{NodeRequest, NodeResponse, StageState, StageStatus};
use shoal_node::runtime::{Engine, StageSizing};
use shoal_pipeline::{GenerateRequest, SamplerFactory};
use shoal_types::{
    GpuOffer, GpuShare, LayerRange, ModelPlacement, NodeId, SessionId, Stage, StageError, StageInfo, StageInput,
    StageMemory, StageOutput, TokenId, TokenSampler,
};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const N_EMBD: u32 = 8;
const N_VOCAB: u32 = 50;
/// Memory each node offers: the model (about 100 MB, and about 50 MB of buffers per
/// stage) fits on no one or two of them.
const OFFER: u64 = 90 << 20;

// ---- a fake engine: deterministic arithmetic that depends on the layers and history ----

struct FakeStage {
    info: StageInfo,
    /// Per session, per layer of this stage: the sum of that layer's output at each
    /// position so far (its "KV cache"). Every layer keeps its own, so the numbers do
    /// not depend on where the model is split, as with the real engine.
    seen: HashMap<SessionId, Vec<Vec<f32>>>,
}

/// Time a fake stage takes per step, so that a generation lasts long enough to be cut.
const STEP: Duration = Duration::from_millis(2);

impl Stage for FakeStage {
    fn info(&self) -> &StageInfo {
        &self.info
    }

    fn forward_rows(
        &mut self,
        session: SessionId,
        first_pos: u32,
        input: StageInput<'_>,
        all_rows: bool,
    ) -> Result<StageOutput, StageError> {
        std::thread::sleep(STEP);
        let rows: Vec<Vec<f32>> = match input {
            StageInput::Tokens(t) => {
                t.iter().map(|&t| (0..N_EMBD).map(|j| (t as f32 + j as f32) * 0.01).collect()).collect()
            }
            StageInput::Hidden(h) => h.chunks(N_EMBD as usize).map(<[f32]>::to_vec).collect(),
        };
        let layers = self.info.layers;
        let seen = self.seen.entry(session).or_insert_with(|| vec![Vec::new(); layers.len() as usize]);
        if first_pos as usize > seen[0].len() {
            return Err(StageError::PositionGap { session, first_pos, have: seen[0].len() as u32 });
        }
        for l in seen.iter_mut() {
            l.truncate(first_pos as usize);
        }
        let mut out = Vec::new();
        for row in rows {
            let mut x = row;
            for (k, layer) in (layers.start..layers.end).enumerate() {
                let history: f32 = seen[k].iter().sum::<f32>() * 1e-3;
                x = x
                    .iter()
                    .enumerate()
                    .map(|(j, v)| (v * 1.1 + layer as f32 * 0.01 + history + j as f32 * 1e-4).sin())
                    .collect();
                seen[k].push(x.iter().sum());
            }
            out.extend(x);
        }
        if self.info.is_tail() {
            // The last row's logits, or every row's (a verify step).
            let first_row = if all_rows { 0 } else { out.len() / N_EMBD as usize - 1 };
            let logits = out
                .chunks(N_EMBD as usize)
                .skip(first_row)
                .flat_map(|row| {
                    (0..N_VOCAB).map(|i| row.iter().enumerate().map(|(j, v)| (v * (i + j as u32) as f32).cos()).sum())
                })
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

/// Loads a fake stage, after checking that the shard it was given is a real shard of
/// exactly its layers (what arrived over the network is what the placement asked for).
/// The fake engine; its field is its fingerprint (what its speed depends on). It keeps
/// the GPU shares each stage was loaded with (the fake "offloads" nothing: it computes
/// the same either way, as a real GPU stage computes the same layers).
struct FakeEngine(&'static str, Loads);

/// Each stage a [`FakeEngine`] loaded: its layers and GPU shares.
type Loads = Arc<std::sync::Mutex<Vec<(LayerRange, Vec<GpuShare>)>>>;

impl FakeEngine {
    fn new(fingerprint: &'static str) -> FakeEngine {
        FakeEngine(fingerprint, Default::default())
    }
}

impl Engine for FakeEngine {
    fn fingerprint(&self) -> String {
        self.0.to_string()
    }

    fn load(
        &self,
        shard: &Path,
        layers: LayerRange,
        n_layer: u32,
        s: StageSizing,
        gpus: &[GpuShare],
    ) -> Result<Box<dyn Stage>, String> {
        self.1.lock().unwrap().push((layers, gpus.to_vec()));
        let (g, meta) = shoal_gguf::open_model(shard).map_err(|e| e.to_string())?;
        let source = g.get(shoal_gguf::shard::KEY_SOURCE_LAYERS).map(|v| format!("{v:?}"));
        if meta.n_layer != layers.len() {
            return Err(format!("shard of {} layers for a stage of {layers}: {source:?}", meta.n_layer));
        }
        let info = StageInfo {
            layers,
            n_layer_total: n_layer,
            n_embd: N_EMBD,
            n_vocab: N_VOCAB,
            chunk: s.chunk,
            n_ctx_per_session: s.context,
            max_sessions: s.sessions,
        };
        Ok(Box::new(FakeStage { info, seen: HashMap::new() }))
    }

    fn samplers(&self, _gguf: &Path) -> SamplerFactory {
        Arc::new(|_: &serde_json::Value| Ok(Box::new(Greedy) as Box<dyn TokenSampler>))
    }
}

/// A node's options here: the fake engine, and a small memory offer.
fn options() -> shoal_node::Options {
    shoal_node::Options {
        engine: Some(Arc::new(FakeEngine::new("fake threads=1"))),
        max_memory: Some(OFFER),
        gpus: Vec::new(),
        shard_dir: None,
        http: None,
        api_access: Default::default(),
        keepalive: None,
        appliance: None,
        speculation: None,
    }
}

/// The fake stages of `ranges` run in order in-process, on the canonical schedule (any
/// split of the layers gives the same tokens).
fn reference(ranges: &[LayerRange], n_layer: u32, chunk: u32, prompt: &[TokenId], max_new: usize) -> Vec<TokenId> {
    let sizing = StageSizing { context: 512, sessions: 1, chunk };
    let mut stages: Vec<Box<dyn Stage>> = ranges
        .iter()
        .map(|r| {
            let info = StageInfo {
                layers: *r,
                n_layer_total: n_layer,
                n_embd: N_EMBD,
                n_vocab: N_VOCAB,
                chunk: sizing.chunk,
                n_ctx_per_session: sizing.context,
                max_sessions: 1,
            };
            Box::new(FakeStage { info, seen: HashMap::new() }) as Box<dyn Stage>
        })
        .collect();
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
    for c in prompt.chunks(chunk as usize) {
        logits = step(pos, c);
        pos += c.len() as u32;
    }
    let mut tokens = Vec::new();
    loop {
        let t = Greedy.sample(&logits);
        tokens.push(t);
        if tokens.len() == max_new {
            return tokens;
        }
        logits = step(pos, &[t]);
        pos += 1;
    }
}

/// The committed placement of the model, once it has stages.
async fn placement(n: &TestNode, not_generation: u64) -> ModelPlacement {
    wait_for("a placement", 30, || async {
        match n.ask(NodeRequest::ModelPlan { model: SMOL.into() }).await {
            NodeResponse::Placement { placement, committed: true, .. }
                if !placement.stages.is_empty() && placement.generation != not_generation =>
            {
                Some(placement)
            }
            _ => None,
        }
    })
    .await
}

/// Every stage of `p` running on its node.
async fn running(nodes: &[&TestNode], p: &ModelPlacement) -> HashMap<NodeId, StageStatus> {
    let mut out = HashMap::new();
    for s in &p.stages {
        let n = nodes.iter().find(|n| n.id == s.node).expect("a stage on a test node");
        let st = wait_for("the stage running", 60, || async {
            let st = n.stages().await.into_iter().find(|st| st.generation == p.generation)?;
            assert!(!matches!(st.state, StageState::Failed(_)), "{st:?}");
            (st.state == StageState::Running).then_some(st)
        })
        .await;
        assert_eq!(st.layers, s.layers);
        out.insert(s.node, st);
    }
    out
}

fn request(max_new: u32) -> GenerateRequest {
    GenerateRequest {
        prompt: (1..40).collect(),
        max_new,
        stop: vec![],
        sampling: serde_json::json!({}),
        resume: vec![],
        speculative: None,
        tag: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_leader_places_a_loaded_model_shards_travel_and_a_lost_stage_is_replaced() {
    let model = shoal_gguf::models_dir().join(SMOL);
    assert!(model.exists(), "{} missing: scripts/test.sh fetches it", model.display());
    let model_bytes = std::fs::metadata(&model).unwrap().len();
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n);
    let a = start(&dir("a"), "a", CreatePolicy::Now, options());
    wait_for("A's cluster", 10, || async { a.status().await.cluster }).await;
    let others: Vec<TestNode> =
        ["b", "c", "d"].iter().map(|n| start(&dir(n), n, CreatePolicy::Never, options())).collect();
    for x in &others {
        join(&a, x).await;
    }
    let nodes: Vec<&TestNode> = std::iter::once(&a).chain(others.iter()).collect();
    wait_for("four members", 30, || async { (a.status().await.members.len() == 4).then_some(()) }).await;

    // The model is added on A only, and loaded.
    match a.ask(NodeRequest::ModelAdd { path: model.display().to_string(), name: None }).await {
        NodeResponse::Added(e) => assert_eq!(e.holders.len(), 1),
        other => panic!("add: {other:?}"),
    }
    // D learns of the entry when the leader's commit reaches it (the add answered once
    // the leader committed it), so it is asked to load only then.
    wait_for("D to see the model", 10, || async {
        others[2].models().await.iter().any(|r| r.entry.name == SMOL).then_some(())
    })
    .await;
    let load = NodeRequest::ModelLoad { model: SMOL.into(), context: 512, sessions: 1, exclude: vec![] };
    match others[2].ask(load).await {
        NodeResponse::Ok(text) => assert!(text.contains("loading"), "{text}"),
        other => panic!("load: {other:?}"),
    }
    let p = placement(&a, 0).await;
    assert_eq!(p.stages.len(), 3, "the offers force a split in three: {p:?}");
    assert!(p.is_valid(30));
    // Planned on speeds the members measured on two layers (the fake engine's), none
    // estimated, and on the links they probed (none assumed): every stage's node among
    // them.
    let why = p.explanation.join("\n");
    assert!(!why.contains("No measured link"), "{why}");
    let measured =
        why.lines().find_map(|l| l.strip_prefix("Speeds measured by the members on a few layers")).unwrap_or("");
    assert!(!why.contains("estimated"), "{why}");
    for s in &p.stages {
        let name = [&a].into_iter().chain(&others).find(|n| n.id == s.node).unwrap().dir.file_name().unwrap();
        assert!(measured.contains(&format!(" {} ", name.to_str().unwrap())), "{name:?}: {why}");
    }
    let stages = running(&nodes, &p).await;
    // Nodes without the file received their shard, which is far smaller than the model;
    // a stage on A was cut from A's own copy.
    for (node, st) in &stages {
        if *node == a.id {
            assert_eq!(st.shard_origin.as_deref(), Some("built from this node's copy"));
            assert_eq!(st.shard_bytes_received, 0);
        } else {
            assert!(st.shard_origin.as_deref().is_some_and(|o| o.starts_with("fetched from")), "{st:?}");
            assert!(st.shard_bytes_received > 0 && st.shard_bytes_received < model_bytes * 2 / 3, "{st:?}");
        }
    }

    // A generation through any node (here one that may run no stage) equals the same
    // stages run in order in-process.
    let ranges: Vec<LayerRange> = p.stages.iter().map(|s| s.layers).collect();
    let want = reference(&ranges, 30, p.chunk, &request(12).prompt, 12);
    for n in &nodes {
        assert_eq!(n.generate(request(12)).await.unwrap(), want, "through {}", n.dir.display());
    }

    // A stage's node stops (the middle one unless that is A, which holds the only copy
    // of the file, or the leader): the leader places the model anew with the spare.
    let leader = a.status().await.leader.unwrap();
    let victim = [1, 0, 2]
        .iter()
        .map(|&i| p.stages[i].node)
        .find(|n| *n != a.id && *n != leader)
        .expect("three stages on four nodes: one is neither A nor the leader");
    drop(nodes);
    let (gone, rest): (Vec<TestNode>, Vec<TestNode>) = others.into_iter().partition(|n| n.id == victim);
    let keep: Vec<&TestNode> = std::iter::once(&a).chain(rest.iter()).collect();
    // It stops in the middle of a long generation through A, which goes on on the next
    // placement and ends as an uninterrupted run would.
    let long = 300;
    let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let running_gen = a.generate_counted(request(long), count.clone());
    wait_for("the generation under way", 30, || async {
        (count.load(std::sync::atomic::Ordering::SeqCst) >= 30).then_some(())
    })
    .await;
    let victim_dir = gone[0].dir.clone();
    for g in gone {
        g.stop().await;
    }
    let at_stop = count.load(std::sync::atomic::Ordering::SeqCst);
    assert!(at_stop < long as usize, "the generation ended before the node stopped; make it longer");
    let tokens = running_gen.await.unwrap().expect("the generation survives the lost stage");
    let unsplit = reference(&[LayerRange::new(0, 30)], 30, p.chunk, &request(long).prompt, long as usize);
    assert_eq!(tokens, unsplit, "the resumed generation differs from an uninterrupted run");
    let q = wait_for("a new placement without the stopped node", 40, || async {
        match keep[0].ask(NodeRequest::ModelPlan { model: SMOL.into() }).await {
            NodeResponse::Placement { placement, committed: true, .. }
                if placement.generation > p.generation && !placement.stages.is_empty() =>
            {
                Some(placement)
            }
            _ => None,
        }
    })
    .await;
    assert!(q.stages.iter().all(|s| s.node != victim), "{q:?}");
    running(&keep, &q).await;
    let ranges: Vec<LayerRange> = q.stages.iter().map(|s| s.layers).collect();
    let want = reference(&ranges, 30, q.chunk, &request(8).prompt, 8);
    assert_eq!(keep[0].generate(request(8)).await.unwrap(), want);

    // Unloaded: every stage stops.
    match keep[0].ask(NodeRequest::ModelUnload { model: SMOL.into() }).await {
        NodeResponse::Ok(_) => {}
        other => panic!("unload: {other:?}"),
    }
    for n in &keep {
        wait_for("stages stopped", 20, || async { n.stages().await.is_empty().then_some(()) }).await;
    }
    let e = keep[0].generate(request(4)).await.unwrap_err();
    assert!(e.contains("not loaded"), "{e}");

    // The stopped node comes back as it was: the speed it measured stays. Back with
    // another fingerprint (other threads, another build), its speed is dropped; with
    // no model to place, nobody asks it to measure again. The others' speeds stay.
    let speeds = |of: NodeId| {
        let a = &a;
        async move {
            let prefix = format!("{}{of}/", shoal_types::Speed::KEY_PREFIX);
            match a.admin(shoal_membership::wire::AdminRequest::Entries { prefix }).await {
                shoal_membership::wire::AdminResponse::Entries(e) => e.len(),
                other => panic!("entries: {other:?}"),
            }
        }
    };
    assert_eq!(speeds(victim).await, 1, "the stopped node's speed on the model");
    let name = victim_dir.file_name().unwrap().to_str().unwrap().to_string();
    let back = start(&victim_dir, &name, CreatePolicy::Never, options());
    wait_for("back among the members", 30, || async {
        (back.status().await.leader.is_some() && back.status().await.members.len() == 4).then_some(())
    })
    .await;
    // Its offer is republished only if it changed; wait for a beat's worth of commits.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(speeds(victim).await, 1, "the same fingerprint keeps the speed");
    back.stop().await;
    let other = shoal_node::Options { engine: Some(Arc::new(FakeEngine::new("fake threads=2"))), ..options() };
    let back = start(&victim_dir, &name, CreatePolicy::Never, other);
    wait_for("the old speed dropped", 30, || async { (speeds(victim).await == 0).then_some(()) }).await;
    assert_eq!(speeds(a.id).await, 1, "A's speed stays");
    back.stop().await;
    // Removed from the catalog: the members' speeds on it go with it.
    match a.ask(NodeRequest::ModelRemove { model: SMOL.into() }).await {
        NodeResponse::Removed(_) => {}
        other => panic!("remove: {other:?}"),
    }
    wait_for("the speeds removed", 10, || async { (speeds(a.id).await == 0).then_some(()) }).await;

    drop(keep);
    for n in rest {
        n.stop().await;
    }
    a.stop().await;
}

/// A member that offers a GPU: the leader plans it as a device of its own (its speed
/// estimated), puts layers on it, and the node loads its stage with those layers
/// offloaded to that GPU (one stage per node, whatever the plan's devices on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_leader_offloads_layers_to_a_gpu_a_member_offers() {
    let model = shoal_gguf::models_dir().join(SMOL);
    assert!(model.exists(), "{} missing: scripts/test.sh fetches it", model.display());
    let tmp = tempfile::tempdir().unwrap();
    let a = start(&tmp.path().join("a"), "a", CreatePolicy::Now, options());
    wait_for("A's cluster", 10, || async { a.status().await.cluster }).await;
    let engine = Arc::new(FakeEngine::new("fake threads=1"));
    let loads = engine.1.clone();
    let gpu = GpuOffer { device: "FakeGPU0".into(), description: "a GPU of the test".into(), memory_bytes: 120 << 20 };
    let b_options = shoal_node::Options { engine: Some(engine), gpus: vec![gpu], ..options() };
    let b = start(&tmp.path().join("b"), "b", CreatePolicy::Never, b_options);
    join(&a, &b).await;
    wait_for("two members", 30, || async { (a.status().await.members.len() == 2).then_some(()) }).await;
    match a.ask(NodeRequest::ModelAdd { path: model.display().to_string(), name: None }).await {
        NodeResponse::Added(_) => {}
        other => panic!("add: {other:?}"),
    }
    let load = NodeRequest::ModelLoad { model: SMOL.into(), context: 512, sessions: 1, exclude: vec![] };
    assert!(matches!(a.ask(load).await, NodeResponse::Ok(_)));
    let p = placement(&a, 0).await;
    assert!(p.is_valid(30), "{p:?}");
    // The GPU (estimated 15x faster than a CPU) takes all the layers it can hold.
    let on_b = p.stages.iter().find(|s| s.node == b.id).expect("a stage on the GPU's node");
    assert_eq!(on_b.gpus.len(), 1, "{p:?}");
    assert_eq!(on_b.gpus[0].device, "FakeGPU0");
    assert!(on_b.gpu_layers() > 0 && on_b.gpus[0].memory_bytes <= 120 << 20, "{p:?}");
    assert!(on_b.ram_bytes() <= OFFER, "{p:?}");
    let why = p.explanation.join("\n");
    assert!(why.contains("b/FakeGPU0's speed is estimated"), "{why}");
    let nodes = [&a, &b];
    let stages = running(&nodes, &p).await;
    assert_eq!(stages[&b.id].gpus, on_b.gpus, "the status shows the offload");
    // B's engine loaded its stage with exactly the placement's GPU share.
    assert!(loads.lock().unwrap().iter().any(|(l, g)| *l == on_b.layers && *g == on_b.gpus), "{:?}", loads);
    let ranges: Vec<LayerRange> = p.stages.iter().map(|s| s.layers).collect();
    let want = reference(&ranges, 30, p.chunk, &request(12).prompt, 12);
    assert_eq!(a.generate(request(12)).await.unwrap(), want);
    b.stop().await;
    a.stop().await;
}
