#include "runtime/bench_report.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "util/error.h"
#include "util/mmap_file.h"

namespace dsx {

void write_bench_csv(const std::string& path, const std::vector<BenchRow>& rows) {
  std::ostringstream o;
  o << "context,prefill_tokens,prefill_tok_s,decode_tok_s,bytes_per_token,achieved_gb_s,roofline_fraction,projected_tok_s\n";
  for (const auto& r : rows)
    o << r.context << ',' << r.prefill_tokens << ',' << r.prefill_tok_s << ',' << r.decode_tok_s << ','
      << r.bytes_per_token << ',' << r.achieved_gb_s << ',' << r.roofline_fraction << ',' << r.projected_tok_s << '\n';
  const std::string s = o.str();
  write_file_atomic(path, s.data(), s.size());
}

void write_bench_svg(const std::string& path, const std::vector<BenchRow>& rows, const std::string& title) {
  if (rows.empty()) fail("no benchmark rows to plot");
  const double W = 720, H = 420, L = 70, R = 70, T = 40, B = 50;
  double maxd = 0, maxp = 0;
  for (const auto& r : rows) {
    maxd = std::max(maxd, r.decode_tok_s);
    maxp = std::max(maxp, r.prefill_tok_s);
  }
  maxd = maxd > 0 ? maxd * 1.1 : 1;
  maxp = maxp > 0 ? maxp * 1.1 : 1;
  const double lx0 = std::log2(static_cast<double>(rows.front().context));
  const double lx1 = std::max(lx0 + 1, std::log2(static_cast<double>(rows.back().context)));
  auto X = [&](int64_t c) { return L + (std::log2(static_cast<double>(c)) - lx0) / (lx1 - lx0) * (W - L - R); };
  auto Yd = [&](double v) { return H - B - v / maxd * (H - T - B); };
  auto Yp = [&](double v) { return H - B - v / maxp * (H - T - B); };
  std::ostringstream o;
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H << "' font-family='sans-serif' font-size='12'>\n";
  o << "<rect width='100%' height='100%' fill='white'/>\n";
  std::string esc;
  for (char c : title) esc += (c == '<' ? std::string("&lt;") : c == '&' ? std::string("&amp;") : std::string(1, c));
  o << "<text x='" << W / 2 << "' y='20' text-anchor='middle'>" << esc << "</text>\n";
  o << "<line x1='" << L << "' y1='" << H - B << "' x2='" << W - R << "' y2='" << H - B << "' stroke='black'/>\n";
  o << "<line x1='" << L << "' y1='" << T << "' x2='" << L << "' y2='" << H - B << "' stroke='#1f77b4'/>\n";
  o << "<line x1='" << W - R << "' y1='" << T << "' x2='" << W - R << "' y2='" << H - B << "' stroke='#d62728'/>\n";
  for (const auto& r : rows)
    o << "<text x='" << X(r.context) << "' y='" << H - B + 16 << "' text-anchor='middle'>" << r.context << "</text>\n";
  for (int i = 0; i <= 4; ++i) {
    o << "<text x='" << L - 6 << "' y='" << Yd(maxd / 1.1 * i / 4) + 4 << "' text-anchor='end' fill='#1f77b4'>"
      << static_cast<long long>(std::lround(maxd / 1.1 * i / 4)) << "</text>\n";
    o << "<text x='" << W - R + 6 << "' y='" << Yp(maxp / 1.1 * i / 4) + 4 << "' fill='#d62728'>"
      << static_cast<long long>(std::lround(maxp / 1.1 * i / 4)) << "</text>\n";
  }
  auto poly = [&](bool decode) {
    o << "<polyline fill='none' stroke='" << (decode ? "#1f77b4" : "#d62728") << "' stroke-width='2' points='";
    for (const auto& r : rows) o << X(r.context) << ',' << (decode ? Yd(r.decode_tok_s) : Yp(r.prefill_tok_s)) << ' ';
    o << "'/>\n";
  };
  poly(true);
  poly(false);
  o << "<text x='" << W / 2 << "' y='" << H - 12 << "' text-anchor='middle'>context (tokens)</text>\n";
  o << "<text x='14' y='" << T - 8 << "' fill='#1f77b4'>decode tok/s</text>\n";
  o << "<text x='" << W - 14 << "' y='" << T - 8 << "' text-anchor='end' fill='#d62728'>prefill tok/s</text>\n";
  o << "</svg>\n";
  const std::string s = o.str();
  write_file_atomic(path, s.data(), s.size());
}

}  // namespace dsx
