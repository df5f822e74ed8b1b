// The text layer's detokenizer behind the generation loop's TokenText interface
// (runtime/generate.h): a StreamDecoder over a Tokenizer, which releases only complete
// UTF-8 (chat-and-serving.md §1.6).
#pragma once
#include <cstdint>
#include <string>

#include "runtime/generate.h"
#include "text/tokenizer.h"

namespace dsx::text {

class StreamTokenText final : public TokenText {
 public:
  // The tokenizer must outlive this object.
  explicit StreamTokenText(const Tokenizer& tok) : dec_(tok) {}
  std::string push(int32_t id) override { return dec_.push(id); }
  std::string flush() override { return dec_.flush(); }

 private:
  StreamDecoder dec_;
};

}  // namespace dsx::text
