//! Node processes inside the test process, on 127.0.0.1 (real QUIC, real mDNS on `lo`),
//! and the client side of the node protocol the tests speak to them.
#![allow(dead_code)]

use shoal_membership::node::{self, CreatePolicy, NodeConfig};
use shoal_membership::wire::{AdminRequest, AdminResponse, ClusterStatus};
use shoal_membership::Config;
use shoal_net::discovery::InterfaceFilter;
use shoal_net::{Identity, TransportOptions};
use shoal_node::api::{self, NodeRequest, NodeResponse, StageStatus};
use shoal_pipeline::GenerateRequest;
use shoal_types::{NodeId, NodeInventory, Role, TokenId};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// The real test model's file name.
pub const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The real test model (fetched by the test setup).
pub fn real_model() -> PathBuf {
    let p = shoal_gguf::models_dir().join(SMOL);
    assert!(p.exists(), "{} missing: scripts/test.sh fetches it", p.display());
    p
}

/// A node process running in this one.
pub struct TestNode {
    pub dir: PathBuf,
    pub id: NodeId,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), shoal_node::NodeError>>,
}

/// Start a node in `dir`, with `options` (engine, memory offer).
pub fn start(dir: &Path, name: &str, create: CreatePolicy, options: shoal_node::Options) -> TestNode {
    let identity = Arc::new(Identity::load_or_create(dir).unwrap());
    let cfg = NodeConfig {
        data_dir: dir.to_path_buf(),
        listen: "127.0.0.1:0".parse().unwrap(),
        join_listen: "127.0.0.1:0".parse().unwrap(),
        name: name.into(),
        role: Role::Pc,
        interfaces: InterfaceFilter::loopback(),
        web_port: None,
        create,
        accept: None,
        join_token: None,
        timing: Config::default(),
        transport: TransportOptions::default(),
        calibrator: None,
    };
    let inventory = NodeInventory { ram_total_bytes: 8 << 30, ram_available_bytes: 4 << 30, ..Default::default() };
    let (keep, rx) = tokio::sync::watch::channel(inventory);
    let (stop, stopped) = oneshot::channel::<()>();
    let id = identity.id();
    let task = tokio::spawn(async move {
        let _keep = keep;
        shoal_node::run(cfg, options, identity, rx, async {
            let _ = stopped.await;
        })
        .await
    });
    TestNode { dir: dir.to_path_buf(), id, stop: Some(stop), task }
}

impl TestNode {
    /// The node's own key (its owner's).
    pub fn identity(&self) -> Arc<Identity> {
        Arc::new(Identity::load_or_create(&self.dir).unwrap())
    }

    /// A membership admin request, retried while the node starts.
    pub async fn admin(&self, req: AdminRequest) -> AdminResponse {
        let t0 = Instant::now();
        loop {
            match node::admin(&self.dir, self.identity(), &req).await {
                Ok(answer) => return answer,
                Err(_) if t0.elapsed() < Duration::from_secs(10) => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Err(e) => panic!("admin request: {e}"),
            }
        }
    }

    pub async fn status(&self) -> ClusterStatus {
        match self.admin(AdminRequest::Status).await {
            AdminResponse::Status(s) => *s,
            other => panic!("status: {other:?}"),
        }
    }

    /// A node-protocol request as the owner.
    pub async fn ask(&self, req: NodeRequest) -> NodeResponse {
        api::request(&self.dir, self.identity(), &req).await.expect("the node answers")
    }

    pub async fn models(&self) -> Vec<api::ModelRow> {
        match self.ask(NodeRequest::ModelList).await {
            NodeResponse::Models(rows) => rows,
            other => panic!("models: {other:?}"),
        }
    }

    pub async fn stages(&self) -> Vec<StageStatus> {
        match self.ask(NodeRequest::Stages).await {
            NodeResponse::Stages(s) => s,
            other => panic!("stages: {other:?}"),
        }
    }

    /// A generation of the test model through this node: its tokens, or the error.
    pub async fn generate(&self, request: GenerateRequest) -> Result<Vec<TokenId>, String> {
        self.generate_counted(request, Arc::new(AtomicUsize::new(0))).await.unwrap()
    }

    /// A generation through this node in a task, its streamed tokens counted in `count`.
    pub fn generate_counted(
        &self,
        request: GenerateRequest,
        count: Arc<AtomicUsize>,
    ) -> tokio::task::JoinHandle<Result<Vec<TokenId>, String>> {
        let (dir, identity) = (self.dir.clone(), self.identity());
        tokio::spawn(async move {
            let mut tokens = Vec::new();
            let req = NodeRequest::Generate { model: SMOL.into(), request };
            let last = api::request_stream(&dir, identity, &req, &mut |m| {
                if let NodeResponse::Token(t) = m {
                    tokens.push(*t);
                    count.fetch_add(1, Ordering::SeqCst);
                }
            })
            .await
            .map_err(|e| e.to_string())?;
            match last {
                NodeResponse::Generated(report) => {
                    assert_eq!(report.tokens, tokens, "the streamed tokens are the report's");
                    Ok(tokens)
                }
                other => Err(format!("{other:?}")),
            }
        })
    }

    /// Stop the node and wait until it has.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.task.await.unwrap().unwrap();
    }
}

/// Poll `f` until it returns `Some`, at most `secs`.
pub async fn wait_for<T, F, Fut>(what: &str, secs: u64, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let t0 = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(t0.elapsed() < Duration::from_secs(secs), "{what}: not within {secs} s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `x` joins `a`'s cluster with a pairing code made on `a`.
pub async fn join(a: &TestNode, x: &TestNode) {
    wait_for("joined with a code", 40, || async {
        let AdminResponse::Code { code, .. } = a.admin(AdminRequest::Pair).await else { return None };
        match x.admin(AdminRequest::Join { code }).await {
            AdminResponse::Ok(_) => Some(()),
            _ => None,
        }
    })
    .await;
}
