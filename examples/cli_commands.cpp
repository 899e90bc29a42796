// The kvcompress tool's subcommands, compiled once for the tool, the demo and the tests.
#define KVC_CLI_COMMANDS_DEFINE
#include "cli_commands.hpp"
