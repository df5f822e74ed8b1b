#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "util/error.h"
#include "util/safetensors.h"
#include "test_util.h"

using namespace dsx;

TEST(Safetensors, RoundTrip) {
  std::string dir = dsx_test::temp_dir("st");
  SafetensorsWriter w;
  std::vector<float> a = {1.f, 2.f, 3.f, 4.f, 5.f, 6.f};
  std::vector<int32_t> b = {7, 8, 9};
  w.add("a", DType::F32, {2, 3}, a);
  w.add("b", DType::I32, {3}, b);
  w.set_metadata("k", "v");
  w.write(dir + "/x.safetensors");
  SafetensorsFile f(dir + "/x.safetensors");
  ASSERT_EQ(f.tensors().size(), 2u);
  const auto& ta = f.get("a");
  EXPECT_EQ(ta.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(ta.as<float>()[5], 6.f);
  EXPECT_EQ(f.get("b").as<int32_t>()[2], 9);
  EXPECT_EQ(f.metadata().at("k"), "v");
}

static std::string write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream o(path, std::ios::binary);
  o.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

static std::string with_header(const std::string& json, const std::string& data) {
  uint64_t n = json.size();
  std::string s(reinterpret_cast<const char*>(&n), 8);
  return s + json + data;
}

TEST(Safetensors, Errors) {
  std::string dir = dsx_test::temp_dir("st_err");
  auto expect_error = [&](const std::string& name, const std::string& bytes, const std::string& needle) {
    std::string p = write_bytes(dir + "/" + name, bytes);
    try {
      SafetensorsFile f(p);
      FAIL() << name << ": no error";
    } catch (const Error& e) {
      std::string m = e.what();
      EXPECT_NE(m.find(p), std::string::npos) << m;
      EXPECT_NE(m.find(needle), std::string::npos) << m;
    }
  };
  expect_error("short", "abc", "truncated");
  expect_error("hdr", std::string("\xff\x00\x00\x00\x00\x00\x00\x00{}", 10), "header");
  expect_error("json", with_header("{not json", ""), "JSON");
  expect_error("dtype", with_header(R"({"x":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}})", "a"), "dtype");
  expect_error("trunc", with_header(R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", "abcd"), "'x'");
  expect_error("size", with_header(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "abcd"), "shape");
}
