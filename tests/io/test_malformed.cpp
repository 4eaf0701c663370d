// SPDX-License-Identifier: Apache-2.0
// One hand-made malformed file per error class of the reference reader (tensor.rs
// SafeTensorError), plus the JSON and schema errors; each message must name the problem.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "io/io_test_support.hpp"
#include "moe/io/safetensors.hpp"

namespace {

using Catch::Contains;
using iotest::image;

std::string error_of(std::vector<std::byte> const& bytes) {
  try {
    moe::io::SafetensorsFile const file(bytes);
  } catch (moe::Error const& e) {
    return e.what();
  }
  return "(accepted)";
}

// A one-tensor header: {"t":{"dtype":D,"shape":S,"data_offsets":O}}.
std::string tensor_header(std::string const& dtype, std::string const& shape,
                          std::string const& offsets) {
  return R"({"t":{"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" + offsets +
         "}}";
}

}  // namespace

TEST_CASE("HeaderTooSmall: fewer than 8 bytes", "[io][malformed]") {
  CHECK(error_of(iotest::bytes_of("\x01\x02\x03\x04\x05")) ==
        "moe: safetensors: <memory>: the file is 5 bytes, too short for the 8-byte header "
        "length; it is truncated or not a safetensors file");
  CHECK_THAT(error_of({}), Contains("the file is 0 bytes"));
}

TEST_CASE("HeaderTooLarge: the length field exceeds 100,000,000", "[io][malformed]") {
  CHECK_THAT(error_of(image(100'000'001, "{}")),
             Contains("the header length field says 100000001 bytes, more than the format's "
                      "limit of 100000000"));
  CHECK_THAT(error_of(image(UINT64_MAX, "{}")), Contains("more than the format's limit"));
}

TEST_CASE("InvalidHeaderLength: the header runs past the end of the file", "[io][malformed]") {
  CHECK_THAT(error_of(image(100, "{}")),
             Contains("the header length field says 100 bytes but only 2 bytes follow it; the "
                      "file is truncated"));
  CHECK_THAT(error_of(image(1, "")), Contains("only 0 bytes follow it"));
}

TEST_CASE("InvalidHeader: the header is not UTF-8", "[io][malformed]") {
  // tensor.rs test_invalid_header_non_utf8.
  CHECK_THAT(error_of(image("\xff")),
             Contains("the header is not valid UTF-8 (byte 0xff at byte 0 of the header)"));
  CHECK_THAT(error_of(image("{\"\xc0\x80\":1}")),
             Contains("not valid UTF-8 (byte 0xc0"));                                // overlong
  CHECK_THAT(error_of(image("{\"\xed\xa0\x80\":1}")), Contains("not valid UTF-8"));  // surrogate
  CHECK_THAT(error_of(image("{\"\xf4\x90\x80\x80\":1}")),
             Contains("not valid UTF-8"));  // > U+10FFFF
  CHECK_THAT(error_of(image("{\"\xe2\x82")), Contains("not valid UTF-8 (byte 0xe2 at byte 2"));
}

TEST_CASE("InvalidHeaderDeserialization: the header is not JSON", "[io][malformed]") {
  // tensor.rs test_invalid_header_not_json.
  CHECK_THAT(error_of(image("{")),
             Contains("the header is not valid JSON: unexpected end of JSON, expected '}' at "
                      "byte 1 of the header"));
  CHECK_THAT(error_of(image("")), Contains("unexpected end of JSON, expected a value"));
  CHECK_THAT(error_of(image(R"({"__metadata__":{"a":"1",}})")),
             Contains("trailing comma before '}'"));
  CHECK_THAT(error_of(image(R"({"t":{"shape":[1,]}})")), Contains("trailing comma before ']'"));
  CHECK_THAT(error_of(image("{'a':1}")), Contains("expected a string key in double quotes"));
  CHECK_THAT(error_of(image(R"({"a" 1})")), Contains("expected ':' after an object key"));
  CHECK_THAT(error_of(image(R"({"__metadata__":{"a":"1" "b":"2"}})")),
             Contains("expected ',' or '}'"));
  CHECK_THAT(error_of(image("{} // comment")), Contains("after the end of the JSON value"));
  CHECK_THAT(error_of(image("{}{}")), Contains("after the end of the JSON value"));
  CHECK_THAT(error_of(image(R"({"t":{"shape":[01]}})")), Contains("leading zeros"));
  CHECK_THAT(error_of(image(R"({"t":{"shape":[NaN]}})")), Contains("expected a JSON value"));
  CHECK_THAT(error_of(image(R"({"t":{"shape":[1.]}})")), Contains("expected a digit after '.'"));
  CHECK_THAT(error_of(image(R"({"t":{"shape":[1e]}})")), Contains("digit in the exponent"));
  CHECK_THAT(error_of(image(R"({"t":{"x":tru}})")), Contains("expected true or false"));
  CHECK_THAT(error_of(image("{\"a\tb\":1}")), Contains("unescaped control character byte 0x09"));
  CHECK_THAT(error_of(image(R"({"\x":1})")), Contains("invalid escape sequence"));
  CHECK_THAT(error_of(image(R"({"\u12G4":1})")), Contains("invalid hex digit"));
  CHECK_THAT(error_of(image(R"({"\ud800":1})")), Contains("lone leading surrogate"));
  CHECK_THAT(error_of(image(R"({"\ud800\u0041":1})")),
             Contains("leading surrogate not followed by a trailing surrogate"));
  CHECK_THAT(error_of(image(R"({"\udc00":1})")), Contains("lone trailing surrogate"));
  CHECK_THAT(error_of(image(R"({"abc)")), Contains("unterminated string"));
  // Nesting deeper than 128 levels, even inside an ignored key.
  std::string const deep = R"({"t":{"x":)" + std::string(200, '[') + std::string(200, ']') + "}}";
  CHECK_THAT(error_of(image(deep)), Contains("nested deeper than 128 levels"));
}

TEST_CASE("InvalidHeaderDeserialization: the header does not follow the schema",
          "[io][malformed]") {
  auto const four = iotest::ramp(4);
  CHECK_THAT(error_of(image("[]")),
             Contains("the header must be a JSON object, but it is an array"));
  CHECK_THAT(error_of(image(R"({"t":[]})")),
             Contains("tensor 't': expected an object with \"dtype\", \"shape\" and "
                      "\"data_offsets\", found an array"));
  CHECK_THAT(error_of(image(R"({"t":{"shape":[4],"data_offsets":[0,4]}})", four)),
             Contains("tensor 't': \"dtype\" is missing"));
  CHECK_THAT(error_of(image(R"({"t":{"dtype":"U8","data_offsets":[0,4]}})", four)),
             Contains("tensor 't': \"shape\" is missing"));
  CHECK_THAT(error_of(image(R"({"t":{"dtype":"U8","shape":[4]}})", four)),
             Contains("tensor 't': \"data_offsets\" is missing"));
  CHECK_THAT(error_of(image(tensor_header("F12", "[4]", "[0,4]"), four)),
             Contains("tensor 't': unknown dtype 'F12' (known: BOOL F4"));
  CHECK_THAT(error_of(image(tensor_header("f32", "[1]", "[0,4]"), four)),
             Contains("unknown dtype 'f32'"));  // names are case-sensitive
  CHECK_THAT(error_of(image(R"({"t":{"dtype":32,"shape":[1],"data_offsets":[0,4]}})", four)),
             Contains("\"dtype\" must be a string, found a number"));
  CHECK_THAT(error_of(image(tensor_header("U8", "[-1]", "[0,4]"), four)),
             Contains("tensor 't': \"shape\" holds '-1', which is not an integer in [0, 2^64)"));
  CHECK_THAT(error_of(image(tensor_header("U8", "[2.0]", "[0,4]"), four)),
             Contains("\"shape\" holds '2.0'"));
  CHECK_THAT(error_of(image(tensor_header("U8", "[4e0]", "[0,4]"), four)),
             Contains("\"shape\" holds '4e0'"));
  CHECK_THAT(error_of(image(tensor_header("U8", "[-0]", "[0,4]"), four)),
             Contains("\"shape\" holds '-0'"));
  CHECK_THAT(error_of(image(tensor_header("U8", "[18446744073709551616]", "[0,4]"), four)),
             Contains("holds '18446744073709551616', which is not an integer in [0, 2^64)"));
  CHECK_THAT(error_of(image(tensor_header("U8", "[9223372036854775808,0]", "[0,0]"))),
             Contains("shape dimension 0 is larger than 2^63 - 1"));
  CHECK_THAT(error_of(image(tensor_header("U8", "4", "[0,4]"), four)),
             Contains("\"shape\" must be an array of integers, found a number"));
  CHECK_THAT(error_of(image(tensor_header("U8", "[\"4\"]", "[0,4]"), four)),
             Contains("\"shape\" must hold integers, found a string"));
  CHECK_THAT(error_of(image(tensor_header("U8", "[4]", "[0,4,8]"), four)),
             Contains("\"data_offsets\" must hold exactly 2 integers [begin, end], found 3"));
  CHECK_THAT(error_of(image(tensor_header("U8", "[4]", "[4]"), four)), Contains("found 1"));
  CHECK_THAT(error_of(image(R"({"t":{"dtype":"U8","dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                            four)),
             Contains("tensor 't': \"dtype\" is given twice"));
}

TEST_CASE("Duplicate names and metadata keys are rejected", "[io][malformed]") {
  // The reference keeps the last duplicate (a HashMap); we refuse the ambiguity.
  CHECK_THAT(error_of(image(R"({"t":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                            R"("t":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})",
                            iotest::ramp(4))),
             Contains("tensor 't': the name appears twice in the header"));
  CHECK_THAT(error_of(image(R"({"__metadata__":{"a":"1","a":"2"}})")),
             Contains("\"__metadata__\" has the key 'a' twice"));
  CHECK_THAT(error_of(image(R"({"__metadata__":{},"__metadata__":{}})")),
             Contains("two \"__metadata__\" keys"));
}

TEST_CASE("__metadata__ must map strings to strings", "[io][malformed]") {
  CHECK_THAT(error_of(image(R"({"__metadata__":{"n":1}})")),
             Contains("\"__metadata__\" value of key 'n' is a number, but the format allows only "
                      "string values"));
  CHECK_THAT(error_of(image(R"({"__metadata__":{"n":{"x":"y"}}})")), Contains("is an object"));
  CHECK_THAT(error_of(image(R"({"__metadata__":["a"]})")),
             Contains("\"__metadata__\" must be an object of strings, but it is an array"));
}

TEST_CASE("InvalidOffset: gaps, overlaps, reversed offsets, not starting at 0", "[io][malformed]") {
  auto const eight = iotest::ramp(8);
  CHECK_THAT(error_of(image(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                            R"("b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})",
                            eight)),
             Contains("tensor 'b': data_offsets [4, 8] leave a gap after tensor 'a': bytes [2, 4) "
                      "of the data belong to no tensor"));
  CHECK_THAT(error_of(image(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                            R"("b":{"dtype":"U8","shape":[6],"data_offsets":[2,8]}})",
                            eight)),
             Contains("tensor 'b': data_offsets [2, 8] overlap tensor 'a', which ends at byte 4"));
  CHECK_THAT(error_of(image(tensor_header("U8", "[8]", "[2,10]"), eight)),
             Contains("tensor 't': data_offsets [2, 10] make the first tensor start at byte 2"));
  CHECK_THAT(error_of(image(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                            R"("b":{"dtype":"U8","shape":[0],"data_offsets":[4,2]}})",
                            eight)),
             Contains("tensor 'b': data_offsets [4, 2] end before they begin"));
  // tensor.rs test_json_attack: ten tensors all at [0, 16].
  std::string attack = "{";
  for (int i = 0; i < 10; ++i) {
    attack.append(i ? ",\"weight_" : "\"weight_").append(std::to_string(i));
    attack.append(R"(":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]})");
  }
  attack += "}";
  CHECK_THAT(error_of(image(attack, iotest::ramp(16))),
             Contains("data_offsets [0, 16] overlap tensor 'weight_0', which ends at byte 16"));
}

TEST_CASE("ValidationOverflow: element or byte counts overflow 64 bits", "[io][malformed]") {
  CHECK_THAT(error_of(image(tensor_header("U8", "[4294967296,4294967296,2]", "[0,0]"))),
             Contains("tensor 't': U8 [4294967296, 4294967296, 2] has more elements or bytes than "
                      "fit 64 bits"));
  // 2^61 elements fit, 2^61 x 64 bits do not.
  CHECK_THAT(error_of(image(tensor_header("U64", "[2305843009213693952]", "[0,0]"))),
             Contains("has more elements or bytes than fit 64 bits"));
  // Folded left to right like the reference: an early overflow counts even with a later 0.
  CHECK_THAT(error_of(image(tensor_header("U8", "[4294967296,4294967296,0]", "[0,0]"))),
             Contains("than fit 64 bits"));
}

TEST_CASE("MisalignedSlice: sub-byte tensors that do not fill whole bytes", "[io][malformed]") {
  CHECK_THAT(error_of(image(tensor_header("F4", "[3]", "[0,2]"), iotest::ramp(2))),
             Contains("tensor 't': F4 [3] is 3 x 4 bits, not a whole number of bytes"));
  CHECK_THAT(error_of(image(tensor_header("F6_E2M3", "[2]", "[0,2]"), iotest::ramp(2))),
             Contains("F6_E2M3 [2] is 2 x 6 bits"));
  CHECK(error_of(image(tensor_header("F4", "[4]", "[0,2]"), iotest::ramp(2))) == "(accepted)");
}

TEST_CASE("TensorInvalidInfo: data_offsets disagree with dtype x shape", "[io][malformed]") {
  CHECK(error_of(image(tensor_header("F32", "[2,2]", "[0,12]"), iotest::ramp(12))) ==
        "moe: safetensors: <memory>: tensor 't': data_offsets [0, 12] hold 12 bytes but F32 "
        "[2, 2] needs 16; the file is truncated or corrupt");
}

TEST_CASE("MetadataIncompleteBuffer: data must end exactly at the end of the file",
          "[io][malformed]") {
  CHECK_THAT(error_of(image(tensor_header("U8", "[4]", "[0,4]"), iotest::ramp(6))),
             Contains("the tensors cover 4 bytes of data but the file has 6 bytes after the "
                      "header (2 trailing bytes belong to no tensor)"));
  CHECK_THAT(error_of(image(tensor_header("U8", "[4]", "[0,4]"), iotest::ramp(3))),
             Contains("the tensors need 4 bytes of data but the file has only 3 bytes after the "
                      "header; the file is truncated"));
  CHECK_THAT(error_of(image("{}", iotest::ramp(1))), Contains("1 trailing bytes"));
  // Huge offsets are caught by the same rule, without reading anything.
  CHECK_THAT(
      error_of(image(tensor_header("U8", "[1152921504606846976]", "[0,1152921504606846976]"))),
      Contains("the tensors need 1152921504606846976 bytes of data"));
}

TEST_CASE("Names in messages are escaped and cut", "[io][malformed]") {
  std::string const long_name(300, 'x');
  std::string const header =
      R"({")" + long_name + R"(\n":{"dtype":"U8","shape":[1],"data_offsets":[0,2]}})";
  std::string const message = error_of(image(header, iotest::ramp(2)));
  CHECK_THAT(message, Contains("tensor '" + std::string(120, 'x') + "...'"));
  CHECK_THAT(error_of(image(R"({"a\u0000'":{"dtype":"U8","shape":[1],"data_offsets":[0,2]}})",
                            iotest::ramp(2))),
             Contains("tensor 'a\\x00\\x27'"));
}
