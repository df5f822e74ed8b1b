// Subcommand registry of the `dsx` executable. Each command lives in the source
// file of its concern and registers itself with DSX_COMMAND; executables link the
// whole dsx archive so that registrations are kept.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dsx::cli {

using CommandFn = int (*)(int argc, char** argv);  // argv[0] is the command name

struct Command {
  std::string name;
  std::string summary;
  CommandFn fn;
};

void register_command(Command c);
const std::vector<Command>& commands();

struct Registrar {
  Registrar(const char* name, const char* summary, CommandFn fn) { register_command({name, summary, fn}); }
};

// Minimal option parser: options are "-x VALUE", "--name VALUE" or flags
// ("--greedy"). `value_opts` lists the options that take a value; anything else
// starting with '-' must be in `flag_opts`. Unknown options throw dsx::Error.
class Args {
 public:
  Args(int argc, char** argv, const std::vector<std::string>& value_opts, const std::vector<std::string>& flag_opts);
  bool has(const std::string& opt) const;
  std::optional<std::string> get(const std::string& opt) const;
  std::string require(const std::string& opt) const;  // throws naming the option
  std::string get_or(const std::string& opt, const std::string& def) const;
  long long get_int(const std::string& opt, long long def) const;
  double get_double(const std::string& opt, double def) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> flags_;
  std::vector<std::string> positional_;
};

}  // namespace dsx::cli

#define DSX_CONCAT_INNER(a, b) a##b
#define DSX_CONCAT(a, b) DSX_CONCAT_INNER(a, b)
#define DSX_COMMAND(name, summary, fn) \
  static ::dsx::cli::Registrar DSX_CONCAT(dsx_command_registrar_, __LINE__)(name, summary, fn)
