// Locates the TinyStories-260K checkpoint and tokenizer used by the demo, the CLI and the tests.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>
#include <system_error>
#include <filesystem>
#include <vector>

namespace kvc::engine {

/// File names of the real model (llama2.c legacy checkpoint and its tokenizer).
inline constexpr const char* kCheckpointFile = "stories260K.bin";
inline constexpr const char* kTokenizerFile = "tok512.bin";

/// True when `dir` holds both `stories260K.bin` and `tok512.bin` as regular files.
inline bool is_model_dir(const std::string& dir) {
  if (dir.empty()) return false;
  std::error_code ec;
  const std::filesystem::path p(dir);
  return std::filesystem::is_regular_file(p / kCheckpointFile, ec) &&
         std::filesystem::is_regular_file(p / kTokenizerFile, ec);
}

/// The candidate directories in search order: `$KVC_MODEL_DIR` (when set and non-empty), `./models`,
/// then `KVC_SOURCE_DIR "/models"` and `KVC_SOURCE_DIR "/../shared/models"` when the build defines
/// `KVC_SOURCE_DIR` (a string literal holding the repository root).
inline std::vector<std::string> model_search_paths() {
  std::vector<std::string> paths;
  if (const char* env = std::getenv("KVC_MODEL_DIR"); env != nullptr && env[0] != '\0') {
    paths.emplace_back(env);
  }
  paths.emplace_back("./models");
#ifdef KVC_SOURCE_DIR
  paths.emplace_back(std::string(KVC_SOURCE_DIR) + "/models");
  paths.emplace_back(std::string(KVC_SOURCE_DIR) + "/../shared/models");
#endif
  return paths;
}

/// The first directory of `model_search_paths()` that holds both model files, or nothing.
inline std::optional<std::string> find_model_dir() {
  for (const std::string& dir : model_search_paths()) {
    if (is_model_dir(dir)) return dir;
  }
  return std::nullopt;
}

/// Explains where the model was looked for and how to provide it.
inline std::string model_missing_message() {
  std::string msg = "model files ";
  msg += kCheckpointFile;
  msg += " and ";
  msg += kTokenizerFile;
  msg += " not found; looked in:";
  for (const std::string& dir : model_search_paths()) msg += " '" + dir + "'";
  msg +=
      ". They are TinyStories-260K (stories260K.bin, tok512.bin) from karpathy/tinyllamas (MIT "
      "licence); put both files in one directory and set KVC_MODEL_DIR to it.";
  return msg;
}

/// The recall model's path inside the repository (docs/recall.md).
inline constexpr const char* kRecallModelFile = "examples/recall/recall-gqa.bin";

/// The recall model: `./examples/recall/recall-gqa.bin`, then the same under `KVC_SOURCE_DIR` when the
/// build defines it; nothing when neither is a regular file.
inline std::optional<std::string> find_recall_model() {
  std::vector<std::string> candidates{std::string("./") + kRecallModelFile};
#ifdef KVC_SOURCE_DIR
  candidates.push_back(std::string(KVC_SOURCE_DIR) + "/" + kRecallModelFile);
#endif
  std::error_code ec;
  for (const std::string& p : candidates)
    if (std::filesystem::is_regular_file(p, ec)) return p;
  return std::nullopt;
}

inline std::string recall_model_missing_message() {
  return std::string("the recall model ") + kRecallModelFile +
         " was not found here or in the source tree; give its path with --model "
         "(examples/recall/train_recall_model.py trains it)";
}

}  // namespace kvc::engine
