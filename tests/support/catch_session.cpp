// SPDX-License-Identifier: Apache-2.0
// Catch2's implementation, compiled once for every test executable (support/catch_session.hpp).
#define CATCH_CONFIG_RUNNER
#include "support/catch_session.hpp"

#include <catch2/catch.hpp>

int moe::test::run_catch_session(int argc, char** argv) { return Catch::Session().run(argc, argv); }
