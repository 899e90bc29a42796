// kvcompress: command-line tool over the example engine and the library.
//
//   kvcompress generate --prompt "..." --method selkv --ratio 0.25 [--max-tokens 128]
//   kvcompress eval     [--tokens F.npy | --samples 24 --seed 1] --prefix 384 --methods a,b --ratios 0.1,0.25
//   kvcompress compress --keys K.npy --values V.npy --queries Q.npy --method selkv (--ratio R | --budget M) --out DIR
//
// --model / --tokenizer default to the files found through KVC_MODEL_DIR, ./models, ../shared/models.
#include "cli_commands.hpp"

int main(int argc, char** argv) { return kvc::cli::main_entry(argc, argv); }
