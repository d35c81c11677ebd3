// redis-server instances started by the tests themselves: loopback, a free port, no persistence,
// a private directory; stopped (and the directory removed) when the object goes.
#pragma once
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "store/redis.hpp"

namespace stagelink::testing_util {

inline bool have_redis_server() { return std::system("command -v redis-server >/dev/null 2>&1") == 0; }

// A port nobody listens on now (bound once, then closed).
inline int free_port() {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t n = sizeof a;
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &n);
  ::close(s);
  return ntohs(a.sin_port);
}

// A free port whose cluster bus port (port + 10000) is free too.
inline int free_cluster_port() {
  for (;;) {
    const int p = free_port();
    if (p + 10000 > 65535) continue;
    int s = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(uint16_t(p + 10000));
    const bool ok = ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(s);
    if (ok) return p;
  }
}

class RedisServer {
 public:
  explicit RedisServer(std::vector<std::string> extra_args = {}, int port = 0)
      : port_(port ? port : free_port()), args_(std::move(extra_args)) {
    char tmpl[] = "/tmp/sl-redis-XXXXXX";
    dir_ = ::mkdtemp(tmpl);
    start();
  }
  ~RedisServer() {
    stop();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  int port() const { return port_; }
  const std::string& dir() const { return dir_; }

  void start() {
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a test that crashes takes its servers with it
      std::vector<std::string> a{"redis-server", "--port", std::to_string(port_), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", dir_, "--loglevel", "warning"};
      a.insert(a.end(), args_.begin(), args_.end());
      std::vector<char*> av;
      for (auto& s : a) av.push_back(s.data());
      av.push_back(nullptr);
      const int devnull = ::open("/dev/null", O_WRONLY);  // its log stays out of the test output
      if (devnull >= 0) {
        ::dup2(devnull, 1);
        ::dup2(devnull, 2);
      }
      ::execvp("redis-server", av.data());
      ::_exit(127);
    }
    // Ready when it answers.
    for (int i = 0; i < 500; ++i) {
      store::RedisOptions o;
      o.nodes = {{"127.0.0.1", port_}};
      o.timeout_s = 0.5;
      for (size_t k = 0; k + 1 < args_.size(); ++k)
        if (args_[k] == "--requirepass") o.password = args_[k + 1];
      if (store::Redis::connect(o).ok()) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  void stop() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }

 private:
  int port_;
  std::vector<std::string> args_;
  std::string dir_;
  pid_t pid_ = -1;
};

}  // namespace stagelink::testing_util
