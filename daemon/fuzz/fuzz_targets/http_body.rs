//! Fuzz target: any body a client POSTs to any of the API's request routes (OpenAI,
//! Anthropic, Ollama), through the real router over a small fake backend, is answered
//! without a panic and without a server error: a bad body is a 4xx in the route's
//! shape, a good one runs (against a byte vocabulary whose model answers a few tokens;
//! JSON schemas become grammars on the way).
#![no_main]

use axum::body::Body;
use axum::extract::ConnectInfo;
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use shoal_api::{Access, Backend, ChatMessage, Failure, ModelInfo, ModelState, PullProgress, Sampled, TextModel};
use shoal_pipeline::{GenerateRequest, Report};
use shoal_types::{CatalogEntry, TokenId};
use std::sync::Arc;
use tokio::sync::mpsc;
use tower::ServiceExt;

/// The routes that take a body (the first input byte picks one).
const ROUTES: [(&str, &str); 8] = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/api/chat"),
    ("POST", "/api/generate"),
    ("POST", "/api/show"),
    ("POST", "/api/pull"),
    ("DELETE", "/api/delete"),
];

/// Token = byte; 256 ends a generation.
struct Bytes;

impl TextModel for Bytes {
    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, String> {
        Ok(messages.iter().map(|m| format!("<{}>{}", m.role, m.content)).collect())
    }
    fn tokenize(&self, text: &str, _parse_special: bool) -> Vec<TokenId> {
        text.bytes().map(TokenId::from).collect()
    }
    fn piece(&self, token: TokenId) -> Vec<u8> {
        u8::try_from(token).map(|b| vec![b]).unwrap_or_default()
    }
    fn eog_tokens(&self) -> Vec<TokenId> {
        vec![256]
    }
}

struct Fake(shoal_api::Metrics);

impl Backend for Fake {
    async fn models(&self) -> Vec<ModelInfo> {
        let entry = CatalogEntry {
            name: "tiny".into(),
            content_hash: "a".repeat(64),
            size: 1000,
            arch: "llama".into(),
            n_layer: 4,
            context_length: 2048,
            quantisation: "Q8_0".into(),
            layer_period: 1,
            holders: Default::default(),
            header_hash: None,
        };
        vec![ModelInfo { entry, state: ModelState::Ready, context: Some(256) }]
    }
    fn metrics(&self) -> &shoal_api::Metrics {
        &self.0
    }
    fn key_scope(&self, _key: &str) -> Option<shoal_types::KeyScope> {
        None
    }
    async fn load(&self, _model: &str) -> Result<(), Failure> {
        Ok(())
    }
    async fn unload(&self, _model: &str) -> Result<(), Failure> {
        Ok(())
    }
    async fn remove(&self, _model: &str) -> Result<(), Failure> {
        Ok(())
    }
    async fn pull(&self, source: &str, progress: mpsc::UnboundedSender<PullProgress>) -> Result<String, Failure> {
        let _ = progress.send(PullProgress { completed: 1, total: Some(2) });
        Ok(source.chars().take(16).collect())
    }
    async fn text(&self, _model: &str) -> Result<Arc<dyn TextModel>, Failure> {
        Ok(Arc::new(Bytes))
    }
    async fn generate(
        &self,
        _model: &str,
        request: GenerateRequest,
        tokens: mpsc::UnboundedSender<Sampled>,
    ) -> Result<Report, Failure> {
        // What the coordinator would refuse is refused here too.
        request.validate(256).map_err(Failure::bad)?;
        let answer = b"{\"a\":1}".iter().map(|&b| TokenId::from(b)).chain([256]);
        let made: Vec<TokenId> = answer.take(request.max_new as usize).collect();
        // Log-probabilities when asked, as a tail reports them (a token outside the
        // vocabulary among the alternatives too: its piece is empty).
        let top_n = request.sampling.get("logprobs").and_then(serde_json::Value::as_u64);
        for &t in &made {
            let lp = top_n.map(|n| shoal_types::TokenLogprobs {
                logprob: if t == 256 { f32::NEG_INFINITY } else { -0.5 },
                top: (0..n as i32).map(|i| (t + i * 100, -0.5 - i as f32)).collect(),
            });
            let _ = tokens.send((t, lp));
        }
        Ok(Report { tokens: made, ..Report::default() })
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, body)) = data.split_first() else { return };
    let (method, path) = ROUTES[usize::from(pick) % ROUTES.len()];
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    runtime.block_on(async {
        let access = Access { open: true, ..Access::default() };
        let router = shoal_api::router(Arc::new(Fake(shoal_api::Metrics::new())), access);
        let mut req = axum::http::Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_vec()))
            .expect("a request");
        req.extensions_mut().insert(ConnectInfo(std::net::SocketAddr::from(([127, 0, 0, 1], 9))));
        let response = router.oneshot(req).await.expect("the router is infallible");
        let status = response.status().as_u16();
        let bytes = response.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        assert!(status < 500 || status == 503, "{method} {path}: status {status}: {}", String::from_utf8_lossy(&bytes));
    });
});
