// SPDX-License-Identifier: Apache-2.0
// The Catch2 main for every moe test executable (compiled once).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
