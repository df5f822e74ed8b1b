// Reasoning the server hands out (Anthropic thinking-block signatures, Responses
// reasoning encrypted_content) carries a MAC with a per-process secret, so that the
// server recognises its own reasoning when a client sends it back (and can re-render it
// exactly), and ignores anything forged or from another server.
#pragma once
#include <optional>
#include <string>
#include <string_view>

namespace dsx::server {

// HMAC-SHA256 of `text` under `secret`, lowercase hex (64 characters).
std::string mac_hex(std::string_view secret, std::string_view text);
// Whether mac == mac_hex(secret, text) (constant-time comparison).
bool mac_ok(std::string_view secret, std::string_view text, std::string_view mac);

// A self-contained sealed blob of `text`: base64url of (text bytes) + "." + mac. open()
// returns the text when the blob is one of this secret's, nullopt otherwise.
std::string seal(std::string_view secret, std::string_view text);
std::optional<std::string> open(std::string_view secret, std::string_view blob);

// 32 random bytes as hex (a fresh secret).
std::string new_secret();

}  // namespace dsx::server
