// The three wire APIs: each parses its request body into a GenRequest (or an ApiError
// in its own error shape) and makes the Sink that writes its answer into a Channel.
// Implemented in api_chat.cpp (POST /v1/chat/completions), api_messages.cpp
// (POST /v1/messages, /v1/messages/count_tokens) and api_responses.cpp (POST /v1/responses).
#pragma once
#include <memory>
#include <string>
#include <string_view>

#include "server/api.h"
#include "server/channel.h"

namespace dsx::server {

// Server-wide state the adapters read: the replay map of sampled DSML blocks (exact
// re-rendering of tool calls, spec chat-and-serving.md §3.7) and the secret that
// signs reasoning the server hands to clients (Anthropic thinking signatures,
// Responses encrypted_content) so that it can recognise it when it comes back.
struct AdapterContext {
  text::ReplayMap* replay = nullptr;
  std::string secret;            // random per server process (32 bytes hex)
  std::string model_id;          // the served model's canonical id
  int64_t context_tokens = 0;    // the server's context per session
};

enum class Api { Chat, Messages, Responses };

struct Adapter {
  Api api;
  // Body -> request; false with err set (in this API's terms) when the request cannot run.
  bool (*parse)(std::string_view body, const AdapterContext& ctx, GenRequest& out, ApiError& err);
  // The sink of one request's answer (streaming or not, per req.stream).
  std::shared_ptr<Sink> (*make_sink)(const GenRequest& req, const AdapterContext& ctx, std::shared_ptr<Channel> ch);
  // An error body in this API's shape (JSON text).
  std::string (*error_body)(const ApiError& e);
};

const Adapter& chat_adapter();
const Adapter& messages_adapter();
const Adapter& responses_adapter();

}  // namespace dsx::server
