// FileStore: an append-only log of records in one file, shared by every process
// that opens it. Each operation takes flock() on the file (shared to read, exclusive
// to write), replays the records appended since its last look into an in-memory
// map, and appends its own. Record: u8 type ('S' set, 'D' delete), u32 key length,
// u32 value length (little-endian), key, value.
#include "comm/file_store.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "comm/errors.h"

namespace crossbar {
namespace {

constexpr size_t kRecordHeader = 9;
constexpr char kSetRecord = 'S';
constexpr char kDeleteRecord = 'D';

void putU32(std::string& b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint32_t getU32(const char* p) {
  auto u = reinterpret_cast<const uint8_t*>(p);
  return u[0] | (u[1] << 8) | (u[2] << 16) | (static_cast<uint32_t>(u[3]) << 24);
}

std::string context(std::string_view op) {
  return errorContext(-1, fmt::format("FileStore {}", op));
}

void checkKey(std::string_view op, const std::string& key) {
  checkStoreKey(context(op), key);
}
void checkValue(std::string_view op, const std::string& key, size_t size) {
  checkStoreValue(context(op), key, size);
}

}  // namespace

struct FileStore::Impl {
  std::string path;
  int fd = -1;
  pid_t pid = 0;
  std::mutex mu;  // flock() does not exclude threads sharing one descriptor
  std::unordered_map<std::string, std::string> data;
  off_t offset = 0;  // end of the last complete record replayed

  ~Impl() {
    if (fd >= 0) ::close(fd);
  }

  void open() {
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
      throwSystemError(-1, fmt::format("FileStore open {}", path), errno,
                       "The directory must exist and be writable by every rank (a shared file system "
                       "across nodes)");
    pid = getpid();
    data.clear();
    offset = 0;
  }

  // A forked child shares the parent's open file description, and with it the
  // parent's flock(): reopen so the two exclude each other.
  void ensureOwnDescriptor() {
    if (pid == getpid()) return;
    ::close(fd);
    open();
  }

  class Lock {
   public:
    Lock(Impl& impl, int how) : fd_(impl.fd) {
      while (::flock(fd_, how) != 0) {
        if (errno != EINTR) throwSystemError(-1, fmt::format("FileStore lock {}", impl.path), errno);
      }
    }
    ~Lock() { ::flock(fd_, LOCK_UN); }

   private:
    int fd_;
  };

  // Replays records appended since the last call. Call with the file locked.
  void sync() {
    struct stat st {};
    if (::fstat(fd, &st) != 0) throwSystemError(-1, fmt::format("FileStore stat {}", path), errno);
    if (st.st_size < offset) {  // truncated behind our back: start over
      data.clear();
      offset = 0;
    }
    if (st.st_size == offset) return;
    std::string buf(static_cast<size_t>(st.st_size - offset), '\0');
    size_t got = 0;
    while (got < buf.size()) {
      ssize_t n = ::pread(fd, buf.data() + got, buf.size() - got, offset + static_cast<off_t>(got));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throwSystemError(-1, fmt::format("FileStore read {}", path), errno);
      if (n == 0) break;
      got += n;
    }
    size_t pos = 0;
    while (pos + kRecordHeader <= got) {
      const char type = buf[pos];
      const uint32_t klen = getU32(buf.data() + pos + 1), vlen = getU32(buf.data() + pos + 5);
      if ((type != kSetRecord && type != kDeleteRecord) || klen > kStoreMaxKeyBytes ||
          vlen > kStoreMaxValueBytes)
        throw SystemError(context("read") + fmt::format("{} is corrupt at byte {} (or not a FileStore file); "
                                                        "delete it and restart the job",
                                                        path, offset + static_cast<off_t>(pos)));
      if (pos + kRecordHeader + klen + vlen > got) break;  // a writer died mid-record
      std::string key(buf.data() + pos + kRecordHeader, klen);
      if (type == kSetRecord)
        data[std::move(key)] = std::string(buf.data() + pos + kRecordHeader + klen, vlen);
      else
        data.erase(key);
      pos += kRecordHeader + klen + vlen;
    }
    offset += static_cast<off_t>(pos);
  }

  // Appends one record. Call with the file locked exclusively, after sync().
  void append(char type, const std::string& key, const std::string& value) {
    struct stat st {};
    if (::fstat(fd, &st) == 0 && st.st_size > offset) {
      // A partial record left by a writer that died: drop it.
      if (::ftruncate(fd, offset) != 0)
        throwSystemError(-1, fmt::format("FileStore truncate {}", path), errno);
    }
    std::string rec;
    rec.reserve(kRecordHeader + key.size() + value.size());
    rec.push_back(type);
    putU32(rec, static_cast<uint32_t>(key.size()));
    putU32(rec, static_cast<uint32_t>(value.size()));
    rec += key;
    rec += value;
    size_t done = 0;
    while (done < rec.size()) {
      ssize_t n = ::pwrite(fd, rec.data() + done, rec.size() - done, offset + static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0)
        throwSystemError(-1, fmt::format("FileStore write {}", path), errno, "Is the file system full?");
      done += n;
    }
    offset += static_cast<off_t>(rec.size());
    if (type == kSetRecord)
      data[key] = value;
    else
      data.erase(key);
  }

  bool allExist(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data.count(k) > 0; });
  }

  // Polls the file with short, growing sleeps until `ready` holds or the deadline passes.
  template <class Ready>
  bool pollUntil(Deadline deadline, Ready&& ready) {
    Millis sleep(1);
    for (;;) {
      {
        std::lock_guard<std::mutex> guard(mu);
        ensureOwnDescriptor();
        Lock lock(*this, LOCK_SH);
        sync();
        if (ready()) return true;
      }
      if (deadline.expired()) return false;
      std::this_thread::sleep_for(std::min(sleep, deadline.remaining()));
      sleep = std::min(sleep * 2, Millis(20));
    }
  }
};

FileStore::FileStore(const std::string& path) : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  impl_->open();
}

FileStore::~FileStore() = default;

void FileStore::set(const std::string& key, const Bytes& value) {
  checkKey("set", key);
  checkValue("set", key, value.size());
  std::lock_guard<std::mutex> guard(impl_->mu);
  impl_->ensureOwnDescriptor();
  Impl::Lock lock(*impl_, LOCK_EX);
  impl_->sync();
  impl_->append(kSetRecord, key, toString(value));
}

Bytes FileStore::get(const std::string& key, Deadline deadline) {
  checkKey("get", key);
  const Millis timeout = deadline.remaining();
  Bytes out;
  bool found = impl_->pollUntil(deadline, [&] {
    auto it = impl_->data.find(key);
    if (it == impl_->data.end()) return false;
    out = toBytes(it->second);
    return true;
  });
  if (!found)
    throw Timeout(context("get") +
                  fmt::format("key '{}' was not set within {} ms in {}. Check that the rank that "
                              "sets it is alive and uses the same file and key prefix; raise "
                              "CROSSBAR_TIMEOUT if it is only slow",
                              printableKey(key), timeout.count(), impl_->path));
  return out;
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  checkKey("add", key);
  std::lock_guard<std::mutex> guard(impl_->mu);
  impl_->ensureOwnDescriptor();
  Impl::Lock lock(*impl_, LOCK_EX);
  impl_->sync();
  int64_t value = 0;
  auto it = impl_->data.find(key);
  if (it != impl_->data.end()) {
    const std::string& text = it->second;
    char* end = nullptr;
    errno = 0;
    long long parsed = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE)
      throw InvalidArgument(context("add") +
                            fmt::format("key '{}' holds '{}', not a decimal integer; use add() "
                                        "only on counters",
                                        printableKey(key), printableKey(text)));
    value = parsed;
  }
  if (__builtin_add_overflow(value, delta, &value))
    throw InvalidArgument(context("add") + fmt::format("add('{}', {}): the counter would overflow int64",
                                                       printableKey(key), delta));
  impl_->append(kSetRecord, key, std::to_string(value));
  return value;
}

Bytes FileStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  checkKey("compareSet", key);
  checkValue("compareSet", key, expected.size());
  checkValue("compareSet", key, desired.size());
  std::lock_guard<std::mutex> guard(impl_->mu);
  impl_->ensureOwnDescriptor();
  Impl::Lock lock(*impl_, LOCK_EX);
  impl_->sync();
  auto it = impl_->data.find(key);
  const bool matches = it == impl_->data.end() ? expected.empty() : it->second == toString(expected);
  if (!matches) return it == impl_->data.end() ? Bytes() : toBytes(it->second);
  impl_->append(kSetRecord, key, toString(desired));
  return desired;
}

bool FileStore::check(const std::vector<std::string>& keys) {
  for (auto& k : keys) checkKey("check", k);
  std::lock_guard<std::mutex> guard(impl_->mu);
  impl_->ensureOwnDescriptor();
  Impl::Lock lock(*impl_, LOCK_SH);
  impl_->sync();
  return impl_->allExist(keys);
}

void FileStore::wait(const std::vector<std::string>& keys, Deadline deadline) {
  for (auto& k : keys) checkKey("wait", k);
  const Millis timeout = deadline.remaining();
  if (impl_->pollUntil(deadline, [&] { return impl_->allExist(keys); })) return;
  std::vector<std::string> missing;
  {
    std::lock_guard<std::mutex> guard(impl_->mu);
    for (auto& k : keys)
      if (!impl_->data.count(k)) missing.push_back(k);
  }
  std::string list;
  for (size_t i = 0; i < missing.size() && i < 16; ++i)
    list += (i ? ", '" : "'") + printableKey(missing[i]) + "'";
  if (missing.size() > 16) list += fmt::format(", ... ({} more)", missing.size() - 16);
  throw Timeout(context("wait") +
                fmt::format("{} of {} keys not set within {} ms in {}: missing {}. Check that "
                            "the ranks that set them are alive and use the same file and key "
                            "prefix; raise CROSSBAR_TIMEOUT if they are only slow",
                            missing.size(), keys.size(), timeout.count(), impl_->path, list));
}

bool FileStore::deleteKey(const std::string& key) {
  checkKey("deleteKey", key);
  std::lock_guard<std::mutex> guard(impl_->mu);
  impl_->ensureOwnDescriptor();
  Impl::Lock lock(*impl_, LOCK_EX);
  impl_->sync();
  if (!impl_->data.count(key)) return false;
  impl_->append(kDeleteRecord, key, {});
  return true;
}

int64_t FileStore::numKeys() {
  std::lock_guard<std::mutex> guard(impl_->mu);
  impl_->ensureOwnDescriptor();
  Impl::Lock lock(*impl_, LOCK_SH);
  impl_->sync();
  return static_cast<int64_t>(impl_->data.size());
}

// ---- PrefixStore -------------------------------------------------------------------

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : prefix_(std::move(prefix)), base_(std::move(base)) {
  if (!base_) throw InvalidArgument(errorContext(-1, "PrefixStore") + "the base store is null");
}

void PrefixStore::set(const std::string& k, const Bytes& value) {
  base_->set(key(k), value);
}
Bytes PrefixStore::get(const std::string& k, Deadline deadline) {
  return base_->get(key(k), deadline);
}
int64_t PrefixStore::add(const std::string& k, int64_t delta) {
  return base_->add(key(k), delta);
}
Bytes PrefixStore::compareSet(const std::string& k, const Bytes& expected, const Bytes& desired) {
  return base_->compareSet(key(k), expected, desired);
}
bool PrefixStore::check(const std::vector<std::string>& keys) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (auto& k : keys) full.push_back(key(k));
  return base_->check(full);
}
void PrefixStore::wait(const std::vector<std::string>& keys, Deadline deadline) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (auto& k : keys) full.push_back(key(k));
  base_->wait(full, deadline);
}
bool PrefixStore::deleteKey(const std::string& k) {
  return base_->deleteKey(key(k));
}
int64_t PrefixStore::numKeys() {
  return base_->numKeys();
}

}  // namespace crossbar
