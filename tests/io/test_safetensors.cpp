// SPDX-License-Identifier: Apache-2.0
// safetensors writer and reader: round trips for every dtype, byte-exact output against the
// reference writer's layout, reader API, whitespace, metadata and unaligned data.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "io/io_test_support.hpp"
#include "moe/io/safetensors.hpp"

namespace {

using Catch::Contains;
using moe::io::Dtype;
using moe::io::SafetensorsFile;
using moe::io::TensorView;

std::string text_of(std::vector<std::byte> const& bytes, std::size_t begin, std::size_t count) {
  std::string out(count, '\0');
  std::memcpy(out.data(), bytes.data() + begin, count);
  return out;
}

// Bytes as a std::string, so that Catch prints a mismatch readably.
std::string text(std::vector<std::byte> const& bytes) { return text_of(bytes, 0, bytes.size()); }

std::vector<std::byte> f32_bytes(std::vector<float> const& values) {
  return moe::io::from_float(values, Dtype::kF32);
}

std::string accepted_or_error(std::vector<std::byte> const& bytes) {
  try {
    SafetensorsFile const file(bytes);
    return "accepted";
  } catch (moe::Error const& e) {
    return e.what();
  }
}

}  // namespace

TEST_CASE("every dtype round-trips through the writer and the reader", "[io][safetensors]") {
  std::vector<std::vector<std::byte>> data;
  std::vector<TensorView> tensors;
  for (Dtype const dtype : moe::io::kAllDtypes) {
    std::vector<std::int64_t> shape = {2, 3};
    if (moe::io::dtype_bits(dtype) == 4) shape = {2, 4};  // 8 x 4 bits = 4 bytes
    if (moe::io::dtype_bits(dtype) == 6) shape = {4};     // 4 x 6 bits = 3 bytes
    auto const size = moe::io::detail::byte_size<std::int64_t>(dtype, shape);
    REQUIRE(size.status == moe::io::detail::ByteSize::Status::kOk);
    std::vector<std::byte> bytes = iotest::ramp(size.bytes);
    for (auto& b : bytes) b ^= static_cast<std::byte>(static_cast<int>(dtype) * 7);
    data.push_back(std::move(bytes));
    tensors.push_back(TensorView{"t." + std::string(moe::io::dtype_name(dtype)), dtype, shape, {}});
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) tensors[i].bytes = data[i];

  std::vector<std::byte> const file_bytes = moe::io::serialize_safetensors(tensors);
  SafetensorsFile const file(file_bytes);
  REQUIRE(file.size() == tensors.size());
  for (TensorView const& want : tensors) {
    INFO(want.name);
    TensorView const& got = file.tensor(want.name);
    CHECK(got.dtype == want.dtype);
    CHECK(got.shape == want.shape);
    REQUIRE(got.bytes.size() == want.bytes.size());
    CHECK(std::memcmp(got.bytes.data(), want.bytes.data(), want.bytes.size()) == 0);
    // The reference layout aligns each tensor to its element size within the file.
    auto const element_bytes = std::max<std::size_t>(1, moe::io::dtype_bits(got.dtype) / 8);
    CHECK(static_cast<std::size_t>(got.bytes.data() - file_bytes.data()) % element_bytes == 0);
    if (moe::io::converts_to_float(got.dtype)) {
      std::vector<float> const a = moe::io::to_float(got);
      std::vector<float> const b = moe::io::to_float(want);
      REQUIRE(a.size() == b.size());
      CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    }
  }
  // Each dtype alone, too (a different header length, so different padding).
  for (TensorView const& t : tensors) {
    std::vector<std::byte> const one = moe::io::serialize_safetensors(std::span(&t, 1));
    SafetensorsFile const f(one);
    REQUIRE(f.size() == 1);
    CHECK(f.tensors()[0].dtype == t.dtype);
    CHECK(f.tensors()[0].bytes.size() == t.bytes.size());
  }
}

TEST_CASE("the writer's bytes match the reference writer's for its own test tensors",
          "[io][safetensors]") {
  // huggingface/safetensors tensor.rs test_serialization: "attn.0", F32 [1, 2, 3], 0..5.
  std::vector<std::byte> const data = f32_bytes({0, 1, 2, 3, 4, 5});
  {
    TensorView const t{"attn.0", Dtype::kF32, {1, 2, 3}, data};
    std::string const header =
        R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";  // 64 bytes
    CHECK(text(moe::io::serialize_safetensors(std::span(&t, 1))) ==
          text(iotest::image(header, data)));
  }
  // test_serialization_forced_alignement: "attn0", [1, 1, 2, 3]: 65 bytes, padded to 72.
  {
    TensorView const t{"attn0", Dtype::kF32, {1, 1, 2, 3}, data};
    std::string const header =
        R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})"
        "       ";
    CHECK(text(moe::io::serialize_safetensors(std::span(&t, 1))) ==
          text(iotest::image(header, data)));
  }
  // test_empty: no tensors, with and without metadata.
  CHECK(text(moe::io::serialize_safetensors({})) == text(iotest::image("{}      ")));
  CHECK(text(moe::io::serialize_safetensors({}, {{"framework", "pt"}})) ==
        text(iotest::image(R"({"__metadata__":{"framework":"pt"}})"
                           "     ")));
}

TEST_CASE("the writer orders tensors by dtype (descending) then name, metadata first",
          "[io][safetensors]") {
  std::vector<std::byte> const i64(8, std::byte{1});
  std::vector<std::byte> const f32a(4, std::byte{2}), f32b(4, std::byte{3});
  std::vector<std::byte> const bf16(4, std::byte{4});
  std::vector<std::byte> const u8(3, std::byte{5});
  std::vector<TensorView> const tensors = {
      {"b", Dtype::kF32, {1}, f32b}, {"a", Dtype::kBf16, {2}, bf16},
      {"z", Dtype::kI64, {1}, i64},  {"a2", Dtype::kF32, {1}, f32a},
      {"emb", Dtype::kU8, {3}, u8},  {"q\"\n\x01\xc3\xa9", Dtype::kU8, {0}, {}}};
  moe::io::Metadata const metadata = {{"b", "2"}, {"a", "1"}};
  std::vector<std::byte> const out = moe::io::serialize_safetensors(tensors, metadata);

  std::string const json =
      R"({"__metadata__":{"a":"1","b":"2"},)"
      R"("z":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},)"
      R"("a2":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},)"
      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[12,16]},)"
      R"("a":{"dtype":"BF16","shape":[2],"data_offsets":[16,20]},)"
      R"("emb":{"dtype":"U8","shape":[3],"data_offsets":[20,23]},)"
      "\"q\\\"\\n\\u0001\xc3\xa9\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[23,23]}}";
  std::string padded = json;
  padded.resize((json.size() + 7) / 8 * 8, ' ');
  std::vector<std::byte> data;
  for (auto const* d : {&i64, &f32a, &f32b, &bf16, &u8})
    data.insert(data.end(), d->begin(), d->end());
  CHECK(text_of(out, 8, padded.size()) == padded);
  CHECK(text(out) == text(iotest::image(padded, data)));

  // And it reads back, names unescaped.
  SafetensorsFile const file(out);
  CHECK(file.metadata() == metadata);
  REQUIRE(file.contains("q\"\n\x01\xc3\xa9"));
  CHECK(file.tensors().front().name == "z");
}

TEST_CASE("save_safetensors writes the serialized bytes; SafetensorsFile maps them back",
          "[io][safetensors]") {
  std::filesystem::path const dir = iotest::scratch_dir("save_and_map");
  std::vector<float> const router = {0.5f, -1.0f, 2.0f, 3.5f, 1e-3f, -7.0f};
  moe::io::SafetensorsWriter writer;
  writer.add_f32("router.weight", {2, 3}, router)
      .add_bf16("experts.0.w1", {3, 2}, router)
      .add_f16("experts.0.w2", {6}, router)
      .set_metadata("format", "pt");
  writer.save(dir / "model.safetensors");
  CHECK(text(iotest::read_file(dir / "model.safetensors")) == text(writer.serialize()));
  std::size_t files = 0;  // no temporary left behind
  for (auto const& entry : std::filesystem::directory_iterator(dir)) files += entry.exists();
  CHECK(files == 1);

  SafetensorsFile const file(dir / "model.safetensors");
  CHECK(file.display_name() == (dir / "model.safetensors").string());
  CHECK(file.metadata().at("format") == "pt");
  CHECK(moe::io::to_float(file.tensor("router.weight")) == router);
  std::vector<float> const w1 = moe::io::to_float(file.tensor("experts.0.w1"));
  std::vector<float> const w2 = moe::io::to_float(file.tensor("experts.0.w2"));
  for (std::size_t i = 0; i < router.size(); ++i) {
    CHECK(w1[i] == Approx(router[i]).epsilon(1.0 / 256));
    CHECK(w2[i] == Approx(router[i]).epsilon(1.0 / 2048));
  }
  CHECK(file.tensor("experts.0.w1").shape == std::vector<std::int64_t>{3, 2});
}

TEST_CASE("save_safetensors replaces only regular files, and its errors carry errno's text",
          "[io][safetensors]") {
  namespace fs = std::filesystem;
  fs::path const dir = iotest::scratch_dir("save_outputs");
  moe::io::SafetensorsWriter writer;
  writer.add_f32("w", {2}, std::vector<float>{1.0f, 2.0f});
  auto error_of = [&](fs::path const& path) {
    try {
      writer.save(path);
    } catch (moe::Error const& e) {
      return std::string(e.what());
    }
    return std::string("(saved)");
  };
  fs::create_directory(dir / "a_dir");
  CHECK_THAT(error_of(dir / "a_dir"), Contains("exists and is a directory") &&
                                          Contains("will not replace it, pass another path"));
  iotest::write_text(dir / "target", "keep me");
  fs::create_symlink(dir / "target", dir / "link");
  CHECK_THAT(error_of(dir / "link"), Contains("exists and is a symbolic link"));
  CHECK(fs::is_symlink(dir / "link"));
  REQUIRE(::mkfifo((dir / "fifo").c_str(), 0600) == 0);
  CHECK_THAT(error_of(dir / "fifo"), Contains("exists and is a FIFO"));
  CHECK(fs::is_fifo(dir / "fifo"));
  CHECK_THAT(error_of("/dev/null"), Contains("exists and is a character device"));
  CHECK_THAT(error_of(dir / "missing_dir" / "w.safetensors"),
             Contains("cannot create") && Contains("No such file or directory"));
  CHECK(error_of(dir / "target") == "(saved)");  // a regular file is replaced
  CHECK(SafetensorsFile(dir / "target").contains("w"));
  std::size_t files = 0;  // and no temporary is left behind by any of the failures
  for (auto const& entry : fs::directory_iterator(dir))
    files += entry.is_regular_file() && !entry.is_symlink();
  CHECK(files == 1);

  // check_output_file: the same file by device and inode, whatever the name.
  fs::create_hard_link(dir / "target", dir / "hard");
  fs::path const inputs[] = {dir / "target"};
  CHECK_THROWS_WITH(moe::io::check_output_file(dir / "hard", inputs, "out"),
                    Contains("out: the output") && Contains("is the input"));
  CHECK_NOTHROW(moe::io::check_output_file(dir / "new.safetensors", inputs, "out"));
  CHECK(moe::io::same_file(dir / "link", dir / "target"));
  CHECK_FALSE(moe::io::same_file(dir / "target", dir / "nothing"));
}

TEST_CASE("the writer rejects inconsistent or unrepresentable tensors", "[io][safetensors]") {
  std::vector<std::byte> const twelve(12);
  moe::io::SafetensorsWriter w;
  CHECK_THROWS_WITH(w.add("x", Dtype::kF32, {2, 2}, twelve),
                    Catch::Contains("tensor 'x': holds 12 bytes but F32 [2, 2] needs 16"));
  CHECK_THROWS_WITH(w.add("x", Dtype::kF4, {3}, std::span(twelve).first(1)),
                    Catch::Contains("not a whole number of bytes"));
  std::vector<TensorView> const dup = {{"x", Dtype::kU8, {12}, twelve},
                                       {"x", Dtype::kU8, {12}, twelve}};
  CHECK_THROWS_WITH(moe::io::serialize_safetensors(dup), Catch::Contains("'x' is given twice"));
  std::vector<TensorView> const reserved = {{"__metadata__", Dtype::kU8, {12}, twelve}};
  CHECK_THROWS_WITH(moe::io::serialize_safetensors(reserved),
                    Catch::Contains("cannot be named \"__metadata__\""));
  std::vector<TensorView> const bad_utf8 = {{"\xff", Dtype::kU8, {12}, twelve}};
  CHECK_THROWS_WITH(moe::io::serialize_safetensors(bad_utf8), Catch::Contains("not valid UTF-8"));
  CHECK_THROWS_WITH(moe::io::save_safetensors("/nonexistent-dir/x.safetensors", {}),
                    Catch::Contains("cannot create '/nonexistent-dir/x.safetensors.tmp."));
}

TEST_CASE("JSON whitespace around the header is accepted, other padding is not",
          "[io][safetensors]") {
  // tensor.rs test_whitespace_padded_header: "{}" + CR SP TAB LF.
  CHECK(accepted_or_error(iotest::image("{}\x0D\x20\x09\x0A")) == "accepted");
  // Leading whitespace (accepted by the reference since the '{' check was left commented out).
  CHECK(accepted_or_error(iotest::image("\x09\x0A{}\x0D\x20")) == "accepted");
  std::vector<std::byte> const data = iotest::ramp(4);
  SafetensorsFile const file(
      iotest::image("  \n{ \"t\" : { \"dtype\" : \"U8\" ,\t\"shape\" : [ 4 ] , \"data_offsets\" : "
                    "[ 0 , 4 ] } }\n   ",
                    data));
  CHECK(file.tensor("t").bytes.size() == 4);
  // NUL or form-feed padding is not JSON whitespace.
  CHECK_THAT(accepted_or_error(iotest::image(std::string("{}\0\0", 4))),
             Catch::Contains("unexpected byte 0x00 after the end of the JSON value"));
  CHECK_THAT(accepted_or_error(iotest::image("\x0c{}")),
             Catch::Contains("unexpected byte 0x0c, expected a JSON value"));
}

TEST_CASE("the reader accepts what the reference accepts", "[io][safetensors]") {
  SECTION("zero-size tensors and scalars") {
    std::vector<std::byte> const data = f32_bytes({42.0f});
    SafetensorsFile const file(
        iotest::image(R"({"e":{"dtype":"F32","shape":[2,0],"data_offsets":[0,0]},)"
                      R"("e2":{"dtype":"I64","shape":[0],"data_offsets":[0,0]},)"
                      R"("s":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})",
                      data));
    CHECK(file.tensor("e").bytes.empty());
    CHECK(file.tensor("e").num_elements() == 0);
    CHECK(file.tensor("s").shape.empty());
    CHECK(file.tensor("s").num_elements() == 1);
    CHECK(moe::io::to_float(file.tensor("s")) == std::vector<float>{42.0f});
    CHECK(moe::io::to_float(file.tensor("e")).empty());
  }
  SECTION("tensors listed out of offset order, sorted by the reader") {
    SafetensorsFile const file(
        iotest::image(R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},)"
                      R"("a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})",
                      iotest::ramp(4)));
    REQUIRE(file.size() == 2);
    CHECK(file.tensors()[0].name == "a");
    CHECK(file.tensors()[1].name == "b");
    CHECK(std::to_integer<int>(file.tensor("b").bytes[0]) == 2);
  }
  SECTION("\"__metadata__\": null, escapes, and unknown keys in a tensor entry") {
    SafetensorsFile const none(iotest::image(R"({"__metadata__":null})"));
    CHECK(none.metadata().empty());
    SafetensorsFile const file(iotest::image(
        R"({"__metadata__":{"k\u00e9":"\ud83d\ude00\n\/"},)"
        R"("t":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":{"x":[1,2.5e3,null]}}})",
        iotest::ramp(1)));
    CHECK(file.metadata().at("k\xc3\xa9") == "\xf0\x9f\x98\x80\n/");
    CHECK(file.contains("t"));
  }
  SECTION("unaligned data is read with memcpy") {
    std::vector<std::byte> data = {std::byte{7}};
    std::vector<std::byte> const f = f32_bytes({1.5f, -2.25f});
    data.insert(data.end(), f.begin(), f.end());
    std::string header = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                         R"("b":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})";
    header.resize((header.size() + 7) / 8 * 8, ' ');  // data 8-aligned, so "b" is not
    std::vector<std::byte> const bytes = iotest::image(header, data);
    SafetensorsFile const file(bytes);
    CHECK(reinterpret_cast<std::uintptr_t>(file.tensor("b").bytes.data()) % 4 != 0);
    CHECK(moe::io::to_float(file.tensor("b")) == std::vector<float>{1.5f, -2.25f});
  }
}

TEST_CASE("integer and bool tensors convert to float", "[io][safetensors]") {
  auto le = [](std::initializer_list<int> v) {
    std::vector<std::byte> out;
    for (int b : v) out.push_back(static_cast<std::byte>(b));
    return out;
  };
  auto convert = [](Dtype dtype, std::int64_t n, std::vector<std::byte> const& bytes) {
    return moe::io::to_float(TensorView{"t", dtype, {n}, bytes});
  };
  CHECK(convert(Dtype::kI8, 3, le({0xFF, 0x7F, 0x80})) == std::vector<float>{-1, 127, -128});
  CHECK(convert(Dtype::kU8, 2, le({0xFF, 0x01})) == std::vector<float>{255, 1});
  CHECK(convert(Dtype::kBool, 3, le({0, 1, 2})) == std::vector<float>{0, 1, 1});
  CHECK(convert(Dtype::kI16, 2, le({0xFE, 0xFF, 0x00, 0x01})) == std::vector<float>{-2, 256});
  CHECK(convert(Dtype::kU16, 1, le({0xFF, 0xFF})) == std::vector<float>{65535});
  CHECK(convert(Dtype::kI32, 1, le({0xFB, 0xFF, 0xFF, 0xFF})) == std::vector<float>{-5});
  CHECK(convert(Dtype::kU32, 1, le({0x00, 0x00, 0x00, 0x80})) == std::vector<float>{2147483648.0f});
  CHECK(convert(Dtype::kI64, 1, le({0, 0, 0, 0, 0, 0xFF, 0xFF, 0xFF})) ==
        std::vector<float>{-1099511627776.0f});
  CHECK(convert(Dtype::kU64, 1, le({0, 0, 0, 0, 0, 0, 0, 0x80})) ==
        std::vector<float>{9223372036854775808.0f});
  CHECK(convert(Dtype::kF8E4M3, 2, le({0x38, 0xB8})) == std::vector<float>{1, -1});
}

TEST_CASE("reader lookups and file errors name the file and the tensor", "[io][safetensors]") {
  std::vector<std::byte> const bytes =
      iotest::image(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", iotest::ramp(1));
  SafetensorsFile const file(bytes);
  CHECK(file.display_name() == "<memory>");
  CHECK(file.find("b") == nullptr);
  CHECK(file.header_size() == bytes.size() - 9);
  CHECK_THROWS_WITH(file.tensor("b"),
                    "moe: safetensors: <memory>: no tensor named 'b' (the file has 1 tensors: "
                    "'a'); check the name against tensors()");
  SafetensorsFile const named(bytes, "layer0.safetensors");
  CHECK_THROWS_WITH(named.tensor("x"), Catch::StartsWith("moe: safetensors: layer0.safetensors:"));

  std::filesystem::path const dir = iotest::scratch_dir("file_errors");
  CHECK_THROWS_WITH(SafetensorsFile(dir / "missing.safetensors"),
                    Catch::Contains("cannot open '" + (dir / "missing.safetensors").string() +
                                    "': No such file or directory"));
  CHECK_THROWS_WITH(SafetensorsFile(dir), Catch::Contains("is not a regular file"));
  iotest::write_file(dir / "empty.safetensors", {});
  CHECK_THROWS_WITH(SafetensorsFile(dir / "empty.safetensors"),
                    Catch::Contains("empty.safetensors: the file is 0 bytes, too short"));
}

TEST_CASE("a FIFO or a device as input is refused at once, not read", "[io][safetensors]") {
  namespace fs = std::filesystem;
  fs::path const dir = iotest::scratch_dir("fifo_input");
  fs::path const fifo = dir / "model.safetensors";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  fs::create_directories(dir / "sharded");
  REQUIRE(::mkfifo((dir / "sharded" / "model.safetensors.index.json").c_str(), 0600) == 0);
  // A blocking open(2) of a FIFO waits for a writer: after 3 s this thread plays one (its
  // O_NONBLOCK open succeeds only while a reader waits), so a regression fails instead of hanging.
  std::atomic<bool> done{false};
  std::thread unblock([&] {
    auto const start = std::chrono::steady_clock::now();
    while (!done) {
      if (std::chrono::steady_clock::now() - start > std::chrono::seconds(3)) {
        for (fs::path const& p : {fifo, dir / "sharded" / "model.safetensors.index.json"}) {
          int const fd = ::open(p.c_str(), O_WRONLY | O_NONBLOCK);
          if (fd >= 0) ::close(fd);
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  auto error_of = [](auto&& open) {
    auto const start = std::chrono::steady_clock::now();
    std::string what = "(no error)";
    try {
      open();
    } catch (moe::Error const& e) {
      what = e.what();
    }
    double const s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return std::make_pair(what, s);
  };
  auto const [file_error, file_s] = error_of([&] { SafetensorsFile const f(fifo); });
  auto const [index_error, index_s] = error_of([&] { moe::io::open_checkpoint(dir / "sharded"); });
  auto const [zero_error, zero_s] = error_of([] { SafetensorsFile const f("/dev/zero"); });
  done = true;
  unblock.join();
  CHECK(file_s < 1.0);
  CHECK(index_s < 1.0);
  CHECK(zero_s < 1.0);
  CHECK(file_error == "moe: safetensors: '" + fifo.string() +
                          "' is not a regular file (a FIFO; moe maps whole files, it does not read "
                          "pipes or devices); pass the path of a .safetensors file");
  CHECK_THAT(index_error, Catch::Contains("model.safetensors.index.json' is not a regular file (a "
                                          "FIFO") &&
                              Catch::EndsWith("pass the path of a model.safetensors.index.json "
                                              "file"));
  CHECK_THAT(zero_error, Catch::Contains("'/dev/zero' is not a regular file (a character device"));
}

TEST_CASE("a moved SafetensorsFile keeps its views valid", "[io][safetensors]") {
  std::filesystem::path const dir = iotest::scratch_dir("move");
  moe::io::SafetensorsWriter w;
  w.add_f32("w", {2}, std::vector<float>{1.0f, 2.0f});
  w.save(dir / "m.safetensors");
  SafetensorsFile a(dir / "m.safetensors");
  TensorView const* view = a.find("w");
  SafetensorsFile b = std::move(a);
  CHECK(b.find("w") == view);
  CHECK(moe::io::to_float(*view) == std::vector<float>{1.0f, 2.0f});

  // A moved-in buffer is owned, and moves with the object.
  SafetensorsFile c(w.serialize());
  TensorView const* owned_view = c.find("w");
  SafetensorsFile const d = std::move(c);
  CHECK(d.find("w") == owned_view);
  CHECK(moe::io::to_float(*owned_view) == std::vector<float>{1.0f, 2.0f});
}
