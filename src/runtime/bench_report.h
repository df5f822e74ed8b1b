// Benchmark rows and their CSV / SVG output (shared by the CPU and CUDA benches).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dsx {

struct BenchRow {
  int64_t context = 0;
  int64_t prefill_tokens = 0;
  double prefill_tok_s = 0;
  double decode_tok_s = 0;
  // roofline figures (CUDA backend; 0 when unknown)
  double bytes_per_token = 0;
  double achieved_gb_s = 0;
  double roofline_fraction = 0;
  double projected_tok_s = 0;  // full-depth model projection
};

void write_bench_csv(const std::string& path, const std::vector<BenchRow>& rows);
void write_bench_svg(const std::string& path, const std::vector<BenchRow>& rows, const std::string& title);

}  // namespace dsx
