// The Anthropic Messages API (POST /v1/messages, POST /v1/messages/count_tokens):
// request parsing into a GenRequest, the SSE / JSON answer, the error shape. The adapter
// itself is messages_adapter() (adapters.h); this header adds what count_tokens and the
// HTTP layer's logs need.
//
// Mapping (spec chat-and-serving.md §3.3, §4.3, §4.5, §4.6):
//   system (string | text blocks joined "\n"; blocks starting "x-anthropic-" dropped)
//     -> a leading system message; role "system" messages inside `messages` -> system
//     messages in place; user text blocks -> user content blocks (rendered "\n\n"-joined);
//     tool_result blocks -> tool messages, in order; assistant text (joined "\n\n"),
//     thinking blocks whose signature is this server's (signature = mac_hex(secret,
//     thinking), signing.h) -> reasoning_content, tool_use -> tool calls with their ids;
//     redacted_thinking ignored; images / documents -> 400 "text-only model".
//   A final assistant message is a prefill: rendered without EOS, thinking off.
//   tools {name, description, input_schema} -> {name, description, parameters}; tools
//   with a server-side "type" (web_search_20250305, bash_20250124, ...) are dropped
//   (last_dropped_tools()).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "server/adapters.h"

namespace dsx::server {

// POST /v1/messages/count_tokens: the same body as /v1/messages, max_tokens not required.
// false with err set (Anthropic terms) when the body is not a valid request.
bool parse_count_tokens(std::string_view body, const AdapterContext& ctx, GenRequest& out, ApiError& err);
// {"input_tokens": n}
std::string count_tokens_body(int64_t n);

// The names (or types, for unnamed ones) of the server tools that the last parse on this
// thread (messages_adapter().parse or parse_count_tokens) dropped, for a warning in the
// request log. Empty when none were dropped.
const std::vector<std::string>& last_dropped_tools();

}  // namespace dsx::server
