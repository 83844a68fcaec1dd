//! The node process (`shoal serve`): one composition root for everything a machine
//! runs. It binds one pinned QUIC endpoint whose connections a router hands to each
//! service by ALPN (membership, admin, probes, the node protocol, and the pipeline
//! stages and shard transfers as they land), keeps the open join endpoint apart, and
//! serves the model catalog. The `shoal` binary is a thin CLI over it.
//!
//! Invariant: services share state only through membership (the replicated cluster
//! state, watched as a [`View`](shoal_membership::node::View)); nothing here holds a
//! second copy of who is a member.

pub mod api;
pub mod models;
pub mod schedule;

use api::{ApiError, ErrorKind, NodeRequest, NodeResponse};
use shoal_membership::node::{self as membership, Handle, NodeConfig, SharedEndpoint};
use shoal_membership::wire::{read_msg, write_msg};
use shoal_net::{alpn, Identity, Incoming, NodeId, TrustedKeys};
use shoal_types::NodeInventory;
use std::future::Future;
use std::sync::Arc;
use tokio::sync::watch;

/// Why the node process stopped.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// Membership (store, endpoints, discovery) failed.
    #[error(transparent)]
    Membership(#[from] membership::NodeError),
}

/// Run the node process until `shutdown` completes.
pub async fn run(
    cfg: NodeConfig,
    identity: Arc<Identity>,
    inventory: watch::Receiver<NodeInventory>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), NodeError> {
    let shared = SharedEndpoint::bind(cfg.listen, identity.clone(), &cfg.transport)?;
    let (handle, inbox) = Handle::new();
    let ctx = Arc::new(Ctx { me: identity.id(), membership: handle, trusted: shared.trusted.clone() });
    tokio::spawn(serve_api(shared.router.route(alpn::NODE), ctx));
    let main = shared.node.clone();
    let r = membership::run_shared(cfg, identity, inventory, shared, inbox, shutdown).await;
    main.close();
    Ok(r?)
}

/// What the node protocol's handlers need.
struct Ctx {
    /// This node: its own key is its owner's.
    me: NodeId,
    /// The way into membership.
    membership: Handle,
    /// Members' keys (a removed member's connections close at once).
    trusted: TrustedKeys,
}

/// Serve the node protocol: one request per stream.
async fn serve_api(mut incoming: Incoming, ctx: Arc<Ctx>) {
    while let Some(acc) = incoming.accept().await {
        let ctx = ctx.clone();
        let owner = acc.peer == ctx.me;
        if !owner {
            tokio::spawn(shoal_net::close_when_revoked(acc.conn.clone(), acc.peer, ctx.trusted.clone()));
        }
        tokio::spawn(async move {
            while let Ok((mut send, mut recv)) = acc.conn.accept_bi().await {
                let ctx = ctx.clone();
                tokio::spawn(async move {
                    let answer = match read_msg::<NodeRequest>(&mut recv).await {
                        Ok(Some(req)) if !owner && !req.member_may() => NodeResponse::Error(ApiError::new(
                            ErrorKind::Forbidden,
                            "only this node's owner may ask that",
                        )),
                        Ok(Some(req)) => handle(&ctx, req).await,
                        Ok(None) => return,
                        Err(e) => NodeResponse::Error(ApiError::new(ErrorKind::BadRequest, format!("bad request: {e}"))),
                    };
                    let _ = write_msg(&mut send, &answer).await;
                    let _ = send.finish();
                });
            }
        });
    }
}

async fn handle(ctx: &Ctx, req: NodeRequest) -> NodeResponse {
    let result = match req {
        NodeRequest::ModelAdd { path, name } => models::add(ctx.me, &ctx.membership, &path, name).await.map(NodeResponse::Added),
        NodeRequest::ModelList => Ok(NodeResponse::Models(models::list(ctx.me, &ctx.membership.view().borrow()))),
        NodeRequest::ModelRemove { model } => models::remove(&ctx.membership, &model).await.map(NodeResponse::Removed),
        NodeRequest::ModelScan { from } => Ok(models::scan(from).await),
        NodeRequest::ModelImport { from, names } => Ok(models::import(ctx.me, &ctx.membership, from, &names).await),
    };
    result.unwrap_or_else(NodeResponse::Error)
}
