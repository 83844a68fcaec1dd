//! The shard protocol (`shoal/shard/1`), one bidirectional stream per fetch:
//!
//! ```text
//! asker  → holder   [len: u32 BE][Request as JSON]            len ≤ MAX_REQUEST, then FIN
//! holder → asker    [len: u32 BE][Reply as JSON]              len ≤ MAX_REPLY
//!   when the reply is a manifest, for each chunk i in from_chunk..chunks:
//!                   [TAG_DATA][the chunk's bytes]              (length known from the manifest)
//!                 | [TAG_HOLE]                                 (a chunk of zeros: no bytes)
//!   or, if the holder fails part way:
//!                   [TAG_ABORT][len: u32 BE][Refusal as JSON]
//!   then FIN
//! ```
//!
//! Chunks carry no index or hash: the stream is ordered and the manifest, sent first,
//! has both. Every message is read as its bytes arrive (an announced length allocates
//! nothing) and bounded, so a peer's stream never makes a node allocate past
//! [`MAX_REPLY`] or panic.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use shoal_gguf::{Manifest, SourceHash};
use shoal_types::LayerRange;

/// The longest request a holder reads (a request is ~200 bytes of JSON).
pub const MAX_REQUEST: u32 = 4 << 10;
/// The longest reply an asker reads: a manifest of [`shoal_gguf::shard::MAX_CHUNKS`]
/// chunk hashes (~70 bytes each as JSON) with room to spare.
pub const MAX_REPLY: u32 = 32 << 20;
/// A chunk's bytes follow.
pub const TAG_DATA: u8 = 0;
/// A chunk of zeros: nothing follows.
pub const TAG_HOLE: u8 = 1;
/// The holder gave up; a [`Refusal`] follows.
pub const TAG_ABORT: u8 = 2;

/// What an asker wants: the shard of `layers` of the model whose content hash is
/// `source`, in `format`, from chunk `from_chunk` on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    /// BLAKE3 of the full source GGUF.
    pub source: SourceHash,
    /// The layers of the source the shard holds.
    pub layers: LayerRange,
    /// The asker's [`shoal_gguf::shard::SHARD_FORMAT`]: the bytes of a shard depend on it.
    pub format: u32,
    /// The first chunk wanted (the asker already holds the ones before it).
    pub from_chunk: u64,
}

/// The holder's first answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// The shard's manifest; its chunks follow.
    Manifest(Manifest),
    /// The holder will not send it, and why.
    Refused(Refusal),
}

/// Why a holder did not (or stopped to) send a shard; sent to the asker as a message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Refusal {
    /// It holds neither the shard nor the source model.
    #[error("holds neither the shard nor its source model")]
    NotHere,
    /// The range is not a valid part of the model (outside it, or off its layer period).
    #[error("bad layer range: {why}")]
    BadRange {
        /// What is wrong with it.
        why: String,
    },
    /// The asker and holder write shards differently.
    #[error("shard format {asked} asked, this holder writes {ours}")]
    Format {
        /// The asker's format.
        asked: u32,
        /// The holder's.
        ours: u32,
    },
    /// `from_chunk` is past the end of the shard.
    #[error("chunk {from_chunk} asked, the shard has {chunks}")]
    BadChunk {
        /// What was asked.
        from_chunk: u64,
        /// How many chunks there are.
        chunks: u64,
    },
    /// As many transfers as the holder allows are running; ask again later or elsewhere.
    #[error("busy: {max} transfers already running")]
    Busy {
        /// The holder's cap.
        max: usize,
    },
    /// The request could not be read.
    #[error("malformed request: {why}")]
    BadRequest {
        /// What was wrong.
        why: String,
    },
    /// The holder failed (reading its file, building the shard).
    #[error("the holder failed: {why}")]
    Failed {
        /// What failed.
        why: String,
    },
}

/// Why a message could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The announced length is over the bound.
    #[error("a message of {len} bytes is over the limit of {max}")]
    TooLong {
        /// Announced.
        len: u32,
        /// Allowed.
        max: u32,
    },
    /// The stream ended before the message did.
    #[error("the stream ended inside a message")]
    Truncated,
    /// The stream failed.
    #[error("stream: {0}")]
    Stream(String),
    /// The bytes are not the message.
    #[error("bad message: {0}")]
    Json(#[from] serde_json::Error),
}

/// Write `msg` as `[len][json]`; refused past [`MAX_REPLY`], the most any reader takes.
pub async fn write_msg<T: Serialize>(send: &mut quinn::SendStream, msg: &T) -> Result<(), WireError> {
    let json = serde_json::to_vec(msg)?;
    let len = u32::try_from(json.len()).unwrap_or(u32::MAX);
    if len > MAX_REPLY {
        return Err(WireError::TooLong { len, max: MAX_REPLY });
    }
    send.write_all(&len.to_be_bytes()).await.map_err(|e| WireError::Stream(e.to_string()))?;
    send.write_all(&json).await.map_err(|e| WireError::Stream(e.to_string()))
}

/// Read one `[len][json]` message of at most `max` bytes. Memory grows with the bytes
/// that arrive, not with the length announced.
pub async fn read_msg<T: DeserializeOwned>(recv: &mut quinn::RecvStream, max: u32) -> Result<T, WireError> {
    let mut len = [0u8; 4];
    read_exact(recv, &mut len).await?;
    let len = u32::from_be_bytes(len);
    if len > max {
        return Err(WireError::TooLong { len, max });
    }
    let mut buf = Vec::new();
    while buf.len() < len as usize {
        match recv.read_chunk(len as usize - buf.len(), true).await {
            Ok(Some(chunk)) => buf.extend_from_slice(&chunk.bytes),
            Ok(None) => return Err(WireError::Truncated),
            Err(e) => return Err(WireError::Stream(e.to_string())),
        }
    }
    Ok(serde_json::from_slice(&buf)?)
}

/// Fill `buf` from the stream.
pub async fn read_exact(recv: &mut quinn::RecvStream, buf: &mut [u8]) -> Result<(), WireError> {
    recv.read_exact(buf).await.map_err(|e| match e {
        quinn::ReadExactError::FinishedEarly(_) => WireError::Truncated,
        quinn::ReadExactError::ReadError(e) => WireError::Stream(e.to_string()),
    })
}
