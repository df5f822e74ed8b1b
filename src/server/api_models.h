// GET /v1/models and GET /v1/models/{id} (OpenAI shape, implemented in api_chat.cpp).
// One model is served under any id: the list names ctx.model_id; a lookup of any id
// answers the model object with that id (clients pass their configured name through).
#pragma once
#include <string>

#include "server/adapters.h"

namespace dsx::server {

// GET /v1/models/{id}: {"id": id, "object": "model", "created", "owned_by": "dsx",
// "context_length": ctx.context_tokens}. An empty id gives the list form
// (models_list_body).
std::string models_body(const AdapterContext& ctx, const std::string& id_or_empty);

// GET /v1/models: {"object": "list", "data": [the model object of ctx.model_id]}.
std::string models_list_body(const AdapterContext& ctx);

}  // namespace dsx::server
