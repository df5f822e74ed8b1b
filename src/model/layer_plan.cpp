#include "model/layer_plan.h"

#include "util/error.h"

namespace dsx {

LayerPlan layer_plan(const ModelConfig& c, int l) {
  LayerPlan p;
  p.layer = l;
  if (c.family == Family::V41) {
    p.ratio = c.ratio(l);
    p.kv_source = c.is_kv_source(l);
    p.index_source = p.ratio > 0 && c.is_index_source(l);
    p.source = p.ratio > 0 ? c.kv_source_of(l) : -1;
    p.candidate_source = p.index_source && l == c.candidate_source_layer;
    p.uses_candidates = p.index_source && c.candidate_source_layer >= 0 && c.candidate_source_layer < l;
  }
  p.engram = c.engram_index(l);
  p.tap = c.tap_index(l);
  return p;
}

std::string describe_layer_plan(const ModelConfig& c) {
  std::string s;
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerPlan p = layer_plan(c, l);
    s += cat(l, ": ", p.ratio == 0 ? "window" : cat("ratio ", p.ratio, " reads ", p.source));
    if (p.kv_source) s += ", kv source";
    if (p.index_source) s += ", index source";
    if (p.candidate_source) s += ", candidate source";
    if (p.uses_candidates) s += ", candidates";
    if (p.compressed() && !p.index_source) s += ", reuses top-k";
    if (p.engram >= 0) s += ", engram";
    if (p.tap >= 0) s += cat(", tap ", p.tap);
    s += "\n";
  }
  return s;
}

}  // namespace dsx
