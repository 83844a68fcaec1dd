//! The node process's engine: llama.cpp stages ([`LlamaStage`]) on shard files, with
//! the samplers the tail uses. The node crate never links llama.cpp; it gets this.

use shoal_engine::{LlamaStage, Sampler, SamplingParams, StageConfig};
use shoal_node::runtime::{Engine, StageSizing};
use shoal_pipeline::SamplerFactory;
use shoal_types::{LayerRange, Stage, TokenSampler};
use std::path::Path;
use std::sync::Arc;

/// llama.cpp on this machine's CPU (and GPU layers where built with one).
pub struct LlamaEngine {
    /// CPU threads per stage.
    pub threads: u32,
    /// Layers to offload to a GPU.
    pub gpu_layers: u32,
}

impl Engine for LlamaEngine {
    fn load(&self, shard: &Path, layers: LayerRange, n_layer: u32, s: StageSizing) -> Result<Box<dyn Stage>, String> {
        let config = StageConfig {
            n_ctx_per_session: s.context,
            max_sessions: s.sessions,
            chunk: s.chunk,
            threads: self.threads,
            gpu_layers: self.gpu_layers,
        };
        let stage = LlamaStage::load(shard, layers, n_layer, &config).map_err(|e| e.to_string())?;
        Ok(Box::new(stage))
    }

    fn samplers(&self) -> SamplerFactory {
        Arc::new(|v: &serde_json::Value| {
            let params: SamplingParams = serde_json::from_value(v.clone()).map_err(|e| e.to_string())?;
            // The coordinator and the tail checked them; this is the last gate before llama.cpp.
            params.validate().map_err(|e| e.to_string())?;
            Ok(Box::new(Sampler::new(&params)) as Box<dyn TokenSampler>)
        })
    }
}
