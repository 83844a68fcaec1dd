//! `shoal keys`: the API keys other machines present to the HTTP API (made, listed and
//! revoked through the local node; the cluster keeps only their hashes).

use crate::cluster::DirArg;
use crate::models::ask;
use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use shoal_node::api::{NodeRequest, NodeResponse};
use shoal_types::KeyScope;

/// `shoal keys`.
#[derive(Subcommand, Debug)]
pub enum KeysCommand {
    /// Make a key; its secret is printed once (the cluster keeps only a hash). A chat
    /// client's key (list models, generate) unless `--admin`.
    Create(CreateArg),
    /// The keys: names and when they were made.
    Ls(DirArg),
    /// Revoke a key: every node refuses it from then on.
    Revoke(NameArg),
}

/// A key to make.
#[derive(Args, Debug)]
pub struct CreateArg {
    /// What the key is for, e.g. open-webui.
    name: String,
    /// Let it also pull, delete, load and unload models (else it may chat and list).
    #[arg(long)]
    admin: bool,
    #[command(flatten)]
    dir: DirArg,
}

/// A key's name.
#[derive(Args, Debug)]
pub struct NameArg {
    /// What the key is for, e.g. open-webui.
    name: String,
    #[command(flatten)]
    dir: DirArg,
}

pub fn keys(c: KeysCommand) -> Result<()> {
    match c {
        KeysCommand::Create(a) => {
            let scope = if a.admin { KeyScope::Admin } else { KeyScope::Chat };
            match ask(&a.dir, NodeRequest::KeyCreate { name: a.name, scope })? {
                NodeResponse::KeyCreated { key, secret } => {
                    println!("{secret}");
                    eprintln!(
                        "[shoal] {} key {} made: shown this once; send it as `Authorization: Bearer …` (or `x-api-key`){}",
                        key.scope,
                        key.name,
                        if key.scope == KeyScope::Chat { "; it may chat and list models (--admin: also pull, delete, load, unload)" } else { "" }
                    );
                }
                other => bail!("unexpected answer: {other:?}"),
            }
        }
        KeysCommand::Ls(dir) => match ask(&dir, NodeRequest::KeyList)? {
            NodeResponse::Keys(keys) if keys.is_empty() => {
                println!("no API keys (other machines cannot call the API): shoal keys create NAME")
            }
            NodeResponse::Keys(keys) => {
                for k in keys {
                    let made = std::time::UNIX_EPOCH + std::time::Duration::from_secs(k.created_unix);
                    println!("{:<24} {:<6} made {}", k.name, k.scope, humantime::format_rfc3339_seconds(made));
                }
            }
            other => bail!("unexpected answer: {other:?}"),
        },
        KeysCommand::Revoke(a) => match ask(&a.dir, NodeRequest::KeyRevoke { name: a.name })? {
            NodeResponse::Keys(k) => println!("revoked {}", k.first().map_or("?", |k| k.name.as_str())),
            other => bail!("unexpected answer: {other:?}"),
        },
    }
    Ok(())
}
