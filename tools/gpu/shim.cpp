// ABI shim: nvfuser built for torch 2.10 calls c10::MessageLogger(const char*, int, int, bool);
// torch 2.11 only has MessageLogger(c10::SourceLocation, int, bool). Forward the old one to the new.
#include <cstdint>
namespace c10 {
struct SourceLocation { const char* function; const char* file; uint32_t line; };
class MessageLogger {
 public:
  MessageLogger(SourceLocation loc, int severity, bool exit_on_fatal);
  MessageLogger(const char* file, int line, int severity, bool exit_on_fatal);
};
MessageLogger::MessageLogger(const char* file, int line, int severity, bool exit_on_fatal)
    : MessageLogger(SourceLocation{"", file, static_cast<uint32_t>(line)}, severity, exit_on_fatal) {}
}  // namespace c10
