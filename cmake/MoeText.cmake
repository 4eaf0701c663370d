# SPDX-License-Identifier: Apache-2.0
# The tokenizer (include/moe/text/): the INTERFACE target moe::text (moe::moe + PCRE2 for the
# pre-tokenizer regexes + ICU for the NFC normalizer), built when both are found (Debian:
# apt-get install libpcre2-dev libicu-dev); otherwise skipped with a message, and the tests and
# tools that need it are not built. Included by the top CMakeLists.txt after the moe target,
# whose header set leaves out include/moe/text/. Not installed yet (docs/tokenizer.md).
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(MOE_PCRE2 QUIET IMPORTED_TARGET libpcre2-8)
endif()
find_package(ICU COMPONENTS uc QUIET)
if(MOE_PCRE2_FOUND AND ICU_FOUND)
  set(MOE_WITH_TEXT ON)
  file(GLOB_RECURSE MOE_TEXT_HEADERS CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/include/moe/text/*.hpp")
  add_library(moe_text INTERFACE)
  add_library(moe::text ALIAS moe_text)
  target_sources(moe_text INTERFACE FILE_SET HEADERS BASE_DIRS include FILES ${MOE_TEXT_HEADERS})
  target_link_libraries(moe_text INTERFACE moe PkgConfig::MOE_PCRE2 ICU::uc)
  message(STATUS "moe: tokenizer (moe::text) ON (PCRE2 ${MOE_PCRE2_VERSION}, ICU ${ICU_VERSION})")
else()
  set(MOE_WITH_TEXT OFF)
  message(STATUS "moe: tokenizer (moe::text) OFF: needs PCRE2 (pkg-config libpcre2-8) and ICU "
                 "(Debian: apt-get install libpcre2-dev libicu-dev); its tests and moe_tokenize "
                 "are skipped")
endif()
