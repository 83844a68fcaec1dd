//! The model zoo's families (tiny random-weight GGUFs written by `shoal_gguf::zoo`)
//! through what a user's model goes through: the planner's memory prediction per stage
//! against what llama.cpp allocates for it, and `shoal run` split against unsplit.
//! (The engine's tests check every split of each family bit for bit.)

mod common;

use common::model;
use shoal_engine::{load_split, ShardCache, StageConfig};
use shoal_gguf::zoo::Family;
use shoal_planner::model::{ModelProfile, Sizing};
use shoal_types::Stage;

#[test]
fn the_planners_memory_prediction_is_within_one_percent_of_llama_cpps_for_every_zoo_family_and_gemma3() {
    let dir = tempfile::tempdir().unwrap();
    let cache = ShardCache::new(dir.path().join("shards"));
    let sizing = Sizing { context: 512, sessions: 2, chunk: 32 };
    let config = StageConfig {
        n_ctx_per_session: sizing.context,
        max_sessions: sizing.sessions,
        chunk: sizing.chunk,
        threads: 1,
        gpu_layers: 0,
        gpus: Vec::new(),
    };
    // Each zoo family split in the middle, and Gemma 3 (two kinds of layer, two KV caches)
    // split inside its sliding-window pattern.
    let mut models: Vec<(std::path::PathBuf, u32)> = Family::ALL
        .iter()
        .map(|family| {
            let path = dir.path().join(format!("{}.gguf", family.arch()));
            shoal_gguf::zoo::write(*family, &model("SmolLM2-135M-Instruct.Q4_1.gguf"), &path).unwrap();
            // The middle (4 layers: 2; Llama 4's 8, on its period of 4: 4).
            (path, family.layers() / 2)
        })
        .collect();
    models.push((model("gemma-3-270m-q4_k_m.gguf"), 9));
    for (path, point) in &models {
        let (meta, stages) = load_split(path, &[*point], &cache, &config).unwrap();
        let family = meta.arch;
        let profile = ModelProfile::from_meta(&meta);
        for stage in &stages {
            let layers = stage.info().layers;
            let (predicted, loaded) = (profile.stage_memory(layers, &sizing), stage.memory());
            let (p, l) = (predicted.total() as f64, loaded.total() as f64);
            eprintln!(
                "{} layers {layers}: predicted {predicted:?}, llama.cpp {loaded:?}, ratio {:.4}",
                family.name(),
                l / p
            );
            assert_eq!(predicted.weights, loaded.weights, "{} {layers}", family.name());
            // The KV cache exactly, up to llama.cpp's rounding of each of its (at most
            // two) buffers to 0.01 MiB: at the zoo's sizes the total's 1% would hide a
            // cache counted twice over (values that latent attention does not store).
            let rounding = 2 * 5243;
            assert!(
                predicted.kv.abs_diff(loaded.kv) <= rounding,
                "{} {layers}: KV predicted {}, llama.cpp {}",
                family.name(),
                predicted.kv,
                loaded.kv
            );
            assert!((l / p - 1.0).abs() <= 0.01, "{} {layers}: predicted {p}, llama.cpp {l}", family.name());
        }
    }
}
