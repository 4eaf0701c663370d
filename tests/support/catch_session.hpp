// SPDX-License-Identifier: Apache-2.0
// The Catch2 session of every moe test executable. Catch2's implementation (CATCH_CONFIG_RUNNER,
// ~17k lines: 20-30 s of compile, ~80 s under ASan) is compiled once, in catch_session.cpp
// (library moe_catch), instead of once per main (tests/main.cpp, tests/main_cpu_check.cpp and its
// variants, tests/dist/main.cpp); the mains call it and include no Catch2 themselves.
#pragma once

namespace moe::test {

/// Catch::Session().run(argc, argv): runs the tests the command line selects; the exit code.
int run_catch_session(int argc, char** argv);

}  // namespace moe::test
