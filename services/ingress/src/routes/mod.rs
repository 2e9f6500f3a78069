//! The HTTP routes, one module per area; this file is the one place they are mounted, so
//! the served router and the OpenAPI document are the same list. The turn routes (send,
//! chat, stop, retry, re-attach) join here from their own modules.

pub mod context;
pub mod export;
pub mod files;
pub mod forks;
pub mod import;
pub mod memories;
pub mod openai;
pub mod ops;
pub mod permissions;
pub mod requests;
pub mod search;
pub mod sessions;
pub mod turns;

use utoipa::OpenApi as _;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::openapi::ApiDoc;
use crate::AppState;

/// Every route with its OpenAPI description. `routes!` takes the handlers of one path.
pub fn api() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(sessions::create, sessions::list))
        .routes(routes!(sessions::get, sessions::patch, sessions::delete))
        .routes(routes!(sessions::events))
        .routes(routes!(forks::fork))
        .routes(routes!(context::context))
        .routes(routes!(requests::request))
        .routes(routes!(turns::send))
        .routes(routes!(turns::tool_results))
        .routes(routes!(turns::chat))
        .routes(routes!(turns::stop))
        .routes(routes!(turns::retry))
        .routes(routes!(turns::reattach))
        .routes(routes!(permissions::resolve))
        .routes(routes!(search::search))
        .routes(routes!(openai::conversations::create))
        .routes(routes!(
            openai::conversations::get,
            openai::conversations::update,
            openai::conversations::delete
        ))
        .routes(routes!(openai::conversations::items, openai::conversations::add_items))
        .routes(routes!(openai::conversations::item, openai::conversations::delete_item))
        .routes(routes!(openai::responses::create))
        .routes(routes!(openai::responses::retrieve))
        .routes(routes!(openai::responses::cancel))
        .routes(routes!(openai::responses::input_items))
        .routes(routes!(openai::chat::completions))
        .routes(routes!(openai::chat::models))
        .routes(routes!(export::export))
        .routes(routes!(import::import))
        .routes(routes!(files::upload, files::list))
        .routes(routes!(files::get, files::delete))
        .routes(routes!(files::content))
        .routes(routes!(memories::recall))
        .routes(routes!(ops::healthz))
        .routes(routes!(ops::readyz))
        .routes(routes!(ops::metrics))
        .routes(routes!(ops::openapi_json))
}
