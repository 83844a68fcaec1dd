//! `shoal keys`: the API keys other machines present to the HTTP API (made, listed and
//! revoked through the local node; the cluster keeps only their hashes).

use crate::cluster::DirArg;
use crate::models::ask;
use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use shoal_node::api::{NodeRequest, NodeResponse};

/// `shoal keys`.
#[derive(Subcommand, Debug)]
pub enum KeysCommand {
    /// Make a key; its secret is printed once (the cluster keeps only a hash).
    Create(NameArg),
    /// The keys: names and when they were made.
    Ls(DirArg),
    /// Revoke a key: every node refuses it from then on.
    Revoke(NameArg),
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
        KeysCommand::Create(a) => match ask(&a.dir, NodeRequest::KeyCreate { name: a.name })? {
            NodeResponse::KeyCreated { key, secret } => {
                println!("{secret}");
                eprintln!(
                    "[shoal] key {} made: shown this once; send it as `Authorization: Bearer …` (or `x-api-key`)",
                    key.name
                );
            }
            other => bail!("unexpected answer: {other:?}"),
        },
        KeysCommand::Ls(dir) => match ask(&dir, NodeRequest::KeyList)? {
            NodeResponse::Keys(keys) if keys.is_empty() => {
                println!("no API keys (other machines cannot call the API): shoal keys create NAME")
            }
            NodeResponse::Keys(keys) => {
                for k in keys {
                    let made = std::time::UNIX_EPOCH + std::time::Duration::from_secs(k.created_unix);
                    println!("{:<24} made {}", k.name, humantime::format_rfc3339_seconds(made));
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
