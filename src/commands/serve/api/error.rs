//! OpenAI-shaped errors: every refusal the server gives, from a malformed body to a full queue,
//! is one `{"error": {message, type, param, code}}` object, which the `openai` clients read.
//! Kept apart so the request checks, the scheduler hand-off and the router share one type
//! without depending on each other.

use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Seconds a client is told to wait when the queue is full.
const RETRY_AFTER_S: u32 = 1;

/// An OpenAI-shaped error response.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 naming the field at fault (`None`: the request as a whole).
    pub fn invalid(param: Option<&'static str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code: None,
        }
    }

    /// A 500: the model or the scheduler failed.
    pub fn server(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code,
        }});
        let mut r = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
        }
        r
    }
}

/// Any path the server does not have: 404 naming the ones it has.
pub async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: "unknown endpoint: the server has /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics".into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("not_found"),
    }
}

/// A known path asked with the wrong method: 405 in OpenAI's error shape (axum's own is an empty
/// body), naming the method the path takes.
pub async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let allowed = match uri.path() {
        "/v1/chat/completions" | "/v1/completions" => "POST",
        _ => "GET",
    };
    let err = ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!(
            "method {method} is not allowed on {}: use {allowed}",
            uri.path()
        ),
        kind: "invalid_request_error",
        param: None,
        code: Some("method_not_allowed"),
    };
    let mut r = err.into_response();
    r.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static(allowed));
    r
}
