// SPDX-License-Identifier: Apache-2.0
// The main of every moe test executable but the CPU-checking and MPI ones (compiled once; Catch2
// itself is in support/catch_session.cpp).
#include "support/catch_session.hpp"

int main(int argc, char** argv) { return moe::test::run_catch_session(argc, argv); }
