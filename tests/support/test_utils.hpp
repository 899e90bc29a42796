// tests/support/test_utils.hpp — small helpers shared by test files: a self-deleting temporary
// directory, the message of a thrown kvc::error, and running the kvcompress tool in-process.
#pragma once

#include <kvcompress/core.hpp>

#include <chrono>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace kvc::test {

/// A fresh directory under the system temp dir, removed with everything in it on destruction.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& prefix = "kvc_test_") {
    std::random_device rd;
    path = std::filesystem::temp_directory_path() /
           (prefix + std::to_string(rd()) + "_" +
            std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  /// Path of `name` inside the directory.
  std::string file(const std::string& name) const { return (path / name).string(); }
  std::string operator/(const std::string& name) const { return file(name); }
};

/// The message of the kvc::error that fn() throws, or "" when it throws none.
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const kvc::error& e) {
    return e.what();
  }
  return "";
}

/// Runs `kvcompress <args...>` through `run` (kvc::cli::run_command) and captures its output.
template <class Run>
int run_tool(Run&& run, std::vector<std::string> args, std::string& out, std::string& err) {
  args.insert(args.begin(), "kvcompress");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  std::ostringstream o, e;
  const int rc = run(static_cast<int>(argv.size()), argv.data(), o, e);
  out = o.str();
  err = e.str();
  return rc;
}

}  // namespace kvc::test
