// Files written crash-safely: the bytes go to a temporary file beside the target
// ("<path>.tmp-<pid>", in the same directory so that the rename stays on one file
// system), which is fsync'ed and renamed over the target, and the directory is fsync'ed,
// so that a crash, a full disk or a failed write leaves either the old file or the new
// one, never part of one. Every writer in fsdp writes its files here (safetensors files
// and folders, checkpoint shards, LoRA adapter configs).
//
//   fsdp::write_file_atomically("/out/adapter_config.json", text);
//
//   fsdp::AtomicFile file("/out/model.safetensors");  // creates the temporary file
//   file.append(header);
//   file.append(data);                                 // ... as many times as needed
//   file.commit();                                     // fsync, rename, fsync the directory
//
// Errors: c10::Error naming the file and the system's reason (strerror), e.g. "cannot
// write '/out/x.json.tmp-4242': No space left on device"; creating and writing name the
// temporary file, renaming names both. Whatever fails, the temporary file is removed and
// the target is left as it was (after a failed directory fsync the new file is in place
// but may not survive a crash). An AtomicFile destroyed without commit() removes its
// temporary file.
// Threading: one AtomicFile is used by one thread; two writers of one path at once, in
// one process, would share the temporary file (the callers write distinct paths).
// PyTorch counterpart: none (torch.save and safetensors' save_file write in place).
#ifndef FSDP_FORMATS_ATOMIC_FILE_H_
#define FSDP_FORMATS_ATOMIC_FILE_H_

#include <string>
#include <string_view>

namespace fsdp {

class AtomicFile {
 public:
  // Creates (or truncates) the temporary file of `path`, mode 0644 less the umask.
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // The target, and the temporary file written until commit().
  const std::string& path() const { return path_; }
  const std::string& temporary_path() const { return temporary_path_; }

  // Appends `bytes` to the temporary file (retrying short and interrupted writes).
  void append(std::string_view bytes);
  // fsyncs and closes the temporary file, renames it to path() and fsyncs the directory.
  // Once only: append and commit afterwards are errors.
  void commit();

 private:
  // Closes (if open) and removes the temporary file, then throws "<what>: strerror(error)".
  [[noreturn]] void fail(const std::string& what, int error);

  std::string path_;
  std::string temporary_path_;
  int fd_ = -1;
};

// `bytes` as the whole content of `path`, through an AtomicFile.
void write_file_atomically(const std::string& path, std::string_view bytes);

// Makes a rename in the directory `dir` durable ("" is the current directory). File
// systems that cannot fsync a directory (EINVAL) are let be.
void fsync_directory(const std::string& dir);

}  // namespace fsdp

#endif  // FSDP_FORMATS_ATOMIC_FILE_H_
